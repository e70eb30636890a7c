"""The ``mcore-ckpt`` command: ``inspect PATH``, ``validate PATH`` and ``convert PATH OUTPUT``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from mcore_ckpt._version import __version__
from mcore_ckpt.consolidate import convert_to_torch_file
from mcore_ckpt.errors import CheckpointError
from mcore_ckpt.inspection import format_report, inspect_checkpoint, validate_checkpoint

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """Builds the argument parser of ``mcore-ckpt``.

    Returns:
        The parser.
    """
    parser = argparse.ArgumentParser(
        prog="mcore-ckpt", description="Inspect and validate mcore-ckpt checkpoints."
    )
    parser.add_argument("--version", action="version", version=f"mcore-ckpt {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser(
        "inspect", help="tensors, shapes, dtypes, sharding, versions and size"
    )
    inspect.add_argument("path", help="checkpoint directory or root with a 'latest' marker")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    validate = commands.add_parser("validate", help="check that all shards are present and intact")
    validate.add_argument("path", help="checkpoint directory or root with a 'latest' marker")
    convert = commands.add_parser(
        "convert", help="write all tensors in full and all objects into one torch.save file"
    )
    convert.add_argument("path", help="checkpoint directory or root with a 'latest' marker")
    convert.add_argument("output", help="the .pt file to write (flat dict by dotted path)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``mcore-ckpt``.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        0 on success, 1 when the checkpoint is missing, unreadable or damaged or the output of
        ``convert`` cannot be written (the message names the file at fault), 2 on a usage
        error.
    """
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect":
            report = inspect_checkpoint(args.path)
            print(json.dumps(report, indent=1) if args.json else format_report(report))
        elif args.command == "convert":
            written = convert_to_torch_file(args.path, args.output)
            print(f"wrote {written} ({written.stat().st_size} bytes)")
        else:
            info = validate_checkpoint(args.path)
            print(
                f"OK {info.path}: {len(info.files)} files, {len(info.tensors)} tensors, "
                f"{len(info.objects)} objects, all checksums match"
            )
    except CheckpointError as error:
        print(f"mcore-ckpt {args.command}: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
