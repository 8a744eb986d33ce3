"""python -m pipetrain.plot RUN_DIR [--out FILE]: write RUN_DIR/loss.png (train/eval loss, lr)."""
from __future__ import annotations

import sys

from pipetrain.config import ArgumentParser, ConfigError
from pipetrain.plot import plot_run


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m pipetrain.plot", description="Plot a run's metrics.jsonl.")
    parser.add_argument("run_dir", help="a run folder (run.output_dir) holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="image path (default RUN_DIR/loss.png)")
    args = parser.parse_args(argv)
    try:
        path = plot_run(args.run_dir, args.out)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
