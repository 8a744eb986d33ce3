"""Hugging Face import into tensor- and pipeline-parallel layouts, against transformers' logits.

The parent process builds tiny random HF models (tests/harness.py's builders), computes
transformers' logits once and hands both to the ranks, so no rank imports transformers. Under tp the
logits are vocab-sharded (B, T, V/tp): each rank compares its slice. Under pp, stage 0 runs its
chunk and sends the hidden state to stage 1, which compares the logits. One spawn covers every
family (and both 2-process layouts), since starting processes dominates the cost.
"""
import pytest
import torch
import torch.distributed as dist

from pipetrain.config import ParallelConfig
from pipetrain.hf.config import model_config_from_hf
from pipetrain.hf.weights import load_hf_weights
from pipetrain.models import build, param_layout
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.pipeline.stage import build_stage
from pipetrain.parallel.tensor.layers import ReplicatedKVLinear, apply_tensor_parallel
from tests.harness import B, HF_FP32, T, TP_FP32, hf_configs, run_ranks, save_tiny_hf, tokens


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    """{family: (HF dir, transformers logits (B, T, V))} for llama (GQA), qwen2, mistral, gpt2 (tied)."""
    root = tmp_path_factory.mktemp("hf_parallel")
    out = {}
    for name, cfg in hf_configs().items():
        model = save_tiny_hf(cfg, str(root / name), seed=11)
        with torch.no_grad():
            out[name] = (str(root / name), model(tokens()).logits)
    return out


def _import_layout(rank, world_size, tp, pp, references):
    """Load every family into this rank's (tp, pp) shard and compare the logits it produces."""
    dims = ParallelDims.from_degrees(tp=tp, pp=pp)
    tol = TP_FP32 if tp > 1 else HF_FP32
    for name, (hf_dir, expected) in references.items():
        cfg = model_config_from_hf(hf_dir)
        model = build(cfg)
        apply_tensor_parallel(model, dims)
        model, chunks, specs = build_stage(model, dims, ParallelConfig(tp=tp, pp=pp), T)
        load_hf_weights(model, hf_dir, cfg)
        assert not any(p.is_meta for p in model.parameters()), f"{dims.coords} {name}: parameter left on meta"
        if tp > 1:  # mistral's single kv head is replicated, llama's two kv heads are split
            replicated = isinstance(model.layers[str(specs[0].layers[0])].attn.wk, ReplicatedKVLinear)
            assert replicated == (cfg.kv_heads % tp != 0), f"{dims.coords} {name}: kv layout"
        if cfg.tied and specs[0].is_first and specs[0].is_last:
            assert model.head.weight is model.embed.weight, f"{dims.coords} {name}: tied weight came apart"
        x = tokens()
        with torch.no_grad():
            if pp > 1 and dims.pp_rank == 0:
                hidden = chunks[0](x)
                assert hidden.shape == (B, T, cfg.d_model), f"{dims.coords} {name}: hidden {tuple(hidden.shape)}"
                dist.send(hidden.contiguous(), dst=dims.global_rank(dims.dp_rank, 1, dims.tp_rank))
                continue
            if pp > 1:
                hidden = torch.empty(B, T, cfg.d_model)
                dist.recv(hidden, src=dims.global_rank(dims.dp_rank, 0, dims.tp_rank))
                logits = chunks[0](hidden)
            else:
                logits = model(x)
        vocab = cfg.vocab_size // tp
        cols = slice(dims.tp_rank * vocab, (dims.tp_rank + 1) * vocab)
        assert logits.shape == (B, T, vocab), f"{dims.coords} {name}: logits {tuple(logits.shape)}"
        torch.testing.assert_close(logits, expected[..., cols], **tol,
                                   msg=lambda m: f"{dims.coords} {name} logits: {m}")
    if pp > 1 and tp == 1:
        _check_pruned_gpt2_stage(dims, references["gpt2"][0])


def _check_pruned_gpt2_stage(dims, hf_dir):
    """Each stage holds only its own layers; the last stage's tied head copy is wte itself."""
    cfg = model_config_from_hf(hf_dir)
    model, _, specs = build_stage(build(cfg), dims, ParallelConfig(pp=dims.pp), T)
    load_hf_weights(model, hf_dir, cfg)
    names = set(param_layout(model))
    layers = {int(n.split(".")[1]) for n in names if n.startswith("layers.")}
    assert layers == set(specs[0].layers), f"{dims.coords} holds layers {sorted(layers)}"
    if dims.pp_rank == dims.pp - 1:
        from safetensors import safe_open

        assert "embed.weight" not in names and "head.weight" in names, f"{dims.coords} {sorted(names)}"
        with safe_open(f"{hf_dir}/model.safetensors", "pt") as f:
            assert torch.equal(model.head.weight, f.get_tensor("transformer.wte.weight")), f"{dims.coords} head"


def _tp2_then_pp2(rank, world_size, references):
    _import_layout(rank, world_size, 2, 1, references)
    _import_layout(rank, world_size, 1, 2, references)


def test_import_at_tp2_and_at_pp2_gives_the_transformers_logits_for_every_family(references):
    # Both layouts in one spawn of two processes: starting the processes costs more than the checks.
    run_ranks(2, _tp2_then_pp2, references)


@pytest.mark.slow
def test_import_at_tp2_x_pp2_gives_the_transformers_logits_for_every_family(references):
    run_ranks(4, _import_layout, 2, 2, references)
