"""``orchard doctor``: what each backend needs here, checked in order, then one sandbox per backend."""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    """Run the checks of ``args.backend`` (all when None); 0 when every one passed, else 1."""
    raise NotImplementedError("orchard doctor is being written")
