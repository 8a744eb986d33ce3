"""pipetrain training entry point.

    python train.py --recipe recipes/tiny.yaml                       # one process
    torchrun --nproc-per-node 8 train.py --recipe recipes/gpt-1b.yaml
    python train.py --recipe R --set parallel.tp=2 --resume auto --eval-only

See pipetrain/cli.py for the flags and docs/ for the recipe keys.
"""
import sys

from pipetrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
