"""Run a script under cProfile, one stats file per torchrun rank (benchmarks/step_time_ab.py --profile):

    python benchmarks/profile_rank.py OUT_DIR script.py args...   ->   OUT_DIR/rank<RANK>.prof
"""
import cProfile
import os
import runpy
import sys

if __name__ == "__main__":
    out, sys.argv = sys.argv[1], sys.argv[2:]
    profile = cProfile.Profile()
    profile.enable()
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        profile.disable()
        profile.dump_stats(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.prof"))
