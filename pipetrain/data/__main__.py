"""python -m pipetrain.data prepare --recipe R [--set KEY=VALUE ...]: tokenise a recipe's data ahead of a launch."""
from __future__ import annotations

import dataclasses
import sys

from pipetrain.config import ArgumentParser, ConfigError, load_recipe
from pipetrain.data import load_tokenizer, open_prepared, prepare_sources
from pipetrain.parallel.mesh.rules import parallel_problems


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m pipetrain.data")
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="tokenise data.path / data.sources into prepared directories")
    prep.add_argument("--recipe", required=True)
    prep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    prep.add_argument("--num-proc", type=int, default=None, help="tokenising processes (default data.num_proc)")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.set, rules=parallel_problems)
        data = recipe.data
        if not data.tokenizer:  # as a run does: model.init_from's directory is the default tokenizer
            data = dataclasses.replace(data, tokenizer=recipe.model.init_from or "")
        if args.num_proc is not None:
            if args.num_proc < 1:
                raise ConfigError(f"--num-proc={args.num_proc} must be >= 1")
            data = dataclasses.replace(data, num_proc=args.num_proc)
        tokenizer = load_tokenizer(data.tokenizer)
        for out in prepare_sources(data, tokenizer):
            open_prepared(out, tokenizer, verify=data.verify)  # one made earlier may be damaged: say so here
            print(out, flush=True)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
