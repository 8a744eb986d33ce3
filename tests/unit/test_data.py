"""Data: deterministic order, layout-independent global batches, exact resume, caching, masking."""
import json
import os

import numpy as np
import pytest
import torch

from pipetrain.config import ConfigError, DataConfig
from pipetrain.data import IGNORE_INDEX, Loader, PackedData, load_tokenizer, tokenize_corpus
from pipetrain.data.sources import source_files
from pipetrain.data.loader import batch_slice
from pipetrain.data.order import CHUNK, BlendPattern, WindowOrder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "pipetrain", "assets", "tokenizer")
PLAYS = os.path.join(ROOT, "pipetrain", "assets", "shakespeare")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOKENIZER)


def _stream(n=5000, seed=0):
    tokens = np.random.default_rng(seed).integers(0, 1000, n).astype(np.uint16)
    return tokens, np.ones(n, dtype=bool)


def test_same_seed_gives_same_batches_and_other_seed_differs():
    a = Loader(PackedData(*_stream(), 16, 0.1, seed=3), 8, 0, 1)
    b = Loader(PackedData(*_stream(), 16, 0.1, seed=3), 8, 0, 1)
    c = Loader(PackedData(*_stream(), 16, 0.1, seed=4), 8, 0, 1)
    for _ in range(3):
        (ba, _), (bb, _), (bc, _) = a.next(), b.next(), c.next()
        assert torch.equal(ba.inputs, bb.inputs)
    assert not torch.equal(ba.inputs, bc.inputs)


def test_targets_are_inputs_shifted_by_one():
    data = PackedData(*_stream(), 16, 0.0, seed=0)
    batch = data.train_batch(0, 4)
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])


def test_global_batch_is_layout_independent():
    data = PackedData(*_stream(), 16, 0.1, seed=1)
    single = Loader(data, 8, 0, 1)
    ranks = [Loader(data, 8, r, 4) for r in range(4)]
    for _ in range(5):
        whole, n_whole = single.next()
        parts = [loader.next() for loader in ranks]
        assert torch.equal(whole.inputs, torch.cat([p.inputs for p, _ in parts]))
        assert all(n == n_whole == 8 * 16 for _, n in parts)


@pytest.mark.parametrize("split", [None, {"dp_shard": 2, "microbatch": 3, "counts": [3, 1, 0, 4]}])
def test_batch_slices_tile_the_global_batch_and_consecutive_ranks_read_one_run(split):
    """Every dp rank's slice, in rank order, tiles the global batch with no gap or overlap (uneven dynamic
    counts, a replica with no microbatch), and any run of consecutive ranks reads the union of theirs."""
    gb, dp = 48, 8
    slices = [batch_slice(gb, dp, r, split=split) for r in range(dp)]
    assert [first for first, _ in slices] == [sum(n for _, n in slices[:r]) for r in range(dp)]
    assert sum(n for _, n in slices) == gb
    if split is not None:  # replica r's two ranks read counts[r] microbatches of 3 each
        assert [n for _, n in slices] == [9, 9, 3, 3, 0, 0, 12, 12]
    for first_rank in range(dp):
        for num in range(1, dp - first_rank + 1):
            first, count = batch_slice(gb, dp, first_rank, num, split)
            assert (first, count) == (slices[first_rank][0], sum(n for _, n in slices[first_rank:first_rank + num]))
    assert batch_slice(gb, 1, 0) == (0, gb)  # one rank reads everything


def test_batch_slice_refuses_ranks_outside_dp_and_a_batch_dp_does_not_divide():
    with pytest.raises(ValueError, match="not inside dp_size=4"):
        batch_slice(8, 4, 3, num_ranks=2)
    with pytest.raises(ValueError, match="not inside dp_size=4"):
        batch_slice(8, 4, -1)
    with pytest.raises(ValueError, match="global_batch=10 is not divisible by dp=4"):
        batch_slice(10, 4, 0)


def test_the_loader_reads_its_rank_slice():
    data = PackedData(*_stream(), 16, 0.1, seed=1)
    loader = Loader(data, 12, 2, 3)
    loader.samples = 12
    batch, _ = loader.next()
    assert loader.rank_slice() == (8, 4) and loader.rank_slice(1, 2) == (4, 8)
    assert torch.equal(batch.inputs, data.train_batch(12 + 8, 4).inputs)


def test_state_dict_resumes_at_the_exact_next_sample():
    data = PackedData(*_stream(), 16, 0.1, seed=1)
    a = Loader(data, 4, 0, 1)
    # past the first epoch (5000 tokens / 16 = 312 windows, ~281 train): 7 steps (28 samples) stayed inside it, so
    # a resume that read the position within the epoch (samples % windows) replayed epoch 0's order unseen
    while a.samples <= data.num_train_windows:
        a.next()
    assert a.samples // data.num_train_windows == 1 and a.samples % data.num_train_windows > 0, a.samples
    state = json.loads(json.dumps(a.state_dict()))  # must survive JSON (checkpoint manifest)
    expected, _ = a.next()
    b = Loader(data, 4, 0, 1)
    b.load_state_dict(state)
    got, _ = b.next()
    assert torch.equal(expected.inputs, got.inputs)


def test_epochs_visit_every_train_window_once_in_a_new_order():
    data = PackedData(*_stream(2000), 16, 0.1, seed=2)
    n = data.num_train_windows
    seen = data.train_windows(np.arange(n)).tolist()
    assert sorted(seen) == list(range(n))
    second = data.train_windows(np.arange(n, 2 * n)).tolist()
    assert sorted(second) == sorted(seen) and second != seen
    assert [int(data.train_windows([i])[0]) for i in range(5)] == seen[:5]  # one sample alone reads the same window


def test_window_order_and_blend_pattern_match_their_golden_values():
    """A checkpoint keeps the data position as a count of samples consumed, and a resumed run re-derives
    which windows come next from these functions: a change to them silently changes what every resumed
    checkpoint reads. If this fails, the change must be deliberate, documented as a new order."""
    order = WindowOrder(1000, 1234)  # a 1024-value domain: epoch 0's first 12 include a cycle-walked position
    assert order(0, np.arange(12)).tolist() == [392, 18, 170, 178, 193, 956, 565, 941, 968, 201, 739, 925]
    assert order(1, np.arange(12)).tolist() == [84, 513, 459, 259, 919, 787, 762, 550, 45, 404, 782, 322]
    assert WindowOrder(10, 7)(0, np.arange(10)).tolist() == [3, 6, 4, 2, 5, 9, 1, 8, 0, 7]
    source, index = BlendPattern([3, 1, 2])(np.arange(12))
    assert source.tolist() == [0, 2, 0, 1, 2, 0, 0, 2, 0, 1, 2, 0]
    assert index.tolist() == [0, 0, 1, 0, 1, 2, 3, 2, 4, 1, 3, 5]
    source, index = BlendPattern([3, 1, 2])(np.arange(CHUNK, CHUNK + 3))  # the second chunk repeats the first
    assert source.tolist() == [0, 2, 0] and index.tolist() == [32768, 21845, 32769]


def _documents(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def test_validation_holds_out_whole_documents():
    lengths = np.random.default_rng(0).integers(5, 60, 200)
    documents = _documents(lengths)
    tokens = np.arange(documents[-1]).astype(np.uint32)  # token value = its position: rows name their source
    data = PackedData(tokens, None, 16, 0.1, seed=3, documents=documents)
    doc_of = np.searchsorted(documents, tokens, side="right") - 1
    train = data.train_batch(0, data.num_train_windows)
    val = data.val_batch(0, data.num_val_windows)
    train_docs = set(doc_of[train.inputs.flatten().numpy()]) | set(doc_of[train.targets.flatten().numpy()])
    val_docs = set(doc_of[val.inputs.flatten().numpy()]) | set(doc_of[val.targets.flatten().numpy()])
    assert train_docs.isdisjoint(val_docs) and len(val_docs) >= 15
    assert len(train_docs) + len(val_docs) >= 195  # only window tails are left unread


def test_order_is_o1_per_sample_at_pre_training_scale():
    """No sample builds anything the size of the corpus (a permutation of its 1.2M windows would take 9.8 MB):
    checked by the bytes numpy allocates, not by a timing (timings are benchmarks' business)."""
    import tracemalloc

    n = 2_500_000_000 // 2048
    data = PackedData(np.zeros(n * 2048 + 1, dtype=np.uint8), None, 2048, 0.0, seed=1)  # never read
    data.train_windows([0])  # whatever the first call sets up once
    tracemalloc.start()
    try:
        windows = [int(data.train_windows([10 * n + i])[0]) for i in range(200)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(set(windows)) == 200 and max(windows) < n
    assert peak < n, f"{peak} bytes allocated at the peak for {n} windows"


def test_resume_with_other_data_is_refused():
    a = Loader(PackedData(*_stream(), 16, 0.1, seed=1), 4, 0, 1)
    b = Loader(PackedData(*_stream(), 32, 0.1, seed=1), 4, 0, 1)
    with pytest.raises(ConfigError, match="resume with the same data"):
        b.load_state_dict(a.state_dict())


def test_resume_with_the_tokens_of_another_tokenizer_is_refused():
    """A tokenizer of the same size with other tokens (a fuzz finding: the window count could not see it) gives
    prepared data of another fingerprint; a checkpoint from before fingerprints were recorded still resumes."""
    a = Loader(PackedData(*_stream(), 16, 0.1, seed=1, tokenizer="aaaa"), 4, 0, 1)
    b = Loader(PackedData(*_stream(), 16, 0.1, seed=1, tokenizer="bbbb"), 4, 0, 1)
    with pytest.raises(ConfigError, match="tokenized by a tokenizer of fingerprint aaaa, but this run's "
                                          "data.tokenizer gives bbbb"):
        b.load_state_dict(a.state_dict())
    old = {k: v for k, v in a.state_dict().items() if k != "tokenizer"}
    b.load_state_dict(old)
    a.load_state_dict(a.state_dict())


def test_masked_targets_are_ignored_and_counted_globally():
    tokens, mask = _stream(400)
    mask[::3] = False
    data = PackedData(tokens, mask, 16, 0.0, seed=0)
    loader = Loader(data, 4, 1, 2)
    batch, total = loader.next()
    whole = data.train_batch(0, 4)
    assert total == int((whole.targets != IGNORE_INDEX).sum()) < 4 * 16
    assert (batch.targets == IGNORE_INDEX).any()


def test_text_folder_is_tokenised_once_and_cached(tmp_path, tokenizer):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("To be, or not to be.\nThat is the question.\n")
    (corpus / "b.txt").write_text("Friends, Romans, countrymen.\n")
    cfg = DataConfig(path=str(corpus), tokenizer=TOKENIZER, cache_dir=str(tmp_path / "cache"))
    tokens, mask = tokenize_corpus(cfg, tokenizer)
    assert (tokens == tokenizer.eos_token_id).sum() == 2 and mask.all()
    assert tokenizer.decode(tokens[:6].tolist()).startswith("To be, or not")
    cached = [f for f in os.listdir(tmp_path / "cache") if f.startswith("prepared-")]
    assert len(cached) == 1 and os.path.isfile(tmp_path / "cache" / cached[0] / "manifest.json")
    again, _ = tokenize_corpus(cfg, tokenizer)
    assert np.array_equal(tokens, again)


def test_jsonl_prompt_completion_trains_only_the_completion(tmp_path, tokenizer):
    path = tmp_path / "sft.jsonl"
    rows = [{"prompt": "Q: who is Hamlet?\nA:", "completion": " a prince"}] * 3
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DataConfig(path=str(path), tokenizer=TOKENIZER, cache_dir=str(tmp_path / "cache"))
    tokens, mask = tokenize_corpus(cfg, tokenizer)
    n_prompt = len(tokenizer("Q: who is Hamlet?\nA:", add_special_tokens=False)["input_ids"])
    trained = tokenizer.decode(tokens[:len(tokens) // 3][mask[:len(tokens) // 3]].tolist())
    assert trained == " a prince<|endoftext|>"
    assert not mask[:n_prompt].any()


def test_missing_path_and_tokenizer_are_config_errors(tmp_path, tokenizer):
    with pytest.raises(ConfigError, match="not found"):
        tokenize_corpus(DataConfig(path=str(tmp_path / "missing"), tokenizer="x"), tokenizer)
    with pytest.raises(ConfigError, match="data.tokenizer"):
        load_tokenizer(str(tmp_path / "no-tokenizer"))


def test_shipped_corpus_is_exactly_its_plays():
    """Every text file in a corpus folder is a document: the attribution note lives beside the folder, so
    the default run's stream is the 14 plays and nothing else (no file of any other kind sits there)."""
    kind, files = source_files(PLAYS)
    assert kind == "text" and len(files) == 14, files
    assert all(f.endswith("_gut.txt") for f in files), files
    assert sorted(os.listdir(PLAYS)) == [os.path.basename(f) for f in files]
    assert os.path.isfile(os.path.join(ROOT, "pipetrain", "assets", "SOURCE.md"))  # the attribution is kept


def test_one_document_holds_out_its_last_tokens_for_validation():
    """Whole documents cannot give val_fraction of a one-document corpus (one big .txt file): its last 10% of
    tokens become the validation stream, and no training window reads a held-out token."""
    tokens = np.arange(1000, dtype=np.uint16)
    data = PackedData(tokens, None, 16, 0.1, seed=0, documents=np.array([0, 1000]))
    assert "last 10.0% of each document" in data.val_split
    assert (data.num_train_windows, data.num_val_windows) == ((900 - 1) // 16, (100 - 1) // 16)
    val = data.val_batch(0, data.num_val_windows)
    train = data.train_batch(0, data.num_train_windows)
    assert int(train.targets.max()) < 900 == int(val.inputs.min()) and int(val.targets.max()) < 1000


def test_few_documents_each_hold_out_their_end_and_many_hold_out_whole_documents():
    """Three documents at val_fraction 0.05 round to no whole document: each gives its last ceil(5%) tokens.
    Forty give two whole documents, chosen by the seed, as before."""
    docs = np.array([0, 300, 700, 1000])
    data = PackedData(np.arange(1000, dtype=np.uint16), None, 8, 0.05, seed=0, documents=docs)
    assert data.val.starts.tolist() == [285, 680, 985] and data.val.lengths.tolist() == [15, 20, 15]
    assert data.train.starts.tolist() == [0, 300, 700] and data.train.lengths.tolist() == [285, 380, 285]
    many = PackedData(np.arange(4000, dtype=np.uint16), None, 8, 0.05, seed=0, documents=np.arange(0, 4001, 100))
    assert many.val_split == "2 whole document(s)" and many.val.lengths.sum() == 200


def test_links_leading_out_of_a_data_folder_are_refused_and_links_inside_it_are_read(tmp_path):
    """Nothing outside the folder given is read: glob follows a file link and a folder link out of data.path."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not for training\n")
    for name, link, target in (("file", "b.txt", outside / "secret.txt"), ("folder", "sub", outside)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "a.txt").write_text("text\n")
        os.symlink(target, folder / link)
        with pytest.raises(ConfigError, match=r"links outside the folder .* copy the file into the folder"):
            source_files(str(folder))
    inside = tmp_path / "inside"
    inside.mkdir()
    (inside / "a.txt").write_text("text\n")
    os.symlink("a.txt", inside / "b.txt")
    assert source_files(str(inside)) == ("text", [str(inside / "a.txt"), str(inside / "b.txt")])


@pytest.mark.parametrize("kind", ["pipe", "folder", "broken-link"])
def test_an_entry_of_a_data_folder_that_is_not_a_regular_file_is_refused_in_one_line(tmp_path, kind):
    """A pipe named x.txt blocked its first read forever; a folder named x.txt and a broken link failed deep in a
    reader with a traceback."""
    (tmp_path / "a.txt").write_text("text\n")
    odd = tmp_path / "b.txt"
    if kind == "pipe":
        os.mkfifo(odd)
    elif kind == "folder":
        odd.mkdir()
    else:
        os.symlink("nothere.txt", odd)
    words = {"pipe": r"not a regular file \(a pipe", "folder": "a folder;", "broken-link": "a broken link;"}[kind]
    with pytest.raises(ConfigError, match=f"data.path: {odd} is {words}.* remove it from the folder or rename it"):
        source_files(str(tmp_path))
