"""``legacy_key.inductor_layernorm_rule``: which ``vllm-legacy`` LayerNorm rule a compile cache
holds (Inductor's looped or persistent kernel, the XBLOCK its autotuner kept), read from cache
folders laid out as Inductor writes them (kernel file, ``.best_config`` beside it, the wrapper
that quotes the kernel's source)."""

from __future__ import annotations

import json

import pytest

from conformance.legacy_key import inductor_layernorm_rule

PER = "triton_per_fused__to_copy_native_layer_norm_slice_0"
RED = "triton_red_fused__to_copy_native_layer_norm_slice_0"


def _cache(tmp_path, name: str, xblock: int | None = None):
    kernel = tmp_path / "ab" / "cabc123.py"
    kernel.parent.mkdir(parents=True)
    kernel.write_text(f"import triton\n@triton.jit\ndef {name}(in_ptr0, out_ptr0, xnumel):\n")
    if xblock is not None:
        config = {"XBLOCK": xblock, "num_warps": 2, "num_stages": 1}
        (kernel.parent / "3f2a9c.best_config").write_text(json.dumps(config))  # a hashed name
    wrapper = tmp_path / "wr" / "cwrap.py"  # quotes every kernel; has no .best_config
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(
        f"{name} = async_compile.triton('{name}', '''\n@triton.jit\ndef {name}(in_ptr0):\n''')\n"
    )
    return tmp_path


@pytest.mark.parametrize(
    "xblock,rule", [(1, "fp32-inductor-x1"), (8, "fp32-inductor-x8"), (32, "fp32-inductor-x8")]
)
def test_a_persistent_kernel_gives_the_rule_of_its_kept_xblock(tmp_path, xblock, rule):
    got, what = inductor_layernorm_rule(_cache(tmp_path, PER, xblock))
    assert got == rule and f"XBLOCK {xblock}" in what and PER in what


def test_a_looped_kernel_is_the_welford_rule(tmp_path):
    assert inductor_layernorm_rule(_cache(tmp_path, RED))[0] == "fp32-welford"


def test_what_cannot_be_read_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds 0 LayerNorm kernels"):
        inductor_layernorm_rule(tmp_path)  # e.g. a CPU compile: C++, no Triton kernel
    with pytest.raises(ValueError, match=r"holds 0 \.best_config files"):
        inductor_layernorm_rule(_cache(tmp_path / "a", PER))
    with pytest.raises(ValueError, match="XBLOCK 4, not one of"):
        inductor_layernorm_rule(_cache(tmp_path / "b", PER, 4))
    both = _cache(tmp_path / "c", PER, 8)
    (both / "x.py").write_text(f"@triton.jit\ndef {RED}(in_ptr0):\n")
    with pytest.raises(ValueError, match="holds 2 LayerNorm kernels"):
        inductor_layernorm_rule(both)
