"""open_prepared: a documents.bin whose offsets rise but do not start at 0 or do not end at num_tokens is
refused in one line. tests/unit/test_prepare.py swaps two offsets (not rising) only, so dropping either end's
check passed it: a first offset past 0 loses the first tokens, a last one short of num_tokens the last ones."""
import json
import os
import shutil

import numpy as np
import pytest

from pipetrain.config import ConfigError
from pipetrain.data import load_tokenizer, open_prepared, prepare
from pipetrain.data.corpus import MANIFEST

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "pipetrain", "assets", "tokenizer")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tokenizer = load_tokenizer(TOKENIZER)
    raw = tmp_path_factory.mktemp("raw")
    for i in range(4):
        (raw / f"doc{i}.txt").write_text(f"Document {i}. " + "To be, or not to be, that is the question. " * (5 + i))
    return prepare(str(raw), tokenizer, cache_dir=str(tmp_path_factory.mktemp("cache")), progress=False), tokenizer


def _with_offsets(out, folder, edit):
    copy = folder / "copy"
    shutil.copytree(out, copy)
    docs = np.fromfile(copy / "documents.bin", dtype=np.int64)
    edit(docs, json.loads((copy / MANIFEST).read_text())["num_tokens"])
    docs.tofile(copy / "documents.bin")
    return str(copy)


def test_the_untouched_copy_opens(prepared, tmp_path):
    out, tokenizer = prepared
    corpus = open_prepared(_with_offsets(out, tmp_path, lambda docs, n: None), tokenizer)
    assert corpus.documents[0] == 0


@pytest.mark.parametrize("edit", [lambda docs, n: docs.__setitem__(0, 1),
                                  lambda docs, n: docs.__setitem__(-1, n - 1)],
                         ids=["first-offset-past-0", "last-offset-short-of-num_tokens"])
def test_rising_offsets_that_do_not_span_0_to_num_tokens_are_refused(prepared, tmp_path, edit):
    out, tokenizer = prepared
    copy = _with_offsets(out, tmp_path, edit)
    assert (np.diff(np.fromfile(os.path.join(copy, "documents.bin"), dtype=np.int64)) >= 0).all()  # still rising
    with pytest.raises(ConfigError, match="documents.bin does not hold document offsets from 0 to num_tokens"):
        open_prepared(copy, tokenizer)
