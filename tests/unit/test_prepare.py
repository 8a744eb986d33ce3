"""Prepared corpora: atomic and idempotent prepare, memory maps, manifest checks, blends, bad input."""
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pipetrain.config import ConfigError, DataConfig, build_recipe
from pipetrain.data import (BlendedData, PackedData, build_data, is_prepared, load_tokenizer, open_prepared, prepare,
                            prepared_dir_for)
from pipetrain.data.corpus import MANIFEST, _HashedWriter, text_pieces
from pipetrain.data.order import BlendPattern, WindowOrder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "pipetrain", "assets", "tokenizer")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOKENIZER)


def _corpus(folder, n=6):
    folder.mkdir(exist_ok=True)
    for i in range(n):
        (folder / f"doc{i}.txt").write_text(f"Document {i}. " + "To be, or not to be, that is the question. " * (5 + i))
    return str(folder)


def _files(path):
    return {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path))}


def test_prepare_writes_memory_maps_and_a_manifest(tmp_path, tokenizer):
    out = prepare(_corpus(tmp_path / "raw"), tokenizer, cache_dir=str(tmp_path / "cache"), progress=False)
    corpus = open_prepared(out, tokenizer, verify=True)
    m = corpus.manifest
    assert isinstance(corpus.tokens, np.memmap) and corpus.tokens.dtype == np.uint16  # 8192 ids fit 16 bits
    assert m["num_documents"] == 6 and len(m["sources"]) == 6 and all(len(s["sha256"]) == 64 for s in m["sources"])
    assert corpus.mask is None and not os.path.exists(os.path.join(out, "mask.bin"))  # plain text: no mask file
    ends = np.asarray(corpus.documents[1:]) - 1
    assert (np.asarray(corpus.tokens)[ends] == tokenizer.eos_token_id).all()
    first = tokenizer.decode(np.asarray(corpus.tokens[corpus.documents[0]:corpus.documents[1] - 1]).tolist())
    assert first == (tmp_path / "raw" / "doc0.txt").read_text()


def test_prepare_is_idempotent(tmp_path, tokenizer):
    raw = _corpus(tmp_path / "raw")
    cache = str(tmp_path / "cache")
    out = prepared_dir_for(raw, "text", tokenizer, cache)
    assert prepare(raw, tokenizer, cache_dir=cache, progress=False) == out
    before = os.stat(os.path.join(out, "tokens.bin")).st_mtime_ns
    assert prepare(raw, tokenizer, cache_dir=cache, progress=False) == out  # returns at once, writes nothing
    assert os.stat(os.path.join(out, "tokens.bin")).st_mtime_ns == before


def _records(path, n):
    """n one-line text records; past 1024 of them a prepare writes tokens.bin in several blocks."""
    path.write_text("\n".join(json.dumps({"text": f"Record {i}: to be, or not to be, that is the question."})
                              for i in range(n)))
    return str(path)


def _prepare_stopped_after_first_block(raw, out, cache):
    """A child process: prepare `raw` into `out`, then stop for good after the first block of tokens.bin.
    The kill has to land while the temp directory is half written; writing all blocks takes tens of ms, too
    short a window to hit by polling on a loaded machine, so the writer holds still until it is killed."""
    write = _HashedWriter.write

    def write_then_hold(self, array):
        write(self, array)
        if os.path.basename(self.path) == "tokens.bin":
            self.file.flush()  # the parent sees the first block on disk
            threading.Event().wait(600)  # the parent kills it long before; bounded should the parent die first
            os._exit(1)

    _HashedWriter.write = write_then_hold
    prepare(raw, load_tokenizer(TOKENIZER), cache_dir=cache, progress=False, out_dir=out)


def _prepared_files(path):
    """Every file of a prepared directory, the manifest without its timing."""
    files = _files(path)
    manifest = json.loads(files.pop(MANIFEST))
    del manifest["prepare_seconds"]
    return files, manifest


def test_prepare_killed_midway_leaves_nothing_prepared_and_a_rerun_writes_the_same_bytes(tmp_path, tokenizer):
    raw, cache = _records(tmp_path / "records.jsonl", 2500), str(tmp_path / "cache")
    out = str(tmp_path / "prepared")
    child = multiprocessing.get_context("spawn").Process(target=_prepare_stopped_after_first_block,
                                                         args=(raw, out, cache))
    child.start()
    try:
        temp = Path(f"{out}.tmp-{socket.gethostname()}-{child.pid}")  # the name remove_dead_temps parses
        deadline = time.monotonic() + 300
        while not (temp / "tokens.bin").is_file() or (temp / "tokens.bin").stat().st_size == 0:
            assert child.is_alive(), f"prepare exited with {child.exitcode} before writing {temp}"
            assert time.monotonic() < deadline, f"no tokens in {temp} after 300 s"
            time.sleep(0.05)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join()
    assert child.exitcode == -signal.SIGKILL
    partial = (temp / "tokens.bin").stat().st_size
    assert not is_prepared(out) and not os.path.exists(out) and not (temp / MANIFEST).exists()
    with pytest.raises(ConfigError, match="has no manifest.json"):
        open_prepared(out, tokenizer)

    assert prepare(raw, tokenizer, cache_dir=cache, progress=False, out_dir=out) == out
    assert not temp.exists()  # its writer is dead: the rerun deleted it
    reference = prepare(raw, tokenizer, cache_dir=cache, progress=False, out_dir=str(tmp_path / "uninterrupted"))
    assert _prepared_files(out) == _prepared_files(reference)
    assert 0 < partial < os.path.getsize(os.path.join(out, "tokens.bin"))  # the kill came midway
    assert open_prepared(out, tokenizer, verify=True).manifest["num_documents"] == 2500


def test_prepare_deletes_temp_directories_of_dead_writers_only(tmp_path, tokenizer):
    out = str(tmp_path / "prepared")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    temps = {"dead writer": f"{out}.tmp-{host}-{dead.pid}", "live writer": f"{out}.tmp-{host}-{os.getppid()}",
             "other host": f"{out}.tmp-elsewhere-{dead.pid}", "other directory": f"{out}-2.tmp-{host}-{dead.pid}"}
    for temp in temps.values():
        os.makedirs(temp)
        Path(temp, "tokens.bin").write_bytes(b"\0" * 10)
    prepare(_corpus(tmp_path / "raw"), tokenizer, cache_dir=str(tmp_path / "cache"), progress=False, out_dir=out)
    assert {who: os.path.exists(temp) for who, temp in temps.items()} == \
        {"dead writer": False, "live writer": True, "other host": True, "other directory": True}


def test_data_path_may_name_a_prepared_directory(tmp_path, tokenizer):
    out = prepare(_corpus(tmp_path / "raw"), tokenizer, cache_dir=str(tmp_path / "cache"), progress=False)
    a = build_data(DataConfig(path=str(tmp_path / "raw"), cache_dir=str(tmp_path / "cache")), tokenizer, 16)
    b = build_data(DataConfig(path=out), tokenizer, 16)
    assert (a.train_batch(0, 8).inputs == b.train_batch(0, 8).inputs).all()


def test_num_proc_2_writes_the_same_tokens(tmp_path, tokenizer):
    raw = _corpus(tmp_path / "raw")
    one = prepare(raw, tokenizer, out_dir=str(tmp_path / "one"), cache_dir=str(tmp_path / "c"), progress=False)
    two = prepare(raw, tokenizer, out_dir=str(tmp_path / "two"), cache_dir=str(tmp_path / "c"), progress=False,
                  num_proc=2)
    assert _files(one)["tokens.bin"] == _files(two)["tokens.bin"]


def test_prepared_directory_of_another_tokenizer_is_refused(tmp_path, tokenizer):
    out = prepare(_corpus(tmp_path / "raw"), tokenizer, cache_dir=str(tmp_path / "cache"), progress=False)
    other = load_tokenizer(TOKENIZER)
    other.chat_template = "{{ messages }}"  # renders chat data differently: another tokenizer
    with pytest.raises(ConfigError, match=f"data.path: {out} was prepared with tokenizer .*prepare"):
        open_prepared(out, other)


def test_truncated_token_file_and_hash_mismatch_are_refused(tmp_path, tokenizer):
    out = prepare(_corpus(tmp_path / "raw"), tokenizer, cache_dir=str(tmp_path / "cache"), progress=False)
    copy = str(tmp_path / "copy")
    shutil.copytree(out, copy)
    with open(os.path.join(copy, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["files"]["documents.bin"]["sha256"] = "0" * 64
    with open(os.path.join(copy, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ConfigError, match="documents.bin does not match the sha256 .*prepare again"):
        open_prepared(copy, tokenizer, verify=True)
    tokens = os.path.join(out, "tokens.bin")
    os.truncate(tokens, os.path.getsize(tokens) - 2)
    with pytest.raises(ConfigError, match="tokens.bin is truncated .*prepare again"):
        open_prepared(out, tokenizer)


def test_source_changed_after_prepare_is_refused(tmp_path, tokenizer):
    raw = _corpus(tmp_path / "raw")
    out = prepare(raw, tokenizer, cache_dir=str(tmp_path / "cache"), progress=False)
    (tmp_path / "raw" / "doc1.txt").write_text("something else entirely")
    with pytest.raises(ConfigError, match="doc1.txt changed since"):
        open_prepared(out, tokenizer, verify=True, sources=True)


def test_empty_source_is_refused(tmp_path, tokenizer):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    for path in (tmp_path / "empty.jsonl", tmp_path / "blank"):
        with pytest.raises(ConfigError, match=f"data.path: '{path}' holds no"):
            prepare(str(path), tokenizer, cache_dir=str(tmp_path / "cache"), progress=False)


@pytest.mark.parametrize("records", ['{"text": "fine"}\n{"text": 5}\n', '{"text": 5}\n{"text": 7}\n',
                                     '{"text": "fine"}\n{"text": null}\n'], ids=["mixed", "numbers", "null"])
def test_a_text_field_that_is_not_text_is_named(tmp_path, tokenizer, records):
    path = tmp_path / "data.jsonl"
    path.write_text(records)
    with pytest.raises(ConfigError, match=r"data.text_field='text': record \d holds (5|None), not text"):
        prepare(str(path), tokenizer, cache_dir=str(tmp_path / "cache"), progress=False)
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_a_long_document_tokenised_in_pieces_gives_the_whole_documents_tokens(tokenizer):
    with open(os.path.join(ROOT, "pipetrain", "assets", "shakespeare", "hamlet_gut.txt")) as f:
        text = f.read()[:60_000] + "  double  spaces,\ttabs and\n\n\nnewlines   end"
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    for limit in (64, 1000, 7777):
        pieces = text_pieces(text, limit)
        assert "".join(pieces) == text and max(map(len, pieces)) <= limit and len(pieces) > 1
        ids = [t for piece in pieces for t in tokenizer(piece, add_special_tokens=False)["input_ids"]]
        assert ids == whole, limit
    runs = "".join(f"word{i}" + " " * (i % 5 + 1) + "\n" * (i % 3) for i in range(400))  # cuts near runs of spaces
    for limit in range(24, 64):
        assert [t for piece in text_pieces(runs, limit) for t in tokenizer(piece, add_special_tokens=False)[
            "input_ids"]] == tokenizer(runs, add_special_tokens=False)["input_ids"], limit
    assert text_pieces("x" * 10, 4) == ["xxxx", "xxxx", "xx"]  # no boundary at all: cut at the limit


def _prepare_peak_rss(tmp_path, megabytes: int) -> int:
    """Peak RSS in bytes of a fresh process preparing a one-line file of `megabytes` MB."""
    rng = np.random.default_rng(0)
    words = np.array(["the", "king", "doth", "wake", "tonight", "and", "takes", "his", "rouse"])
    line = " ".join(words[rng.integers(0, len(words), megabytes * 1024 * 1024 // 4)])[:megabytes * 1024 * 1024]
    path = tmp_path / f"line{megabytes}.txt"
    path.write_text(line)
    probe = ("from pipetrain.data import load_tokenizer, prepare\n"
             f"prepare({str(path)!r}, load_tokenizer({TOKENIZER!r}), cache_dir={str(tmp_path / 'c')!r}, "
             f"out_dir={str(tmp_path / f'p{megabytes}')!r}, progress=False)\n"
             # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forking (pytest) process
             "print([int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM')][0])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


def test_prepare_memory_stays_flat_as_a_single_line_grows(tmp_path):
    """A 4x longer line costs a few bytes a character more (the text and its int32 ids), not the tokenizer's
    ~140 bytes a character: before pieces, 5 MB peaked at 1.1 GB and 20 MB at 3.2 GB."""
    small, large = _prepare_peak_rss(tmp_path, 2), _prepare_peak_rss(tmp_path, 8)  # MB: the old cost shows as 800 MB
    assert large - small < 6 * 1024 * 1024 * 10, (small, large)  # under 10 bytes per added character


def test_non_positive_blend_weight_is_refused():
    raw = {"data": {"sources": [{"path": "/a", "weight": 1}, {"path": "/b", "weight": 0}], "tokenizer": "/t"}}
    with pytest.raises(ConfigError, match=r"data.sources\[1\].weight=0 must be a positive finite number"):
        build_recipe(raw)


def test_window_order_is_a_bijection_for_every_size():
    for n in (1, 2, 3, 7, 64, 1000, 4097):
        for epoch in (0, 5):
            assert sorted(WindowOrder(n, 9)(epoch, np.arange(n)).tolist()) == list(range(n))


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 2, 5], [0.05, 0.95]])
def test_blends_hit_their_weights_within_one_over_sqrt_n(weights):
    pattern = BlendPattern(weights)
    w = np.asarray(weights) / sum(weights)
    for n in (100, 1000, 70_000, 200_000):
        src, idx = pattern(np.arange(n))
        share = np.bincount(src, minlength=len(w)) / n
        assert np.abs(share - w).max() <= 1 / np.sqrt(n)
        for d in range(len(w)):  # each source's samples are read in order, none skipped or repeated
            assert (idx[src == d] == np.arange((src == d).sum())).all()


def test_blended_batches_draw_from_each_source_and_resume_exactly():
    a = PackedData(np.full(4000, 1, dtype=np.uint16), None, 16, 0.1, seed=1)
    b = PackedData(np.full(4000, 2, dtype=np.uint16), None, 16, 0.1, seed=2)
    data = BlendedData([a, b], [3, 1])
    batch = data.train_batch(0, 400)
    share = float((batch.inputs[:, 0] == 1).float().mean())
    assert abs(share - 0.75) <= 1 / np.sqrt(400)
    assert (data.train_batch(123, 7).inputs == batch.inputs[123:130]).all()  # any slice is the same samples
    assert len(data.val_batch(0, 8).inputs) == 8


def test_prepare_command_prepares_a_recipes_sources_and_exits_2_on_bad_input(tmp_path, capsys):
    from pipetrain.data.__main__ import main

    raw = _corpus(tmp_path / "raw")
    recipe = os.path.join(ROOT, "recipes", "tiny.yaml")
    sets = ["--set", f"data.path={raw}", "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    assert main(["prepare", "--recipe", recipe] + sets) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert os.path.isfile(os.path.join(out, "manifest.json"))
    assert main(["prepare", "--recipe", recipe, "--set", f"data.path={tmp_path / 'missing'}"]) == 2
    assert capsys.readouterr().err.startswith("error: data.path:")
    # a prepared directory found damaged (here: truncated) is reported, where prepare printed its path, exit 0
    with open(os.path.join(out, "tokens.bin"), "r+b") as f:
        f.truncate(10)
    assert main(["prepare", "--recipe", recipe] + sets) == 2
    assert "tokens.bin is truncated or damaged" in capsys.readouterr().err


def test_data_sources_blend_prepared_corpora_and_report_each_share(tmp_path, tokenizer, capsys):
    a, b = _corpus(tmp_path / "a", 4), _corpus(tmp_path / "b", 5)
    cfg = DataConfig(sources=[{"path": a, "weight": 3}, {"path": b, "weight": 1}], cache_dir=str(tmp_path / "c"),
                     val_fraction=0.25)
    data = build_data(cfg, tokenizer, 16, log=True)
    assert isinstance(data, BlendedData) and data.num_val_windows > 0
    out = capsys.readouterr().out
    assert "data.sources[0]" in out and "75.0% of samples" in out and "25.0% of samples" in out
    assert len(data.train_batch(0, 32).inputs) == 32


@pytest.mark.parametrize("edit,message", [
    (lambda m: [1, 2, 3], "has format a JSON list"),
    (lambda m: {"format": m["format"]}, r"is damaged \(tokenizer must hold a name and a fingerprint\)"),
    (lambda m: {**m, "dtype": "complex1024"}, r"is damaged \(dtype must be uint16 or uint32, got 'complex1024'\)"),
    (lambda m: {**m, "num_tokens": "many"}, r"is damaged \(num_tokens must be an integer >= 0, got 'many'\)"),
    (lambda m: {**m, "has_mask": None}, r"is damaged \(has_mask must be true or false\)"),
    (lambda m: {**m, "files": {}}, r"is damaged \(files must give the size and sha256 of tokens.bin"),
])
def test_a_damaged_prepared_manifest_is_refused_in_one_line(tmp_path, tokenizer, edit, message):
    out = prepare(_corpus(tmp_path / "raw", n=2), tokenizer, cache_dir=str(tmp_path / "cache"), progress=False)
    path = os.path.join(out, MANIFEST)
    with open(path) as f:
        manifest = json.load(f)
    with open(path, "w") as f:
        json.dump(edit(manifest), f)
    with pytest.raises(ConfigError, match=message + r".*delete .* and prepare again"):
        open_prepared(out, tokenizer)


@pytest.mark.parametrize("name,content,message", [
    ("a.jsonl", b'{"text": "hello"}\n{"text": broken\n', r"could not be read as json \(ValueError: .*jsonl: one JSON"),
    ("a.jsonl", b"[1, 2]\n[3]\n", r"could not be read as json"),
    ("a.parquet", b"not parquet", r"could not be read as parquet \(ArrowInvalid: Parquet magic bytes"),
    ("a.txt", b"fine\nbad \xff\n", r"a.txt is not UTF-8 text \(byte 0xff at offset 9\)"),
    ("a.md", b"# fine\nbad \xff\n", r"a.md is not UTF-8 text \(byte 0xff at offset 11\)"),  # read as text too
    ("a.text", b"ends inside \xc3", r"a.text is not UTF-8 text \(it ends inside a multi-byte character\)"),
])
def test_damaged_raw_files_are_refused_in_one_line_naming_the_source(tmp_path, tokenizer, name, content, message):
    """The datasets readers fail deep inside their own code on these; prepare names the source instead."""
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / name).write_bytes(content)
    with pytest.raises(ConfigError, match=r"data.sources\[1\]: .*" + message):
        prepare(str(raw), tokenizer, cache_dir=str(tmp_path / "cache"), progress=False, where="data.sources[1]")


def test_every_suffix_read_as_text_or_json_is_checked_for_utf8():
    from pipetrain.data.checks import UTF8_SUFFIXES
    from pipetrain.data.sources import _EXTENSIONS
    assert set(UTF8_SUFFIXES) == {s for s, kind in _EXTENSIONS.items() if kind in ("text", "json")}


def _edited_copy(out, folder, edit):
    """A copy of the prepared directory out, with edit(path of the copy, its manifest) applied and resealed."""
    copy = folder / "copy"
    shutil.copytree(out, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    edit(copy, manifest)
    (copy / MANIFEST).write_text(json.dumps(manifest))
    return str(copy)


def test_a_prepared_folder_handed_over_reads_nothing_outside_itself(tmp_path, tokenizer):
    """A prepared folder given as data.path stands alone: its manifest's sources (a pipe named there blocked the
    run forever) are not read, and its files may not be links out of it."""
    out = prepare(_corpus(tmp_path / "raw"), tokenizer, cache_dir=str(tmp_path / "cache"), progress=False)
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)

    def name_the_pipe(copy, manifest):
        manifest["sources"] = [{"path": str(pipe), "size": 0, "mtime_ns": 1, "sha256": "0" * 64}]
    copy = _edited_copy(out, tmp_path / "a", name_the_pipe)
    data = build_data(DataConfig(path=copy, tokenizer=TOKENIZER, cache_dir=str(tmp_path / "cache")), tokenizer, 16)
    assert data.num_train_windows > 0

    def link_out(copy, manifest):
        outside = tmp_path / "outside.bin"
        shutil.move(copy / "tokens.bin", outside)
        os.symlink(outside, copy / "tokens.bin")
    copy = _edited_copy(out, tmp_path / "b", link_out)
    with pytest.raises(ConfigError, match="tokens.bin links outside the folder"):
        open_prepared(copy, tokenizer)


@pytest.mark.parametrize("damage, needle", [
    (lambda m: m["sources"].append({"path": "x"}), "sources must be a list of mappings of path, size"),
    (lambda m: m["sources"].append({"path": ["a"], "size": 1, "mtime_ns": 1, "sha256": "x"}), "sources must be"),
], ids=["no-size", "path-a-list"])
def test_a_hand_edited_source_entry_is_one_line_not_a_traceback(tmp_path, tokenizer, damage, needle):
    out = prepare(_corpus(tmp_path / "raw"), tokenizer, cache_dir=str(tmp_path / "cache"), progress=False)
    copy = _edited_copy(out, tmp_path, lambda c, m: damage(m))
    with pytest.raises(ConfigError, match=needle):
        open_prepared(copy, tokenizer, verify=True, sources=True)


def test_document_offsets_that_do_not_rise_to_num_tokens_are_refused(tmp_path, tokenizer):
    out = prepare(_corpus(tmp_path / "raw"), tokenizer, cache_dir=str(tmp_path / "cache"), progress=False)

    def scramble(copy, manifest):
        docs = np.fromfile(copy / "documents.bin", dtype=np.int64)
        docs[1], docs[2] = docs[2], docs[1]
        docs.tofile(copy / "documents.bin")
    with pytest.raises(ConfigError, match="documents.bin does not hold document offsets from 0 to num_tokens"):
        open_prepared(_edited_copy(out, tmp_path, scramble), tokenizer)


def test_token_ids_past_the_tokenizer_are_refused_when_verified(tmp_path, tokenizer):
    """Edited tokens (with the hashes sealed again) reached the embedding as an IndexError traceback."""
    out = prepare(_corpus(tmp_path / "raw"), tokenizer, cache_dir=str(tmp_path / "cache"), progress=False)

    def edit(copy, manifest):
        tokens = np.fromfile(copy / "tokens.bin", dtype=manifest["dtype"])
        tokens[3] = len(tokenizer)
        tokens.tofile(copy / "tokens.bin")
        manifest["files"]["tokens.bin"]["sha256"] = hashlib.sha256((copy / "tokens.bin").read_bytes()).hexdigest()
    with pytest.raises(ConfigError, match=f"tokens.bin holds token id {len(tokenizer)}, past the tokenizer's"):
        open_prepared(_edited_copy(out, tmp_path, edit), tokenizer, verify=True)
