"""Command line: ``python -m functional_hsdp demo [flags]`` (``--help`` lists them)."""

from __future__ import annotations

import argparse
import sys

from .tools import demo


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; one subcommand per job, so more can join ``demo`` later."""
    parser = argparse.ArgumentParser(
        prog="python -m functional_hsdp",
        description="functional_hsdp: data-parallel gradient sync as pure functions over pytrees.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo_parser = commands.add_parser(
        "demo",
        help="train a small torch.func MLP with ddp/fsdp/hsdp/hfsdp and check it against dense "
        "torch",
        description=(
            "Train a small torch.func MLP with the chosen strategy on a dp_outer x dp_inner mesh "
            "(real gloo ranks, or one process on a SimMesh), the whole parameter tree at once or "
            "layer by layer (fh.gathered units), compare per-step losses and the final "
            "parameters with a dense single-process reference, and print the communication per "
            "step by phase and axis. Exits 0 on PASS; 1 on FAIL (a mismatch, a non-finite loss "
            "or a failed worker); 2 on a bad flag."
        ),
    )
    demo.add_arguments(demo_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the command; its exit status."""
    args = build_parser().parse_args(argv)
    return demo.main(args)


if __name__ == "__main__":  # spawned elastic workers import this module as __mp_main__
    sys.exit(main())
