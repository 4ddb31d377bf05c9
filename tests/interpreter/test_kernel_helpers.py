"""The fused kernel's building blocks, interpreted, against torch on large and adversarial inputs."""

import torch

from dsa_precision.exact_math import pairwise_sum
from dsa_precision.hadamard import hadamard_transform

from .. import kernel_probes
from ..helper_cases import bf16_rounding_inputs, e4m3_inputs, order_sensitive_rows


def test_e4m3_encoder_is_torch_round_to_nearest_even():
    x = e4m3_inputs()
    assert torch.equal(kernel_probes.e4m3_bits(x), x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_bf16_rounding_is_torch_round_to_nearest_even():
    x = bf16_rounding_inputs()
    got, want = kernel_probes.round_bf16(x), x.to(torch.bfloat16).float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))


def test_butterfly_matches_the_reference_stage_order():
    x = order_sensitive_rows()
    got = kernel_probes.hadamard_unscaled(x) * 128**-0.5  # the reference's scaling, in float64
    want = hadamard_transform(x, torch.float64)
    assert torch.equal(got.view(torch.int64), want.view(torch.int64))


def test_pairwise_sum_matches_the_reference_order():
    x = order_sensitive_rows()
    want = pairwise_sum(x)[:, 0]
    assert not torch.equal(want, x.sum(-1))  # the rows are order-sensitive
    assert torch.equal(kernel_probes.pairwise_sum(x).view(torch.int64), want.view(torch.int64))
