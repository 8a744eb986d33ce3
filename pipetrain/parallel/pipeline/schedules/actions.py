"""What a schedule is made of: Actions, the global stage numbering, and which compute feeds which.

Stages (Megatron convention): with p pp ranks and v model chunks per rank, chunk c on rank r is global
stage s = c*p + r. Stage s sends activations to s+1 and gradients to s-1, so rank r always sends
activations to rank (r+1) % p and gradients to rank (r-1) % p. Stage 0 has no RECV_ACT; the last stage
(p*v - 1) has no SEND_ACT, computes the loss in its F, and its B starts from that loss.

V placement (placement "v": the schedules zbv and dualpipev, two chunks per rank): chunk 0 of rank r is
stage r and chunk 1 is stage 2p-1-r, so activations go down the ranks through chunk 0 and back up
through chunk 1; the first and the last stage both sit on rank 0 (embedding and head together). The
edge between stages p-1 and p joins the two chunks of rank p-1: no SEND/RECV action exists for it, the
executor hands the tensor from one chunk to the other locally.

Action fields: `microbatch` and `chunk` name the local (microbatch, chunk) the data belongs to: for RECV_ACT
the chunk whose F consumes it, for SEND_ACT the chunk whose F produced it, likewise for gradients.
`peer` is the pp rank on the other end of a communication (None for F/B/W).
"""
from __future__ import annotations

from dataclasses import dataclass

F, B, W = "F", "B", "W"
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD"
COMPUTE_KINDS = (F, B, W)
COMM_KINDS = (SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")  # two chunks per rank in a V (placement "v")
PLACEMENTS = ("loop", "v")
SEMANTICS = ("async", "rendezvous")

Compute = tuple[str, int, int]  # (kind F, B or W, microbatch, chunk): one entry of a rank's compute order


@dataclass(frozen=True)
class Action:
    """One step of one rank: compute (F/B/W) or a point-to-point transfer with `peer`."""
    kind: str          # F, B, W, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD
    microbatch: int
    chunk: int = 0     # model chunk (virtual stage) on this rank; 0 unless interleaved
    peer: int | None = None  # pp rank on the other end of a SEND_*/RECV_*; None for compute

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE_KINDS + COMM_KINDS:
            raise ValueError(f"Action.kind: unknown kind {self.kind!r}; use one of {COMPUTE_KINDS + COMM_KINDS}")

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    def __str__(self) -> str:
        where = f"mb {self.microbatch}" + (f" chunk {self.chunk}" if self.chunk else "")
        if self.peer is None:
            return f"{self.kind}({where})"
        return f"{self.kind}({where}) {'->' if self.kind.startswith('SEND') else '<-'} {self.peer}"


def placement_of(schedule: str) -> str:
    """The stage placement schedule `schedule` runs on: "v" for the V schedules, else "loop"."""
    return "v" if schedule in V_SCHEDULES else "loop"


def stage_of(pp_rank: int, chunk: int, pp_size: int, placement: str = "loop") -> int:
    """Global stage of `chunk` on `pp_rank`: Megatron's interleaved numbering, or the V (module docstring)."""
    if placement == "v":
        return pp_rank if chunk == 0 else 2 * pp_size - 1 - pp_rank
    return chunk * pp_size + pp_rank


def rank_chunk_of(stage: int, pp_size: int, placement: str = "loop") -> tuple[int, int]:
    """(pp_rank, chunk) holding global `stage`: the inverse of stage_of."""
    if placement == "v":
        return (stage, 0) if stage < pp_size else (2 * pp_size - 1 - stage, 1)
    return stage % pp_size, stage // pp_size


def source(pp_size: int, virtual_stages: int, pp_rank: int, x: Compute,
           placement: str = "loop") -> tuple[int, Compute] | None:
    """(rank, compute) whose output compute `x` on `pp_rank` consumes; None for the first F, the last B and W.
    The rank is pp_rank itself for the local edge of the V."""
    kind, mb, c = x
    s = stage_of(pp_rank, c, pp_size, placement)
    if kind == F and s > 0:
        r, c_prev = rank_chunk_of(s - 1, pp_size, placement)
        return r, (F, mb, c_prev)
    if kind == B and s < pp_size * virtual_stages - 1:
        r, c_next = rank_chunk_of(s + 1, pp_size, placement)
        return r, (B, mb, c_next)
    return None


def message(a: Action, pp_rank: int, pp_size: int, placement: str = "loop") -> tuple[str, int, int, int]:
    """(payload, microbatch, src_stage, dst_stage) of a SEND_*/RECV_*: the same on both ends of a transfer."""
    s = stage_of(pp_rank, a.chunk, pp_size, placement)
    return {SEND_ACT: ("act", a.microbatch, s, s + 1), RECV_ACT: ("act", a.microbatch, s - 1, s),
            SEND_GRAD: ("grad", a.microbatch, s, s - 1), RECV_GRAD: ("grad", a.microbatch, s + 1, s)}[a.kind]


def expected_peer(kind: str, pp_rank: int, pp_size: int, chunk: int = 0, placement: str = "loop") -> int:
    """The pp rank a SEND_*/RECV_* of `kind` on (`pp_rank`, `chunk`) talks to."""
    s = stage_of(pp_rank, chunk, pp_size, placement)
    return rank_chunk_of(s + 1 if kind in (SEND_ACT, RECV_GRAD) else s - 1, pp_size, placement)[0]
