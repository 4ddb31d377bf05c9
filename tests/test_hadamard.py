"""The Hadamard rotation (dsa_precision.hadamard) against a dense float64 Sylvester matrix."""

import math

import pytest
import torch

from dsa_precision.hadamard import hadamard_transform, rotate_activation

from .support.helpers import exact_hadamard_like_fast_hadamard, sylvester


def test_hadamard_matches_dense_float64_and_is_orthogonal():
    x = torch.randn(50, 128)
    y = hadamard_transform(x, torch.float32)
    dense = (x.double() @ sylvester(128)) / math.sqrt(128)
    assert torch.equal(y, dense.float())  # exact sums, one rounding: the same bits
    back = hadamard_transform(y, torch.float64)
    assert torch.allclose(back, x.double(), atol=1e-6)
    xb = x.to(torch.bfloat16)
    assert torch.equal(
        rotate_activation(xb, fp32=False), exact_hadamard_like_fast_hadamard(xb, 128**-0.5)
    )
    with pytest.raises(TypeError, match="float32"):
        rotate_activation(xb, fp32=True)
