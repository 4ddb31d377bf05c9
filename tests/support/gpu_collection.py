"""A pytest plugin for ``tests/test_gpu_suite.py``: loaded into a ``--collect-only`` run (``-p
tests.support.gpu_collection``), it writes what that run collected to the JSON file named by
``$DSA_GPU_COLLECTION_REPORT``: each selected test's node id, whether it is marked ``gpu``, and
the fixtures it requests that no conftest or plugin it can see defines (pytest reports those only
when the test sets up, which a skipped test never does); and every collection error."""

from __future__ import annotations

import json
import os

import pytest

REPORT = "DSA_GPU_COLLECTION_REPORT"
_ERRORS: list[dict[str, str]] = []


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _ERRORS.append({"nodeid": report.nodeid, "error": str(report.longrepr)})


def _missing_fixtures(item: pytest.Item) -> list[str]:
    """The fixtures ``item`` requests that resolve to no definition visible from it (what pytest
    would fail its setup with: "fixture 'NAME' not found")."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:  # not a Python test function: requests no fixtures by name
        return []
    return [n for n in info.names_closure if n != "request" and n not in info.name2fixturedefs]


def pytest_collection_finish(session: pytest.Session) -> None:
    path = os.environ.get(REPORT)
    if not path:
        raise pytest.UsageError(f"set ${REPORT} to the JSON file the collection report goes to")
    items = [
        {
            "nodeid": item.nodeid,
            "gpu": item.get_closest_marker("gpu") is not None,
            "missing_fixtures": _missing_fixtures(item),
        }
        for item in session.items
    ]
    with open(path, "w") as f:
        json.dump({"items": items, "errors": _ERRORS}, f)
