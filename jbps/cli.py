"""The `jbps` command: one entry point for the tools that ship with the package.

    jbps run -n 2 python train.py                       # a whole job on this machine
    jbps scheduler                                      # the DMLC_* rendezvous
    jbps server --bind 0.0.0.0:9000 --num-workers 4    # a summation server
    jbps run -n 2 jbps bench --sizes 4K-64M             # this job's psum by size (each worker runs it)
    jbps plan resnet50 --workers 4 --cpu-servers 0-4    # traffic split and predicted time

Each subcommand's own options follow it (`jbps bench --help`). The lab's
benchmarks against MPI, JAX's gloo psum and the formula, on emulated hosts
too, run from a checkout: `python -m benchmarks --help`.
"""

from __future__ import annotations

import argparse
import sys

from . import __version__


def _bench(argv: list[str]) -> int:
    from .bench import main

    return main(argv, prog="jbps bench")


def _plan(argv: list[str]) -> int:
    from .partition.__main__ import main

    return main(argv, prog="jbps plan")


def _run(argv: list[str]) -> int:
    from .launch import main

    return main(argv, prog="jbps run")


def _scheduler(argv: list[str]) -> int:
    from .scheduler.__main__ import main

    return main(argv, prog="jbps scheduler")


def _server(argv: list[str]) -> int:
    from .server.__main__ import main

    return main(argv, prog="jbps server")


_COMMANDS = {
    "bench": (
        _bench,
        "time this job's psum by size on its real hosts (run by every worker, like nccl-tests)",
    ),
    "plan": (_plan, "predict a model's traffic per server and communication time vs CPU machines"),
    "run": (_run, "run a whole job on this machine: scheduler, servers and workers"),
    "scheduler": (_scheduler, "run the rendezvous of an environment-variable (DMLC_*) bootstrap"),
    "server": (_server, "run a summation server"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jbps", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"jbps {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in _COMMANDS.items():
        # No help of their own: `jbps bench --help` is answered by the bench's parser.
        commands.add_parser(name, help=help_text, add_help=False)
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return _COMMANDS[args.command][0](rest)


if __name__ == "__main__":
    sys.exit(main())
