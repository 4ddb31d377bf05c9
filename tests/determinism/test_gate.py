"""The determinism coverage gate (tests/determinism/manifest.py): every kernel-dispatching module
of the package is registered, every registered test is a replay test that pytest collects, and on
the CPU the replays that can run here run and execute the modules they are registered for."""

import importlib.util
import pathlib
import textwrap

import pytest

from . import manifest


def test_every_kernel_dispatching_module_is_registered():
    found = manifest.dispatch_sources()
    missing = [s for s in found if s not in manifest.REGISTRY]
    assert not missing, f"kernel-dispatching modules without a replay test: {missing}"
    extra = set(manifest.REGISTRY) - set(found) - set(manifest.REGISTERED_BEYOND_THE_SCAN)
    assert not extra, f"registered, but no longer dispatching (or gone): {sorted(extra)}"
    gone = [s for s in manifest.REGISTRY if not (manifest.ROOT / s).is_file()]
    assert not gone, f"registered sources that do not exist: {gone}"


def _package(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = tmp_path / "dsa_precision" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_the_scan_follows_imports_and_calls_to_every_launch(tmp_path):
    root = _package(
        tmp_path,
        {
            "__init__.py": "from .via_call import score\n",
            "_cudnn.py": """
                def _import_dsa():
                    from cudnn import DSA
                    return DSA
                def dsa():
                    return _import_dsa()
                def dsa_available():
                    return _import_dsa() is not None
            """,
            "kernel.py": "import triton\n",
            "via_call.py": """
                from . import _cudnn
                def score(q):
                    return _cudnn.dsa().indexer_forward_wrapper(q)
            """,
            "transitive.py": """
                from dsa_precision import score
                class Layer:
                    def forward(self, q):
                        return score(q)
            """,
            "as_value.py": """
                from .via_call import score
                def pick(q, fn=None):
                    run = fn or score
                    return run(q)
            """,
            "accumulates.py": "def grad(t, i, v):\n    return t.index_put_((i,), v, accumulate=True)\n",
            "dynamic.py": """
                import importlib
                _MODULES = ("deep_gemm", "vllm.third_party.deep_gemm")
                def load():
                    return [importlib.import_module(m) for m in _MODULES]
            """,
            "asks_only.py": """
                from . import _cudnn
                def check():
                    return _cudnn.dsa_available()
            """,
            "pure.py": "def f(x):\n    return x.index_put_((x,), x)\n",
            "cli/bench.py": "import triton\n",
        },
    )
    found = manifest.dispatch_sources(root)
    want = ["_cudnn", "accumulates", "as_value", "dynamic", "kernel", "transitive", "via_call"]
    assert found == [f"dsa_precision/{m}.py" for m in want]


def test_every_registered_test_is_a_replay_test():
    problems = manifest.replay_test_problems(manifest.replay_tests())
    assert not problems, "\n".join(problems)


def test_a_test_that_does_not_replay_is_refused(tmp_path):
    (tmp_path / "t.py").write_text(
        textwrap.dedent(
            """
            from dsa_precision.testing import assert_replays_bit_exact
            def _helper(x):
                return assert_replays_bit_exact(lambda y: y, (x,))
            def test_via_helper():
                _helper(1)
            def test_once():
                assert_replays_bit_exact(lambda y: y, (1,), replays=1)
            def test_no_replay():
                assert 1 + 1 == 2
            def helper_not_a_test():
                _helper(1)
            """
        )
    )
    nodes = ["t.py::test_via_helper", "t.py::test_once", "t.py::test_no_replay[a]",
             "t.py::test_gone", "t.py::helper_not_a_test", "u.py::test_x"]  # fmt: skip
    problems = manifest.replay_test_problems(nodes, tmp_path)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "calls assert_replays_bit_exact with replays=1",
        "never calls assert_replays_bit_exact",
        "no test function test_gone in t.py",
        "no test function helper_not_a_test in t.py",
        "u.py does not exist",
    ]


def _exempt() -> tuple[str, ...]:
    """Sources whose CPU replays cannot run without an optional dependency."""
    exempt = []
    if importlib.util.find_spec("megatron.core") is None:
        exempt.append("dsa_precision/megatron/")
    if importlib.util.find_spec("triton") is None:
        exempt.append("dsa_precision/kernels/")
    return tuple(exempt)


def test_cpu_replays_run_and_execute_their_sources(tmp_path):
    trace = manifest.run_replays(manifest.replay_tests(), tmp_path)
    problems = manifest.coverage_problems(manifest.REGISTRY, trace, exempt=_exempt())
    assert not problems, "\n".join(problems) + "\n" + "\n".join(trace["output"].values())


def test_coverage_problems_are_named():
    registry = {
        "dsa_precision/a.py": ("t.py::test_a", "t.py::test_gpu"),
        "dsa_precision/b.py": ("t.py::test_b",),
        "dsa_precision/c.py": ("t.py::test_c", "t.py::test_gone"),
        "dsa_precision/d.py": ("t.py::test_gpu",),
    }
    run = dict(outcome="passed", replayed=True)
    trace = {
        "collected": [
            "t.py::test_a[x]",
            "t.py::test_a[y]",
            "t.py::test_b",
            "t.py::test_c",
            "t.py::test_gpu",
        ],
        "tests": {
            "t.py::test_a[x]": dict(run, files=["dsa_precision/z.py"]),
            "t.py::test_a[y]": dict(run, files=["dsa_precision/a.py"]),  # one param suffices
            "t.py::test_b": dict(run, files=["dsa_precision/b.py"], replayed=False),
            "t.py::test_c": dict(run, files=["dsa_precision/a.py"]),
            "t.py::test_gpu": dict(outcome="skipped", files=[], replayed=False),
        },
    }
    assert manifest.coverage_problems(registry, trace) == [
        "dsa_precision/b.py: t.py::test_b passed without assert_replays_bit_exact",
        "dsa_precision/b.py: no replay that runs on the CPU executed it",
        "dsa_precision/c.py: t.py::test_c ran without executing dsa_precision/c.py",
        "dsa_precision/c.py: t.py::test_gone is not collected by pytest",
        "dsa_precision/c.py: no replay that runs on the CPU executed it",
        "dsa_precision/d.py: no replay that runs on the CPU executed it",
    ]
    assert manifest.coverage_problems(registry, trace, exempt=("dsa_precision/d",))[-1].startswith(
        "dsa_precision/c.py"
    )


@pytest.mark.parametrize("source", sorted(manifest.REGISTRY))
def test_registered_sources_have_a_gpu_replay_too(source):
    """Every registered module also replays on the GPU (its kernels run there)."""
    assert any(n.startswith("tests/gpu/") for n in manifest.REGISTRY[source]), source
