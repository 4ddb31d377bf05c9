"""Command line: ``python -m dsa_precision {demo,agree,bench}`` (installed as ``dsa-precision``).

Each subcommand lives in its own module, imported only when it runs, and exposes
``register(subparsers)``, which adds its parser and sets ``func(args) -> int``. Expected failures
raise :class:`CliError`: one clear line on stderr and exit status 2, no traceback; bad flag values
are argparse errors (usage line, exit status 2). Every command's ``--help`` goes through
:class:`HelpFormatter` (docstrings shown as plain text), and every ``--json`` document goes
through :func:`print_json` (it carries the package version).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, cast

__all__ = ["CliError", "HelpFormatter", "main", "plain_text", "print_json", "progress", "seed"]

# subcommand -> module defining register(subparsers)
_COMMANDS = {
    "demo": "dsa_precision.cli.demo",
    "agree": "dsa_precision.cli.agree",
    "bench": "dsa_precision.cli.bench",
}


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


# :role:`target` (Sphinx cross-references), ``literal``, **bold**.
_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")
_BOLD = re.compile(r"\*\*([^*]+)\*\*")


def _role_target(match: re.Match) -> str:
    tilde, target = match.groups()
    target = target.lstrip(".")
    return target.rsplit(".", 1)[-1] if tilde else target


def plain_text(text: str) -> str:
    """``text`` (reStructuredText from a docstring) as a terminal shows it: ``:func:`~a.b``` ->
    ``b``, ``:mod:`.x``` -> ``x``, double-backquoted literals and ``**bold**`` unwrapped."""
    return _BOLD.sub(r"\1", _LITERAL.sub(r"\1", _ROLE.sub(_role_target, text)))


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their line breaks (docstrings); descriptions and flag help are shown as
    :func:`plain_text`."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain_text(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return plain_text(super()._expand_help(action))


# torch.Generator.manual_seed takes 64-bit seeds; a negative one aliases a positive one.
_SEED_MAX = 2**64 - 1


def seed(text: str) -> int:
    """argparse type of ``--seed``: an integer in ``[0, 2**64 - 1]``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value <= _SEED_MAX:
        raise argparse.ArgumentTypeError(f"{value} is outside [0, 2**64 - 1] (a 64-bit seed)")
    return value


def print_json(document: Mapping[str, Any]) -> None:
    """Print one ``--json`` document on stdout, with the package version first."""
    from .. import __version__

    json.dump({"dsa_precision_version": __version__, **document}, sys.stdout, indent=2)
    sys.stdout.write("\n")


def progress[T](items: Iterable[T], *, total: int | None = None, desc: str = "") -> Iterator[T]:
    """Yield ``items`` while drawing a one-line progress bar on stderr (only on a terminal)."""
    if not sys.stderr.isatty():
        yield from items
        return
    total = (
        total
        if total is not None
        else (len(cast(Sized, items)) if hasattr(items, "__len__") else None)
    )
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


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsa-precision",
        description="Measure and close the train/inference top-k gap of the DSA lightning indexer.",
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{" + ",".join(_COMMANDS) + "}"
    )
    for name, module in _COMMANDS.items():
        try:
            importlib.import_module(module).register(sub)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            sub.add_parser(name, help="(not available in this build)")
    for command in sub.choices.values():  # one way to show help, whatever a command set
        command.formatter_class = HelpFormatter
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
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
