"""The package's own host time (examples/host_time.py), as the toy prints it."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

import dsa_precision

from ..support.helpers import import_example

package_host_seconds = import_example("host_time").package_host_seconds


def _function_in(path: str, name: str, body: str, env: dict):
    """A function whose code object claims ``path`` as its file (a frame of that package)."""
    exec(compile(f"def {name}():\n{body}\n", path, "exec"), env)
    return env[name]


def _spin(seconds: float) -> None:
    time.sleep(seconds)  # one traced call: a busy loop's calls would spend it in the tracer


def test_counts_package_frames_and_not_the_megatron_frames_they_call():
    megatron = pytest.importorskip("megatron.core")
    root = os.path.dirname(dsa_precision.__file__)
    meg_root = os.path.dirname(megatron.__file__)
    env = {"spin": _spin}
    env["meg"] = _function_in(
        os.path.join(meg_root, "fake_module.py"), "meg", "    spin(0.03)", env
    )
    # a frame of neither package between (as torch's Module.__call__): counts for its caller
    env["between"] = _function_in("/elsewhere/torch_like.py", "between", "    spin(0.01)", env)
    pkg = _function_in(
        os.path.join(root, "fake_module.py"),
        "pkg",
        "    spin(0.02)\n    between()\n    meg()",
        env,
    )
    outer = _function_in(
        "/elsewhere/trainer.py", "outer", "    spin(0.04)\n    pkg()", {**env, "pkg": pkg}
    )
    result, seconds = package_host_seconds(outer)
    assert result is None
    assert 0.03 <= seconds <= 0.045, seconds  # 0.02 + 0.01 of the package, not 0.03 / 0.04


def test_by_function_splits_the_package_time_among_its_functions():
    root = os.path.dirname(dsa_precision.__file__)
    env = {"spin": _spin}
    env["inner"] = _function_in(os.path.join(root, "fake_inner.py"), "inner", "    spin(0.03)", env)
    pkg = _function_in(
        os.path.join(root, "fake_module.py"), "pkg", "    spin(0.01)\n    inner()", env
    )
    split = {"earlier.py:1 kept": 1.0}
    _, seconds = package_host_seconds(pkg, by_function=split)
    assert split.pop("earlier.py:1 kept") == 1.0  # added to, not replaced
    assert sorted(split) == ["fake_inner.py:1 inner", "fake_module.py:1 pkg"]
    assert 0.03 <= split["fake_inner.py:1 inner"] <= 0.04, split
    assert 0.01 <= split["fake_module.py:1 pkg"] <= 0.02, split
    assert sum(split.values()) == pytest.approx(seconds)


def test_fp8_layer_forward_host_time_is_nonzero_and_bounded(megatron_parallel, cpu_rotary):
    from ..support.megatron import attention_inputs, make_attention, make_config, run_attention

    attn = make_attention(
        make_config(dsa_indexer_scoring_precision="fp8", dsa_indexer_rope_fp32=True)
    )
    inputs = attention_inputs()
    run_attention(attn, inputs)  # first call: lazy imports, caches
    start = time.perf_counter()
    _, seconds = package_host_seconds(lambda: run_attention(attn, inputs))
    wall = time.perf_counter() - start
    assert 0.0 < seconds < wall, (seconds, wall)
    # Megatron's sparse attention behind the seam is not the package's time
    _, megatron_only = package_host_seconds(
        lambda: run_attention(make_attention(make_config(), stock=True), inputs)
    )
    assert megatron_only < seconds
    assert torch.is_grad_enabled()


def test_a_package_generator_counts_only_while_it_runs():
    root = os.path.dirname(dsa_precision.__file__)
    env = {"spin": _spin}
    exec(
        compile("def gen():\n    spin(0.02)\n    yield\n    spin(0.02)\n",
                os.path.join(root, "fake_gen.py"), "exec"),
        env,
    )  # fmt: skip
    gen = env["gen"]

    def outer():
        g = gen()
        next(g)
        _spin(0.05)  # between the yield and the resume: not the package's
        next(g, None)

    _, seconds = package_host_seconds(outer)
    assert 0.04 <= seconds <= 0.055, seconds


def test_refuses_while_another_profiler_holds_the_slot():
    mon = sys.monitoring
    mon.use_tool_id(mon.PROFILER_ID, "someone")
    try:
        with pytest.raises(RuntimeError, match="profiler slot is taken by 'someone'"):
            package_host_seconds(lambda: None)
    finally:
        mon.free_tool_id(mon.PROFILER_ID)
    assert package_host_seconds(lambda: 7)[0] == 7  # released: usable again
