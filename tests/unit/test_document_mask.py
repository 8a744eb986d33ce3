"""Document masking: block-causal attention inside packed windows, positions restarting per document."""
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipetrain.config import DataConfig, ModelConfig
from pipetrain.data import IGNORE_INDEX, PackedData, build_data, load_tokenizer, open_prepared, prepared_dir_for
from pipetrain.models import build, materialize
from pipetrain.models.decoder import document_mask

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "pipetrain", "assets", "tokenizer")

FP32 = dict(rtol=1e-5, atol=1e-5)  # the masked window sums softmax over other (zero-weight) keys


def _model(family, vocab_size=97, **kw):
    cfg = ModelConfig(family=family, vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=32, **kw)
    model = materialize(build(cfg), cfg, seed=0, device="cpu")
    return model.eval()


@pytest.mark.parametrize("family,kw", [("llama", {}), ("gpt2", {}), ("mistral", {"sliding_window": 4})])
def test_two_document_window_gives_each_document_its_own_loss(family, kw):
    model = _model(family, **kw)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 97, (1, 11), generator=g), torch.randint(0, 97, (1, 13), generator=g)
    window = torch.cat([a, b], dim=1)  # (1, 24): document a then document b
    positions = torch.cat([torch.arange(11), torch.arange(13)])[None]
    with torch.no_grad():
        packed = model(window[:, :-1], positions[:, :-1])
        alone_a, alone_b = model(a[:, :-1]), model(b[:, :-1])
        unmasked = model(window[:, :-1])
    torch.testing.assert_close(packed[:, :10], alone_a, **FP32)
    torch.testing.assert_close(packed[:, 11:], alone_b, **FP32)
    assert not torch.allclose(unmasked[:, 11:], alone_b, **FP32)  # without the mask b sees a

    def losses(logits, tokens):
        return F.cross_entropy(logits[0], tokens[0, 1:], reduction="none")

    packed_loss = F.cross_entropy(packed[0], window[0, 1:], reduction="none")
    torch.testing.assert_close(packed_loss[:10], losses(alone_a, a), **FP32)
    torch.testing.assert_close(packed_loss[11:], losses(alone_b, b), **FP32)


def test_gradients_flow_only_within_documents():
    model = _model("llama")
    window = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(6), torch.arange(10)])[None]
    emb = model.embed(window).detach().requires_grad_(True)
    h = emb
    for layer in model.layers.values():
        h = layer(h, positions)
    h[0, 3].sum().backward()  # a token of document one
    assert emb.grad[0, 6:].abs().max() == 0 and emb.grad[0, :4].abs().max() > 0


def test_mask_is_causal_within_each_document():
    positions = torch.tensor([[3, 4, 0, 1, 2, 0]])  # a document cut by the window start, two more
    mask = document_mask(positions)[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0],
                             [0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("val_fraction", [0.0, 0.3])  # 0.3: windows span the gap left by held-out documents
def test_loader_positions_restart_at_each_document_and_at_the_window_start(val_fraction):
    lengths = [5, 9, 3, 20, 7, 12, 4, 6, 30, 2]
    documents = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.arange(documents[-1]).astype(np.uint16)
    data = PackedData(tokens, None, 8, val_fraction, seed=0, documents=documents, document_mask=True)
    batch = data.train_batch(0, data.num_train_windows)
    for row_in, row_pos in zip(batch.inputs.numpy(), batch.positions.numpy()):
        doc = np.searchsorted(documents, row_in, side="right") - 1
        start = np.maximum(documents[doc], row_in[0])  # a document begun before the window restarts at 0
        assert (row_pos == row_in - start).all()
    parts = batch.split(2)
    assert torch.equal(torch.cat([p.positions for p in parts]), batch.positions)


def test_sft_records_packed_with_document_mask_restart_positions_and_never_see_each_other(tmp_path):
    tokenizer = load_tokenizer(TOKENIZER)
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"Q: who speaks in scene {i}?\nA:",
                                          "completion": " Hamlet" + ", then Horatio" * (i % 4)})
                              for i in range(40)))
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), val_fraction=0.0, document_mask=True)
    seq = 32  # two to four records per window, and records cut by window starts
    data = build_data(cfg, tokenizer, seq)
    corpus = open_prepared(prepared_dir_for(cfg.path, cfg.text_field, tokenizer, cfg.cache_dir))
    assert corpus.mask is not None and corpus.manifest["num_documents"] == 40  # one document per record
    windows = data.train_windows(np.arange(data.num_train_windows))
    batch = data.train_batch(0, data.num_train_windows)
    offsets = windows[:, None] * seq + np.arange(seq + 1)  # (B, S+1); val_fraction 0: stream = corpus
    assert (batch.inputs.numpy() == np.asarray(corpus.tokens)[offsets[:, :-1]]).all()
    record = np.searchsorted(np.asarray(corpus.documents), offsets, side="right") - 1  # (B, S+1)
    start = np.maximum(np.asarray(corpus.documents)[record[:, :-1]], offsets[:, :1])  # or the window start
    assert (batch.positions.numpy() == offsets[:, :-1] - start).all()
    same_record = record[:, :-1, None] == record[:, None, :-1]
    causal = np.tril(np.ones((seq, seq), dtype=bool))
    assert (document_mask(batch.positions)[:, 0].numpy() == (same_record & causal)).all()
    # a target in the next record (an EOS followed by the next prompt): 40 records in 22 windows, ~38 of them
    crossing = record[:, 1:] != record[:, :-1]
    assert crossing.sum() >= 30 and (batch.targets.numpy()[crossing] == IGNORE_INDEX).all()

    model = _model("llama", vocab_size=len(tokenizer))
    with torch.no_grad():  # each record's logits in the packed window are those of the record run alone
        packed = model(batch.inputs, batch.positions)
        for row in range(len(windows)):
            for r in np.unique(record[row, :-1]):
                at = np.flatnonzero(record[row, :-1] == r)
                torch.testing.assert_close(packed[row, at], model(batch.inputs[row:row + 1, at])[0], **FP32)
