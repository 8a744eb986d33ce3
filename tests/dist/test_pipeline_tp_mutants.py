"""Pipeline and tensor/sequence-parallel cases the default suite does not run, each against the same
model and microbatches in one process (fp32 round-off only).

A mutation audit of pipetrain/parallel/{pipeline,tensor} found realistic bugs that the default suite let
through (caught only by the slow matrix or e2e runs, a 300-s hang elsewhere, or nothing); each test here
fails on one of them within seconds:
- dp 2 x pp 2: a stage talking to the neighbour of another replica (the executor's peer ignoring dp);
- tp 4 with two replicated kv heads: a rank computing the wrong kv head (kv_head = tp_rank // (tp / Hkv));
  and a replicated kv head's bias gradient left out of the tp sum (qwen2, one kv head with a bias);
- document positions under pp (every stage's attention masks documents) and under sequence
  parallelism (gpt2's learned positions: this rank's T/tp slice of the positions, not the first);
- split backward with activation recomputation and fusion off: the recomputed forward inside B must
  take the deferred path too;
- a W action with no weight work (B deferring the wrong chunk's linears: right gradients, no overlap);
- the fused vocab-parallel head + loss with V/tp != D: every suite model has V/tp == D at tp 2, so a
  shard offset taken from the head's other dimension goes unseen.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipetrain.config import ModelConfig, ParallelConfig
from pipetrain.data import Batch
from pipetrain.models import build, materialize, param_layout
from pipetrain.parallel.data.grads import sync_grads
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.pipeline import executor as executor_module
from pipetrain.parallel.pipeline.executor import Executor
from pipetrain.parallel.pipeline.recompute import apply_recompute
from pipetrain.parallel.pipeline.schedules import build_schedule
from pipetrain.parallel.pipeline.stage import build_stage
from pipetrain.parallel.pipeline.weight_grads import apply_grad_accumulation_fusion
from pipetrain.parallel.tensor.cross_entropy import vocab_parallel_linear_cross_entropy
from pipetrain.parallel.tensor.layers import apply_tensor_parallel
from pipetrain.trainer import loss_sum
from tests.dist.test_tensor_parallel import _model_worker
from tests.harness import EXACT_FP32, TP_FP32, run_ranks

SEED, MB, T = 99, 2, 16
TIMEOUT_S = 30  # a mis-addressed send hangs: fail in half a minute, not after the default five
LLAMA = ModelConfig(family="llama", vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                    ffn_hidden=64, max_seq_len=32)
GPT2 = ModelConfig(family="gpt2", vocab_size=64, d_model=32, n_layers=4, n_heads=4, max_seq_len=32)  # tied


def _positions(rows: int) -> torch.Tensor:
    """Document positions (rows, T): documents of uneven lengths (5, 11 | 9, 7 | ...), so no two T/tp
    slices and no two stages' views of them coincide."""
    out = torch.empty(rows, T, dtype=torch.int64)
    for r in range(rows):
        cut = 5 + (4 * r) % 8
        out[r] = torch.cat([torch.arange(cut), torch.arange(T - cut)])
    return out


def _microbatches(cfg, num: int, documents: bool) -> tuple[list[Batch], int]:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (num * MB, T + 1), generator=gen)
    targets = tokens[:, 1:].clone()
    targets[0, :5] = -100
    positions = _positions(num * MB) if documents else None
    return Batch(tokens[:, :-1], targets, positions).split(num), int((targets != -100).sum())


def _reference(cfg, num: int, documents: bool):
    """One process: gradient accumulation over every microbatch, loss / global token count."""
    model = materialize(build(cfg), cfg, SEED, "cpu")
    mbs, count = _microbatches(cfg, num, documents)
    total = 0.0
    for mb in mbs:
        logits = model(mb.inputs) if mb.positions is None else model(mb.inputs, mb.positions)
        loss = loss_sum(logits, mb.targets)
        (loss / count).backward()
        total += float(loss)
    return total / count, {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank, world_size, cfg, pp, tp, num, options):
    """This rank's stage of a dp x pp x tp layout (dp = world / (pp * tp)); dp rank d runs the global
    microbatches [d*num, (d+1)*num); every gradient shard is compared with the one-process gradient.
    options (run_ranks passes no keywords): sp, split, documents, recompute, fusion (min_numel or None),
    schedule and v (virtual stages), every_w_defers (each W action must find weight work to do)."""
    sp, split, documents = options.get("sp", False), options.get("split", False), options.get("documents", False)
    recompute, fusion = options.get("recompute", "none"), options.get("fusion", 0)
    schedule, v = options.get("schedule", "1f1b"), options.get("v", 1)
    dims = ParallelDims.from_degrees(tp=tp, pp=pp)
    pcfg = ParallelConfig(pp=pp, tp=tp, schedule=schedule, virtual_stages=v, microbatches=num, recompute=recompute,
                          sequence_parallel=sp)
    if options.get("every_w_defers"):  # this worker process's own module: nothing to restore
        apply = executor_module.apply_weight_grads

        def checked(work):
            assert work, f"{dims.coords} a W action found no weight work: its B did the weight gradients"
            apply(work)
        executor_module.apply_weight_grads = checked
    model = build(cfg)
    apply_tensor_parallel(model, dims, sequence_parallel=sp)
    apply_grad_accumulation_fusion(model, fusion)
    model, chunks, specs = build_stage(model, dims, pcfg, T)
    materialize(model, cfg, SEED, "cpu")
    apply_recompute(model, pcfg, [s.layers for s in specs])
    tp_group = dims.tp_group if tp > 1 else None
    seq = T // tp if sp else T
    executor = Executor(chunks, specs, dims, (MB, seq, cfg.d_model), torch.float32,
                        loss_fn=lambda logits, targets: loss_sum(logits, targets, tp_group))
    actions = build_schedule(schedule, dims.pp_rank, pp, num, v, split_backward=split)
    mbs, count = _microbatches(cfg, num * dims.dp, documents)
    local = executor.run(actions, mbs[dims.dp_rank * num:(dims.dp_rank + 1) * num], count)
    sync_grads(model, dims)  # the tied embedding over the embed group, dp sums, tp-partial sums
    dist.all_reduce(local)  # the last stage of every replica holds its loss; tp ranks hold copies
    ref_loss, ref_grads = _reference(cfg, num * dims.dp, documents)
    tol = TP_FP32 if tp > 1 else EXACT_FP32
    torch.testing.assert_close(float(local) / count / tp, ref_loss, **tol, msg=lambda m: f"{dims.coords} loss: {m}")
    params = dict(model.named_parameters())
    for name, (_, slices) in param_layout(model).items():
        ref_name = "embed.weight" if name == "head.weight" and cfg.tied else name
        torch.testing.assert_close(params[name].grad, ref_grads[ref_name][slices], **tol,
                                   msg=lambda m: f"{dims.coords} grad of {name}: {m}")


def test_dp2_x_pp2_each_replica_pipelines_its_own_microbatches():
    """dp 2 x pp 2 (4 processes): each replica's stages send to their own replica's neighbour, so the
    gradients summed over dp are the one-process gradients. The pipeline tests run dp 1 only; an
    executor peer that drops the dp coordinate only hung test_dbs for five minutes."""
    run_ranks(4, _worker, GPT2, 2, 1, 2, dict(split=True), timeout_s=TIMEOUT_S)


def test_tp4_replicated_kv_heads_pick_the_head_of_their_query_heads():
    """llama with 2 kv heads at tp 4: ranks 0, 1 use kv head 0 and ranks 2, 3 kv head 1 (the default
    suite replicates kv heads only with one kv head, where every mapping gives head 0)."""
    run_ranks(4, _model_worker, "llama_gqa", False)


def test_tp2_replicated_kv_head_with_bias_sums_the_bias_gradient_over_tp():
    """qwen2 with one biased kv head at tp 2: wk / wv are replicated and both their weight and bias
    gradients are tp-partial (each rank's query heads see part of it); the default suite's replicated
    kv heads (llama) have no bias, so a bias missing from tp_partial_grads went unseen."""
    run_ranks(2, _model_worker, "qwen2_mqa", False)


def test_pp2_document_positions_reach_every_stage():
    """Document masking through pp 2: the executor hands the positions to every stage's attention, not
    only to the first stage's embedding (llama: RoPE and the mask both read them)."""
    run_ranks(2, _worker, LLAMA, 2, 1, 2, dict(documents=True), timeout_s=TIMEOUT_S)


def test_tp2_sequence_parallel_gpt2_takes_its_own_slice_of_document_positions():
    """gpt2 under tp 2 + sp with document positions: each rank's learned position rows are those of its
    own T/tp tokens (rank 1 the second half of each row's positions). pp 2 x tp 2 also checks the
    (MB, T/tp, D) activations the stages exchange under sequence parallelism."""
    run_ranks(4, _worker, GPT2, 2, 2, 2, dict(sp=True, documents=True), timeout_s=TIMEOUT_S)


def test_split_backward_with_full_recompute_and_no_fusion_matches_single_process():
    """pp 2, 1f1b, split backward, recompute=full, fusion off (as the trainer runs every weight below
    train.grad_accumulation_fusion_min_numel): B re-runs the checkpointed blocks' forward, which must take
    the deferred path again, or it saves other tensors than F did (CheckpointError) and defers nothing.
    The default suite fuses every weight (min_numel 0), where the recomputed forward happens to match."""
    run_ranks(2, _worker, GPT2, 2, 1, 4, dict(split=True, recompute="full", fusion=None), timeout_s=TIMEOUT_S)


def test_every_w_of_a_v_schedule_does_the_weight_gradients_its_b_deferred():
    """zbv at pp 2 (two chunks per rank, both split): every W action applies weight work that its B
    deferred, on either chunk. Deferring chunk 0's modules around chunk 1's F and B keeps the gradients
    right (B then does chunk 1's weight gradients itself) but silently loses the zero-bubble overlap."""
    run_ranks(2, _worker, GPT2, 2, 1, 4, dict(schedule="zbv", v=2, split=True, every_w_defers=True),
              timeout_s=TIMEOUT_S)


def _fused_loss_worker(rank, world_size):
    dims = ParallelDims.from_degrees(tp=world_size)
    torch.manual_seed(0)  # the same full tensors on every rank
    N, D, V = 24, 16, 64  # V/tp = 32 rows per rank, D = 16: the two dims of a head shard differ
    hidden, weight = torch.randn(N, D), torch.randn(V, D)
    targets = torch.randint(0, V, (N,))
    targets[:3] = -100
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy(h_ref @ w_ref.t(), targets, ignore_index=-100)
    ref.backward()
    rows = slice(dims.tp_rank * V // world_size, (dims.tp_rank + 1) * V // world_size)
    h, w = hidden.clone().requires_grad_(), weight[rows].clone().requires_grad_()
    loss = vocab_parallel_linear_cross_entropy(h, w, targets, -100, dims.tp_group)
    loss.backward()
    dist.all_reduce(h.grad, group=dims.tp_group)  # each shard's part of dhidden (the head's region sums them)
    for what, got, want in (("loss", loss.detach(), ref.detach()), ("head grad", w.grad, w_ref.grad[rows]),
                            ("hidden grad", h.grad, h_ref.grad)):
        torch.testing.assert_close(got, want, **TP_FP32, msg=lambda m: f"{dims.coords} {what}: {m}")


def test_tp2_fused_head_loss_with_head_shard_rows_unequal_to_d_model():
    """vocab_parallel_linear_cross_entropy at tp 2 with a (32, 16) head shard: loss, head shard grad and
    summed hidden grad equal F.cross_entropy on the full logits (rank 1's vocabulary starts at row 32)."""
    run_ranks(2, _fused_loss_worker, timeout_s=TIMEOUT_S)
