"""vLLM 0.28.0's own query kernel for the DSA indexer as an oracle of ``vllm-legacy``.

vLLM 0.26-0.28 (the generic ``deepseek_v2.Indexer``) build the indexer's FP8 query in one Triton
launch, ``fused_indexer_q_rope_quant`` (``vllm/model_executor/layers/sparse_attn_indexer.py``:
the kernel ``_fused_indexer_q_rope_quant_kernel`` and its wrapper), which the model calls with the
BF16 ``wq_b`` output, the rotary module's ``cos_sin_cache``, the raw BF16 head weights of the
fused ``wk_weights_proj`` GEMM, ``softmax_scale = head_dim ** -0.5`` and ``n_head_scale = n_heads
** -0.5`` (``vllm/model_executor/models/deepseek_v2.py``, ``Indexer.forward``): RoPE in float32 of
the first 64 lanes rounded to BF16, the UE8M0 scale of the 128-vector, the E4M3 bytes and the
folded float32 weight ``w * q_scale * softmax_scale * head_scale``. The key side is vLLM's CUDA
kernel (:mod:`.legacy_kernel`).

The file runs as the wheel ships it (``ENGINE_FILES["vllm-legacy-q"]`` of
:mod:`.engine_kernels`, under ``DSA_ENGINE_KERNELS``): the module imports much of vLLM (its
custom-op registry, distributed groups, DeepGEMM wrappers) for the indexer op it also defines;
those imports are stand-ins that are never called, except ``current_platform`` (CUDA, E4M3 is
``float8_e4m3fn``) and ``get_fp8_min_max`` (``torch.finfo(float8_e4m3fn)``: -448, 448, as vLLM's
own on Hopper). Nothing of vLLM is in this repository.
"""

from __future__ import annotations

import hashlib
import os
import types
from pathlib import Path

import torch

from dsa_precision.cli.engine_model import EngineOperands
from dsa_precision.cli.synthetic import SyntheticIndexerInputs
from dsa_precision.engines import EngineProfile

from .engine_kernels import KNOWN_SHA256, kernel_files, load_module, missing_reason

__all__ = ["legacy_q_operands"]

_LOADED: dict[tuple[Path, ...], types.ModuleType] = {}


class _Platform:
    """vLLM's ``current_platform`` on an H200, as the query kernel's wrapper reads it."""

    dispatch_key = "CUDA"

    @staticmethod
    def is_cuda() -> bool:
        return True

    @staticmethod
    def fp8_dtype() -> torch.dtype:
        return torch.float8_e4m3fn


class _Unused(types.ModuleType):
    """A vLLM module the file imports names from for its other (never called) code paths."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return _unused(f"{self.__name__}.{name}")


def _unused(name: str) -> object:
    class Unused:
        """A stand-in: decorates to the thing decorated; calling it otherwise is an error."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        @classmethod
        def register(cls, *args: object, **kwargs: object):
            return lambda thing: thing

        def __class_getitem__(cls, item: object) -> type:
            return cls

    Unused.__name__ = Unused.__qualname__ = name.rsplit(".", 1)[-1]
    return Unused


def _stubs() -> dict[str, types.ModuleType]:
    import triton
    import triton.language as tl

    def package(name: str, **attrs: object) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__path__ = []
        module.__dict__.update(attrs)
        return module

    def unused(name: str) -> types.ModuleType:
        module = _Unused(name)
        module.__path__ = []
        return module

    stubs = {
        "vllm": package("vllm", envs=unused("vllm.envs"), _custom_ops=unused("vllm._custom_ops")),
        "vllm.platforms": package("vllm.platforms", current_platform=_Platform()),
        "vllm.triton_utils": package("vllm.triton_utils", tl=tl, triton=triton),
        "vllm.model_executor.layers.quantization.utils.quant_utils": package(
            "vllm.model_executor.layers.quantization.utils.quant_utils",
            get_fp8_min_max=lambda: (
                torch.finfo(torch.float8_e4m3fn).min,
                torch.finfo(torch.float8_e4m3fn).max,
            ),
        ),
        "vllm.compilation.breakable_cudagraph": package(
            "vllm.compilation.breakable_cudagraph", eager_break_during_capture=lambda fn: fn
        ),
        "vllm.utils.torch_utils": package(
            "vllm.utils.torch_utils",
            LayerNameType=str,
            _encode_layer_name=str,
            _resolve_layer_name=str,
            direct_register_custom_op=lambda **kwargs: None,
        ),
    }
    for name in (
        "vllm.envs", "vllm._custom_ops", "vllm._aiter_ops", "vllm.compilation", "vllm.config",
        "vllm.distributed", "vllm.forward_context", "vllm.logger", "vllm.model_executor",
        "vllm.model_executor.custom_op", "vllm.model_executor.layers",
        "vllm.model_executor.layers.attention", "vllm.model_executor.layers.attention.pcp",
        "vllm.model_executor.layers.quantization", "vllm.model_executor.layers.quantization.utils",
        "vllm.utils", "vllm.utils.deep_gemm", "vllm.utils.import_utils", "vllm.v1",
        "vllm.v1.attention", "vllm.v1.attention.backends", "vllm.v1.attention.backends.mla",
        "vllm.v1.attention.backends.mla.indexer", "vllm.v1.attention.ops",
        "vllm.v1.attention.ops.common", "vllm.v1.worker", "vllm.v1.worker.workspace",
    ):  # fmt: skip
        stubs.setdefault(name, unused(name))
    stubs["vllm.logger"] = package("vllm.logger", init_logger=lambda name: None)
    return stubs


def load(root: str | os.PathLike | None = None) -> tuple[types.ModuleType, str]:
    """vLLM 0.28.0's ``sparse_attn_indexer.py``, loaded unmodified once, and its release."""
    reason = missing_reason("vllm-legacy-q", root)
    if reason is not None:
        raise RuntimeError(f"the vllm-legacy-q oracle cannot run: {reason}.")
    files = kernel_files("vllm-legacy-q", root)
    assert files is not None
    if files not in _LOADED:
        _LOADED[files] = load_module(files[0], "_dsa_oracle_vllm028_indexer", _stubs())
    digest = hashlib.sha256(files[0].read_bytes()).hexdigest()
    return _LOADED[files], f"{KNOWN_SHA256.get(digest, 'unknown release')} (sha256 {digest[:12]})"


def legacy_q_operands(
    inputs: SyntheticIndexerInputs,
    profile: EngineProfile,
    k: EngineOperands,
    *,
    interleaved: bool,
    root: str | os.PathLike | None = None,
) -> tuple[EngineOperands, str]:
    """vLLM 0.28.0's E4M3 query and folded float32 head weights of ``inputs`` (batch 1), beside
    the key side ``k`` (its ``k`` and ``k_descale``, e.g. the profile's own or
    :func:`.legacy_kernel.legacy_kernel_key`'s): ``(operands, source)``.

    The wrapper gets what ``Indexer.forward`` hands it: positions ``0 .. S - 1``, the BF16 query
    ``[S, H, 128]``, the rotary module's cache ``[S, 64]`` (``[cos..., sin...]`` of the inputs'
    angles in ``profile.cos_sin_dtype``, BF16 for vLLM's compiled run), the raw head weights
    ``[S, H]`` BF16, ``head_dim ** -0.5``, ``H ** -0.5`` and the RoPE layout (``is_neox = not
    interleaved``). Runs where the tensors are (CUDA; the CPU under ``TRITON_INTERPRET=1``)."""
    module, source = load(root)
    s, h, d = inputs.seq_len, inputs.n_heads, inputs.head_dim
    angles = inputs.freqs[:, 0, 0, : inputs.rope_dim // 2].float()
    cache = torch.cat((torch.cos(angles), torch.sin(angles)), dim=-1).to(profile.cos_sin_dtype)
    positions = torch.arange(s, dtype=torch.int64, device=inputs.q.device)
    q8, w = module.fused_indexer_q_rope_quant(
        positions, inputs.q[:, 0].contiguous(), cache.contiguous(),
        inputs.w[:, 0].contiguous(), d**-0.5, h**-0.5, not interleaved,
    )  # fmt: skip
    return EngineOperands(q8, k.k, k.k_descale, w.reshape(s, h)), source
