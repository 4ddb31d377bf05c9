"""A pytest plugin that records, per test, which files of ``dsa_precision`` ran (``sys.monitoring``
PY_START events, each code object reported once per test) and whether the replay helper
``assert_replays_bit_exact`` was entered. The determinism gate runs the registered replay tests
in a subprocess with ``-p tests.determinism.trace --replay-trace=OUT.json``.

``--replay-only=ID,ID`` runs only those tests (node ids without parameters) of the files given.
OUT.json: ``{"collected": [every node id of the files], "tests": {node id: {"outcome", "files", "replayed"}}}``.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

_PACKAGE = str(pathlib.Path(__file__).resolve().parents[2] / "dsa_precision")
_ROOT = pathlib.Path(__file__).resolve().parents[2]
_TOOL = 4  # a tool id not reserved for debuggers, coverage or profilers


def pytest_addoption(parser):
    parser.addoption("--replay-trace", help="write the traced files of each test to this JSON")
    parser.addoption("--replay-only", help="comma-separated node ids (without parameters) to run")


class _Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self.collected: list[str] = []
        self.tests: dict[str, dict] = {}
        self.files: set[str] = set()
        self.replayed = False
        events = sys.monitoring.events
        sys.monitoring.use_tool_id(_TOOL, "dsa-precision replay trace")
        sys.monitoring.register_callback(_TOOL, events.PY_START, self._start)

    def _start(self, code, offset):
        filename = code.co_filename
        if filename.startswith(_PACKAGE):
            self.files.add(pathlib.Path(filename).relative_to(_ROOT).as_posix())
            if code.co_name == "assert_replays_bit_exact":
                self.replayed = True
        return sys.monitoring.DISABLE  # once per code object until the next test

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config, items):
        self.collected = [item.nodeid for item in items]
        only = config.getoption("--replay-only")
        if only:
            wanted = set(only.split(","))
            keep = [i for i in items if i.nodeid.split("[", 1)[0] in wanted]
            config.hook.pytest_deselected(items=[i for i in items if i not in keep])
            items[:] = keep

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        self.files, self.replayed = set(), False
        sys.monitoring.restart_events()
        sys.monitoring.set_events(_TOOL, sys.monitoring.events.PY_START)
        try:
            yield
        finally:
            sys.monitoring.set_events(_TOOL, 0)
            entry = self.tests.setdefault(item.nodeid, {})
            entry.update(files=sorted(self.files), replayed=self.replayed)

    def pytest_runtest_logreport(self, report):
        entry = self.tests.setdefault(report.nodeid, {"files": [], "replayed": False})
        if report.when == "call" or (report.when == "setup" and not report.passed):
            entry["outcome"] = report.outcome

    def pytest_sessionfinish(self, session):
        sys.monitoring.set_events(_TOOL, 0)
        sys.monitoring.register_callback(_TOOL, sys.monitoring.events.PY_START, None)
        sys.monitoring.free_tool_id(_TOOL)
        data = {"collected": self.collected, "tests": self.tests}
        pathlib.Path(self.path).write_text(json.dumps(data, indent=1))


def pytest_configure(config):
    path = config.getoption("--replay-trace")
    if path:
        config.pluginmanager.register(_Recorder(path), "replay-trace-recorder")
