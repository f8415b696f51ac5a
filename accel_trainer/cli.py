"""The `accel-trainer` console script.

accel-trainer train recipes/x.py [training arguments]   run a recipe (same as python recipes/x.py ...)
accel-trainer config ...                                 write an accelerate config (the wizard)
accel-trainer check ...                                  preflight a config on this machine
accel-trainer launch ...                                 accelerate launch with bounded rendezvous + diagnosis
accel-trainer report RUN_DIR ... --out FILE.png          draw the curves of runs (metrics.jsonl)
"""

from __future__ import annotations

import argparse
import importlib
import sys

# The subcommands besides `train`, imported by name when the console script starts. The one place the package
# reaches the cluster tools and the plotting command; tests/test_architecture.py reads these names as imports.
COMMANDS = (
    "accel_trainer.cluster.wizard",  # config
    "accel_trainer.cluster.check",
    "accel_trainer.cluster.launch",
    "accel_trainer.tools.report",
)


def _train(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: accel-trainer train RECIPE.py [training arguments]  (RECIPE.py --help lists them)")
        return 0 if argv else 2
    from .run import run

    run(argv[0], argv[1:])
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="accel-trainer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="run a recipe file with training arguments", add_help=False)
    for module in COMMANDS:
        # No try/except: a subcommand module that fails to import is a bug (a missing dependency, a typo), and
        # swallowing it made the subcommand silently vanish from --help. Let the ImportError name it.
        importlib.import_module(module).add_parser(sub)  # registers it and sets func=...
    if argv and argv[0] == "train":
        return _train(argv[1:])
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
