"""PreprocessRules: the fused kernel's arithmetic as one object, built from the engine profile and the preprocessing module."""

import pytest

from dsa_precision.engines import DEFAULT_ENGINE


@pytest.mark.parametrize("interleaved, hadamard", [(False, False), (True, True)])
def test_the_kernel_writes_input_lane_order_only_for_interleaved_pairs(interleaved, hadamard):
    """The fused kernel's in-place lane order (the engines' order of interleaved RoPE pairs) is a
    permutation that undoes the de-interleaving: without it, or with the Hadamard mixing lanes,
    the rules refuse it before any launch."""
    from dsa_precision.kernels.rules import PreprocessRules

    with pytest.raises(ValueError, match=r"input_lane_order .* needs interleaved=True and no Had"):
        PreprocessRules(
            DEFAULT_ENGINE.q_quant, DEFAULT_ENGINE.k_quant, rope_dim=64, interleaved=interleaved,
            hadamard=hadamard, input_lane_order=True,
        )  # fmt: skip
