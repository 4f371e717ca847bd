"""The ``orchard`` command line."""

from __future__ import annotations

import argparse
import asyncio
import sys

from . import __version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchard", description="Sandboxes for agent rollouts.")
    parser.add_argument("--version", action="version", version=f"orchard {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="run a batch of sandboxes, each fixing a failing test, and print latency percentiles",
    )
    demo.add_argument("-n", "--sandboxes", type=int, default=32, help="how many sandboxes (default 32)")
    demo.add_argument("--backend", default="local", help="backend to run on (default: local)")
    demo.add_argument("--image", default="local", help="task image (ignored by the local backend)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``orchard`` command."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from ._demo import run_demo

        if args.sandboxes < 1:
            print("orchard demo: --sandboxes must be at least 1", file=sys.stderr)
            return 2
        try:
            rec = asyncio.run(run_demo(args.sandboxes, backend=args.backend, image=args.image))
        except KeyboardInterrupt:
            print("\norchard demo: interrupted; every sandbox was deleted", file=sys.stderr)
            return 130
        return 0 if rec.failed == 0 else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
