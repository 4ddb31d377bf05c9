"""Command line: ``python -m dsa_precision {demo,agree,bench}`` (installed as ``dsa-precision``).

Each subcommand lives in its own module, imported only when it runs, and exposes
``register(subparsers)``, which adds its parser and sets ``func(args) -> int``. Expected failures
raise :class:`CliError`: one clear line on stderr and exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Iterable, Iterator, Sequence

__all__ = ["CliError", "main", "progress"]

# subcommand -> module defining register(subparsers)
COMMANDS = {
    "demo": "dsa_precision.cli.demo",
    "agree": "dsa_precision.cli.agree",
    "bench": "dsa_precision.cli.bench",
}


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def progress[T](items: Iterable[T], *, total: int | None = None, desc: str = "") -> Iterator[T]:
    """Yield ``items`` while drawing a one-line progress bar on stderr (only on a terminal)."""
    if not sys.stderr.isatty():
        yield from items
        return
    total = total if total is not None else (len(items) if hasattr(items, "__len__") else None)
    start = time.monotonic()
    for i, item in enumerate(items):
        yield item
        done = i + 1
        elapsed = time.monotonic() - start
        if total:
            bar = "#" * int(24 * done / total)
            sys.stderr.write(f"\r{desc} [{bar:<24}] {done}/{total} {elapsed:5.1f}s")
        else:
            sys.stderr.write(f"\r{desc} {done} {elapsed:5.1f}s")
        sys.stderr.flush()
    sys.stderr.write("\r\033[K")
    sys.stderr.flush()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsa-precision",
        description="Measure and close the train/inference top-k gap of the DSA lightning indexer.",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}"
    )
    for name, module in COMMANDS.items():
        try:
            importlib.import_module(module).register(sub)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            sub.add_parser(name, help="(not available in this build)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        print(
            f"dsa-precision: error: {args.command} is not available in this build", file=sys.stderr
        )
        return 2
    try:
        return int(func(args) or 0)
    except CliError as exc:
        print(f"dsa-precision {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
