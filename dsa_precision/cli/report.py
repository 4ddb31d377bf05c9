"""Plain-text tables and number formatting shared by the ``demo`` and ``agree`` commands."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# Columns every agreement table shows, from a TopkAgreement.as_dict() mapping.
_AGREEMENT_HEADERS = ("rows identical", "member agreement", "flipped/row mean", "max")
# What those columns mean, for a report's footer (rows: those with a non-empty inference set).
_AGREEMENT_LEGEND = (
    "rows identical: share of rows where training picked exactly inference's set of keys;",
    "member agreement: inference's picks that training also picked / all inference's picks;",
    "flipped/row mean, max: inference's picks training missed, per row (mean and max);",
)


def _percent(x: float, digits: int = 2) -> str:
    return f"{100.0 * x:.{digits}f} %"


def _agreement_cells(metrics: Mapping[str, float | int]) -> list[str]:
    """The :data:`_AGREEMENT_HEADERS` cells of one agreement (``TopkAgreement.as_dict()``)."""
    return [
        _percent(metrics["rows_identical"]),
        _percent(metrics["member_agreement"], 4),
        f"{metrics['flipped_mean']:.3f}",
        str(int(metrics["flipped_max"])),
    ]


def _format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned first column, right-aligned others, two spaces between columns."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        first = str(cells[0]).ljust(widths[0])
        rest = (str(c).rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join((first, *rest)).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])
