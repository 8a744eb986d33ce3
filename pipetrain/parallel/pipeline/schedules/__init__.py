"""Pipeline schedules as pure data: per-rank action lists, how they are built, proven and timed.

A schedule is, for each pp rank, the ordered list of Actions that rank performs in one optimizer step:
compute (F, B, W) and point-to-point communication (SEND_*/RECV_*), nothing else. The executor
(executor.py) walks the list and knows nothing of any particular schedule; nothing here touches
torch.distributed. One idea per module:

    actions.py    Action, the stage numbering, which compute feeds which
    builders.py   each schedule's compute order (the V schedules zbv, dualpipev too); build_all_schedules and the per-rank entry points
    placement.py  where W (split backward) and SEND/RECV actions go, and why that cannot deadlock
    replay.py     the one simulator: a task starts when its rank is free and its input is there
    validate.py   validate_schedule: structure, message order, deadlock freedom, in-flight bounds
    timing.py     simulate: makespan and bubble of action lists under given costs
    timeline.py   the timeline command (python -m pipetrain.parallel.pipeline.schedules), ASCII and PNG
"""
from pipetrain.parallel.pipeline.schedules.actions import (B, COMM_KINDS, COMPUTE_KINDS, F, RECV_ACT, RECV_GRAD, SCHEDULES,
                                                           SEMANTICS, SEND_ACT, SEND_GRAD, V_SCHEDULES, W, Action, Compute,
                                                           placement_of, rank_chunk_of, stage_of)
from pipetrain.parallel.pipeline.schedules.builders import (build_all_schedules, build_schedule, gpipe,
                                                            interleaved_one_f_one_b, one_f_one_b, schedule_problems)
from pipetrain.parallel.pipeline.schedules.timing import SimResult, ideal_bubble, simulate
from pipetrain.parallel.pipeline.schedules.validate import find_deadlock, peak_in_flight, validate_schedule

__all__ = ["B", "COMM_KINDS", "COMPUTE_KINDS", "F", "RECV_ACT", "RECV_GRAD", "SCHEDULES", "SEMANTICS", "SEND_ACT",
           "SEND_GRAD", "V_SCHEDULES", "W", "Action", "Compute", "placement_of", "rank_chunk_of", "stage_of", "build_all_schedules", "build_schedule", "gpipe",
           "interleaved_one_f_one_b", "one_f_one_b", "schedule_problems", "SimResult", "ideal_bubble", "simulate",
           "find_deadlock", "peak_in_flight", "validate_schedule"]
