"""SGLang 0.5.23's unfused DSA indexer preparation as an oracle, run unmodified from its wheel.

The oracle of the ``sglang-unfused`` profile (docs/numerics.md, section 8.6; measured in
docs/gpu-validation.md, "SGLang's unfused path"). The path is
DeepSeek-V3.2's on CUDA (NeoX rotate-half indexer RoPE, so ``use_dsa_indexer_fusion`` is false:
``srt/layers/attention/dsa/dsa_indexer.py:310-314``), the non-graph branch of
``Indexer.forward_cuda`` (``dsa_indexer.py:2096-2198``). Its launches, in order:

1. the key LayerNorm: SGLang's ``LayerNorm.forward_cuda`` (``srt/layers/layernorm.py:1038-1049``)
   -> FlashInfer 0.7.2's ``flashinfer.norm.layernorm`` (``norm/__init__.py:591-619``) -> the CuTe
   DSL ``layernorm_cute`` (``norm/kernels/layernorm.py:315-336``, compiled by nvidia-cutlass-dsl);
2. RoPE on the first 64 lanes of q and k, in place: ``RotaryEmbedding.forward_cuda``
   (``srt/layers/rotary_embedding/base.py:453-475``) -> ``apply_rope_with_cos_sin_cache_inplace``
   (``kernels/ops/attention/rope.py:213-255``, JIT ``csrc/elementwise/rope.cuh``);
3. the Hadamard rotation of q, then of k: ``rotate_activation`` (``dsa_indexer.py:252-264``) ->
   ``hadamard_transform`` (``kernels/ops/quantization/hadamard.py``, JIT
   ``csrc/fast-hadamard-transform/hadamard_jit.cuh``);
4. q ``act_quant(query, 128, "ue8m0")`` (``kernels/ops/quantization/act_quant_triton.py``);
5. k ``fused_store_index_k_cache`` into the page-64 index-K cache
   (``kernels/ops/kvcache/dsa_fused_store_index_cache.py``, JIT
   ``csrc/dsa/fused_store_index_cache.cuh``), through ``Indexer._store_index_k_cache``;
6. the head weights: ``Indexer._get_logits_head_gate`` (``dsa_indexer.py:584-591``,
   ``@torch.compile(dynamic=True)``): ``torch.mm(x, W.t(), out_dtype=float32)`` then
   ``* n_heads**-0.5``, ``* q_scale``, ``* softmax_scale``.

The oracle loads ``dsa_indexer.py`` itself and calls the methods of that branch on an ``Indexer``
whose ``__init__`` did not run (its attributes set to the values ``__init__`` gives a DeepSeek-V3.2
layer on CUDA, cited where set), in the branch's order (``dsa_indexer.py:2097-2125, 2143, 2198``):
``_get_q_k_bf16``, ``act_quant``, ``_store_index_k_cache``, ``_get_logits_head_gate``. The code of
every launch above is the wheels'; what stands in (for the duration of each import, and of the run
for the two imports made at call time) is: SGLang's ``BaseFusedOp`` (an ``nn.Module`` whose
``forward`` is ``forward_cuda``: ``kernels/fused_op.py`` step 5 on CUDA), ``register_custom_op``
and ``register_split_op`` (the function itself, which is what SGLang's wrapper calls in eager mode
under no_grad with CUDA tensors: ``srt/utils/custom_op.py`` ``_call_directly_in_eager``),
``sglang.srt.utils`` (CUDA, no AITER, FlashInfer available), FlashInfer's ``flashinfer_api`` /
``register_custom_op`` / ``register_fake_op`` (identities, as 0.7.2 defines them at log level 0),
the projections (``wq_b`` / ``wk`` return the given BF16 outputs), the KV pool (one layer's
index-K buffer, page 64) and the context-parallel hooks (off); every other engine import is a
name that raises if called (:class:`_Absent`).

Files: :data:`SGLANG_UNFUSED_FILES` (SGLang wheel) and :data:`FLASHINFER_FILES` (FlashInfer
wheel), relative to a root of ``DSA_ENGINE_KERNELS``; their SHA-256 in :data:`UNFUSED_SHA256`.
The JIT modules build through SGLang's own build code (:class:`.sglang_jit.SglangJit`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from dsa_precision.cli.engine_model import EngineOperands
from dsa_precision.cli.synthetic import SyntheticIndexerInputs

from .loader import ENV_VAR, EngineKernelRun, load_module, package, roots, scoped_modules, sha256
from .sglang_jit import (
    SGLANG_COMMON_HEADERS,
    SGLANG_JIT,
    SGLANG_JIT_PY,
    SGLANG_K_NORM_EPS,
    SGLANG_PAGE,
    SGLANG_SHARED_SHA256,
    SglangEnvs,
    SglangJit,
    sglang_stubs,
    sglang_toolchain_reason,
)

__all__ = [
    "FLASHINFER_FILES",
    "SGLANG_UNFUSED_FILES",
    "UNFUSED_SHA256",
    "run_sglang_unfused",
    "sglang_unfused_build",
    "sglang_unfused_files",
    "sglang_unfused_missing_reason",
]

_SGL_OPS = "sglang/kernels/ops"
_CSRC = f"{SGLANG_JIT}/csrc"
_HADAMARD = f"{_CSRC}/fast-hadamard-transform"
# The three kernels' headers (rope.cuh, hadamard_jit.cuh, fused_store_index_cache.cuh: nvcc -M).
_UNFUSED_HEADERS = tuple(sorted((*SGLANG_COMMON_HEADERS, "runtime.cuh")))
# SGLang 0.5.23's files the oracle runs or compiles, the entry module first.
SGLANG_UNFUSED_FILES: tuple[str, ...] = (
    "sglang/srt/layers/attention/dsa/dsa_indexer.py",
    "sglang/srt/layers/layernorm.py",
    "sglang/srt/layers/rotary_embedding/utils.py",
    "sglang/srt/layers/rotary_embedding/base.py",
    "sglang/kernels/kernel_api_logging.py",
    f"{_SGL_OPS}/attention/rope.py",
    f"{_SGL_OPS}/quantization/hadamard.py",
    f"{_SGL_OPS}/quantization/act_quant_triton.py",
    f"{_SGL_OPS}/kvcache/dsa_fused_store_index_cache.py",
    *(f"{SGLANG_JIT}/utils/{name}.py" for name in SGLANG_JIT_PY),
    f"{_CSRC}/elementwise/rope.cuh",
    f"{_HADAMARD}/hadamard_jit.cuh",
    f"{_HADAMARD}/fast_hadamard_transform.h",
    f"{_HADAMARD}/fast_hadamard_transform_common.h",
    f"{_HADAMARD}/fast_hadamard_transform_special.h",
    f"{_HADAMARD}/static_switch.h",
    f"{_CSRC}/dsa/fused_store_index_cache.cuh",
    *(f"{SGLANG_JIT}/include/sgl_kernel/{name}" for name in _UNFUSED_HEADERS),
)
# FlashInfer 0.7.2's key LayerNorm (the CuTe DSL kernel and the dispatch that picks it), the entry
# module first, then in import order (each imports only the ones after the entry before it).
FLASHINFER_FILES: tuple[str, ...] = (
    "flashinfer/norm/__init__.py",
    "flashinfer/cute_dsl/availability.py",
    "flashinfer/cute_dsl/utils.py",
    "flashinfer/norm/utils.py",
    "flashinfer/norm/kernels/layernorm.py",
)
# SHA-256 of the files as sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl (sha256 8d257a31...)
# and flashinfer_python-0.7.2-py3-none-any.whl (sha256 770550a0...) ship them: SGLANG_UNFUSED_FILES
# less those both SGLang oracles run (sglang_jit.SGLANG_SHARED_SHA256, the last entry), then
# FLASHINFER_FILES.
UNFUSED_SHA256: dict[str, str] = {
    "0cd22ce00ee58c585e98b24ff1874ac0f2703eea70195fa61c7476b75c1b000a": "sglang 0.5.23",
    "dca150fc6e2c469d036633d0abd1b39d95480b8ade6c2f2e5260c6240c49d68e": "sglang 0.5.23",
    "d3cfbaa939422f47b84b96a8878a98b178a7182a79656440c08938804517c4f7": "sglang 0.5.23",
    "b31159b6ba527971a63ef5d59e4a42edae7a60dd1e7256fcd373c136e095b74a": "sglang 0.5.23",
    "bf8a100d8e1d75b542aeb3ef74c109d3170b6a0ddfa4697976d05e7714460330": "sglang 0.5.23",
    "b41967420e3242d0cfb3970375ccdfdc829cfd36656499c0b72bf8c20e38ca39": "sglang 0.5.23",
    "7cef4342b1d8705e87baf7f41fad2b30e59958774b96a5cf5252f44a9cd40196": "sglang 0.5.23",
    "46780a3c1b3339a5f925f463f9589b39b95cc1f6689c3b7e3384eccc0b35ac73": "sglang 0.5.23",
    "8d9614c3b1b2ed698242dc4241102a9d6aa5b4db06efb0c9f63057cf80c9f573": "sglang 0.5.23",
    "a172ebb9e66aef598c329a5e66198123e17663bbf8cb5b2df994f164d8eae54e": "sglang 0.5.23",
    "9142ca8c99423ae5e16cbd2016baa1d1d914c70c5fade96d26cb67c8aa1bd9f0": "sglang 0.5.23",
    "3a780812ee6425803095087b2548a26998a6e4ec8410290ee0ae57af634bbabe": "sglang 0.5.23",
    "d5563e8b2e4d240ed5b64520d550116897d3132b892bf304e6d949042596ecaa": "sglang 0.5.23",
    "1a6d0b7b9cb9c200bfa573ed99f25c4502a0d2024400d7a2923453c4a77eaa8a": "sglang 0.5.23",
    "1f989a2dee7a32ab519eeb49adf407c5e4054195faa77aa92ce4211343973213": "sglang 0.5.23",
    # FLASHINFER_FILES, in order.
    "fdd12d976c3e57300e72efc9e29367ca9993f7def84b20b30082b0edef47e2b7": "flashinfer 0.7.2",
    "39d47171f5dc1c92d73290a5dfdc7c018da7fd2bcdee498b16547e6ea08bc024": "flashinfer 0.7.2",
    "971faf2b712c8d973cf7b81fdb97b12d04d0fb9ff350c314981c1049b3816a25": "flashinfer 0.7.2",
    "3f44ac6727c58883420068bf0aa5b239b12d2e86819ad80e54bc1bc016ec881a": "flashinfer 0.7.2",
    "123dd99aa37202ee499654e80c39c2edef5517b5b8b1e46c70885619c885fff0": "flashinfer 0.7.2",
    **SGLANG_SHARED_SHA256,
}

# DeepSeek-V3.2's indexer as srt/models/deepseek_v2.py:2121-2139 builds it: UE8M0 q scales.
_SCALE_FMT = "ue8m0"
_BLOCK = 128


# ------------------------------------------------------------------------------ the files


def sglang_unfused_files(
    root: str | os.PathLike | None = None,
) -> tuple[tuple[Path, ...], tuple[Path, ...]] | None:
    """``(SGLang's files, FlashInfer's files)`` under the first root (of ``DSA_ENGINE_KERNELS``, or
    ``root``) holding each set, or ``None`` when a set is under none."""
    found = []
    for rels in (SGLANG_UNFUSED_FILES, FLASHINFER_FILES):
        candidates = (tuple(r / f for f in rels) for r in roots(root))
        hit = next((paths for paths in candidates if all(p.is_file() for p in paths)), None)
        if hit is None:
            return None
        found.append(hit)
    return found[0], found[1]


def sglang_unfused_missing_reason(
    root: str | os.PathLike | None = None, *, need_device: bool = True
) -> str | None:
    """Why the unfused oracle cannot run here (or, with ``need_device=False``, cannot build its
    JIT modules), or ``None`` when it can: the files, SGLang's JIT toolchain (apache-tvm-ffi,
    nvcc, ``$CXX``), Triton (``act_quant``), nvidia-cutlass-dsl (FlashInfer's CuTe DSL LayerNorm),
    a CUDA device."""
    if sglang_unfused_files(root) is None:
        where = os.fspath(root) if root is not None else os.environ.get(ENV_VAR)
        if not where:
            return f"{ENV_VAR} is not set (docs/gpu-validation.md: the engine-kernel recipe)"
        missing = [
            rel for rel in (*SGLANG_UNFUSED_FILES, *FLASHINFER_FILES)
            if not any((r / rel).is_file() for r in roots(root))
        ]  # fmt: skip
        head = " ".join(missing[:3]) + (f" (+{len(missing) - 3} more)" if len(missing) > 3 else "")
        return f"{where} holds no {head or 'root with a whole set'}"
    reason = sglang_toolchain_reason(need_device=need_device)
    if reason is not None:
        return reason
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (SGLang's act_quant is a Triton kernel)"
    if need_device and importlib.util.find_spec("cutlass") is None:
        return "nvidia-cutlass-dsl is not installed (FlashInfer 0.7.2's CuTe DSL LayerNorm)"
    return None


# ---------------------------------------------------------------------------- stand-ins


class _Unreached:
    """A name an engine module imports that the oracle's path never uses: calling it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: object, **kwargs: object) -> Any:
        raise RuntimeError(
            f"the sglang-unfused oracle reached {self._name}, which it stands in for as unused: "
            "the engine's path differs from the one this oracle reproduces."
        )

    def __repr__(self) -> str:
        return f"<unreached {self._name}>"


class _Absent(types.ModuleType):
    """An engine module the oracle's path does not run: its public names are :class:`_Unreached`
    (so ``from m import a, b`` resolves), the names given are the stand-ins stated."""

    def __init__(self, name: str, **attrs: object) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        self.__dict__.update(attrs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unreached(f"{self.__name__}.{name}")


def _identity_decorator(fn: Any = None, *args: object, **kwargs: object) -> Any:
    """``register_custom_op`` (SGLang's and FlashInfer's) and ``flashinfer_api``, bare or called:
    the function itself."""
    if callable(fn) and not args and not kwargs:
        return fn
    return lambda f: f


def _decorator_factory(*args: object, **kwargs: object) -> Any:
    """``register_split_op()``, ``register_fake_op(name)``, ``backend_requirement(...)``,
    ``supported_compute_capability(...)``: a decorator returning the function."""
    return lambda f: f


class _CudaFusedOp(torch.nn.Module):
    """SGLang's ``BaseFusedOp`` as it dispatches on CUDA for these ops (``kernels/fused_op.py``:
    no kernel backend declared in ``capabilities``, so step 5, ``forward_cuda``)."""

    forward_cuda: Callable[..., Any]  # the SGLang op's own

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_cuda(*args, **kwargs)


def _no(*args: object, **kwargs: object) -> bool:
    return False


def _srt_utils() -> types.ModuleType:
    """``sglang.srt.utils`` for the four SGLang modules that import it: CUDA, FlashInfer
    available, no AITER / HIP / NPU / XPU / MUSA / MPS / AMX CPU, every env switch off."""
    utils = _Absent(
        "sglang.srt.utils",
        is_cuda=lambda: True,
        is_flashinfer_available=lambda: True,
        get_compiler_backend=lambda: "inductor",
    )
    for name in ("is_hip", "is_npu", "is_cpu", "is_xpu", "is_musa", "is_mps", "is_gfx95_supported",
                 "is_gfx1250_supported", "cpu_has_amx_support", "get_bool_env_var"):  # fmt: skip
        setattr(utils, name, _no)
    return utils


class _IndexKPool:
    """``DSATokenToKVPool`` as ``Indexer._store_index_k_cache`` reads it on CUDA: the index page
    (64 tokens, ``srt/mem_cache/memory_pool.py``) and one layer's ``index_k_with_scale`` buffer,
    ``[pages, 64 * (128 + 4)]`` uint8; no layer split (neither ``_is_layer_owned`` nor
    ``invalidate_index_buffer_for_layer``)."""

    index_page_size = SGLANG_PAGE

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer

    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        return self.buffer

    def set_index_k_scale_buffer(self, **kwargs: object) -> None:
        raise RuntimeError(
            "SGLang took its act_quant fallback for the index-K store (can_use_dsa_fused_store "
            "was false: the fused_store_index_k_cache JIT module did not build; see its warning)."
        )


class _ForwardContext:
    """``sglang.srt.model_executor.forward_context.get_token_to_kv_pool``: the run's pool."""

    pool: _IndexKPool | None = None

    @classmethod
    def get_token_to_kv_pool(cls) -> _IndexKPool:
        assert cls.pool is not None
        return cls.pool


class _Projection(torch.nn.Module):
    """A ``ReplicatedLinear`` (``wq_b``, ``wk``) that returns the given BF16 GEMM output, as its
    ``(output, bias)`` pair: a fresh copy per call (RoPE then writes into it in place)."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__()
        self.output = output

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.output.clone(), None


class _WeightsProj(torch.nn.Module):
    """``weights_proj`` (a BF16 ``ReplicatedLinear``) as ``_weights_proj_bf16_in_fp32_out`` reads
    it on CUDA: only its ``weight`` ``[H, hidden]``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)


def _einops() -> types.ModuleType:
    """einops if installed (SGLang requires it); else ``rearrange`` for the one pattern the path
    uses (``dsa_indexer.py:908,930``: ``"l (h d) -> l h d"``, a view of the contiguous output)."""
    if importlib.util.find_spec("einops") is not None:
        import einops

        return einops

    def rearrange(t: torch.Tensor, pattern: str, **axes: int) -> torch.Tensor:
        if pattern != "l (h d) -> l h d" or set(axes) != {"d"}:
            raise NotImplementedError(f"rearrange stand-in: {pattern!r} {axes}")
        return t.view(t.shape[0], -1, axes["d"])

    return package("einops", rearrange=rearrange)


def _tree(stubs: dict[str, types.ModuleType], *names: str, **attrs: object) -> types.ModuleType:
    """Add ``names[0]`` (an :class:`_Absent` with ``attrs``, unless already there) and any missing
    parent packages to ``stubs``; the module."""
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts)):
            stubs.setdefault(".".join(parts[:i]), _Absent(".".join(parts[:i])))
        stubs.setdefault(name, _Absent(name))
    module = stubs[names[0]]
    module.__dict__.update(attrs)
    return module


# ------------------------------------------------------------------------------ the loader


_LOADED: dict[tuple[Path, ...], types.SimpleNamespace] = {}


def _load_flashinfer(files: tuple[Path, ...]) -> tuple[types.ModuleType, dict]:
    """FlashInfer 0.7.2's ``flashinfer.norm`` (its ``layernorm`` and the dispatch to the CuTe DSL
    kernel) with the kernel's import chain, unmodified; and the stand-ins its call-time import
    (``_cute_dsl_supports_arch``: ``..cute_dsl.availability``) needs."""
    entry, availability, dsl_utils, norm_utils, layernorm = files
    stubs: dict[str, types.ModuleType] = {
        "flashinfer": package("flashinfer"),
        "flashinfer.cute_dsl": package("flashinfer.cute_dsl"),  # never its __init__ (GEMMs)
        "flashinfer.norm": package("flashinfer.norm"),
        "flashinfer.norm.kernels": package("flashinfer.norm.kernels"),  # never its __init__
    }
    for name, path in (
        ("flashinfer.cute_dsl.availability", availability),
        ("flashinfer.cute_dsl.utils", dsl_utils),
        ("flashinfer.norm.utils", norm_utils),
        ("flashinfer.norm.kernels.layernorm", layernorm),
    ):
        stubs[name] = load_module(path, name, stubs)
    calls = {k: stubs[k] for k in ("flashinfer", "flashinfer.cute_dsl",
                                   "flashinfer.cute_dsl.availability")}  # fmt: skip
    # norm/__init__.py's imports: the norm kernels package (only layernorm_cute is reached), the
    # logging / tracing decorators (identities at FLASHINFER_LOGLEVEL=0, as 0.7.2 defines
    # register_custom_op / register_fake_op: flashinfer/utils.py:400-445), the CUDA JIT fallback
    # (not taken where the CuTe DSL targets the device).
    entry_stubs = {
        **stubs,
        "flashinfer.norm.kernels": _Absent(
            "flashinfer.norm.kernels", layernorm_cute=stubs["flashinfer.norm.kernels.layernorm"]
            .layernorm_cute,
        ),
        "flashinfer.api_logging": package("flashinfer.api_logging",
                                           flashinfer_api=_identity_decorator),
        "flashinfer.trace": _Absent("flashinfer.trace"),
        "flashinfer.trace.templates": _Absent("flashinfer.trace.templates"),
        "flashinfer.trace.templates.norm": _Absent("flashinfer.trace.templates.norm"),
        "flashinfer.utils": _Absent(
            "flashinfer.utils", register_custom_op=_identity_decorator,
            register_fake_op=_decorator_factory, backend_requirement=_decorator_factory,
            supported_compute_capability=_decorator_factory,
        ),
        "flashinfer.jit": _Absent("flashinfer.jit"),
        "flashinfer.jit.norm": _Absent("flashinfer.jit.norm"),
        "flashinfer.jit.rmsnorm_silu": _Absent("flashinfer.jit.rmsnorm_silu"),
    }  # fmt: skip
    del entry_stubs["flashinfer.norm"]
    norm = load_module(entry, "flashinfer.norm", entry_stubs)
    return norm, calls


def _load_sglang_unfused(sgl: tuple[Path, ...], fi: tuple[Path, ...]) -> types.SimpleNamespace:
    """SGLang's unfused indexer modules and FlashInfer's LayerNorm, loaded unmodified with the
    stand-ins; the JIT build is SGLang's own less its cache (``_SglangJit``)."""
    files = dict(zip(SGLANG_UNFUSED_FILES, sgl, strict=True))
    root = sgl[0].parents[5]  # the folder holding sglang/
    norm, fi_calls = _load_flashinfer(fi)

    stubs = sglang_stubs(root)
    jit = SglangJit.load(files.__getitem__, stubs, " ".join(sha256(p) for p in (*sgl, *fi)))
    jit_modules = jit.m
    # beyond SglangJit.load's exports: what these files import
    stubs["sglang.kernels.jit.utils"].__dict__["KERNEL_PATH"] = jit_modules[
        "compile/paths"
    ].KERNEL_PATH
    stubs["sglang.srt.utils"] = _srt_utils()
    stubs["sglang.srt.utils.custom_op"] = package(
        "sglang.srt.utils.custom_op", register_custom_op=_identity_decorator
    )
    stubs["sglang.kernels.kernel_api_logging"] = load_module(
        files["sglang/kernels/kernel_api_logging.py"], "sglang.kernels.kernel_api_logging", stubs
    )
    for sub in ("quantization", "kvcache"):
        stubs[f"sglang.kernels.ops.{sub}"] = package(f"sglang.kernels.ops.{sub}")

    def kernel(rel: str) -> types.ModuleType:
        name = rel.removesuffix(".py").replace("/", ".")
        stubs[name] = load_module(files[rel], name, stubs)
        return stubs[name]

    rope = kernel(f"{_SGL_OPS}/attention/rope.py")
    hadamard = kernel(f"{_SGL_OPS}/quantization/hadamard.py")
    act_quant = kernel(f"{_SGL_OPS}/quantization/act_quant_triton.py")
    store = kernel(f"{_SGL_OPS}/kvcache/dsa_fused_store_index_cache.py")

    # The rotary, LayerNorm and indexer modules: SGLang's srt answers on a CUDA host.
    common = {
        "sglang.kernels.fused_op": package("sglang.kernels.fused_op", BaseFusedOp=_CudaFusedOp),
        "sglang.srt.environ": package("sglang.srt.environ", envs=SglangEnvs()),
    }
    srt = {k: v for k, v in stubs.items() if k.startswith(("sglang.kernels", "sglang.srt.utils"))}
    srt.update(common, sglang=stubs["sglang"])
    _tree(srt, "sglang.srt.platforms", current_platform=types.SimpleNamespace(is_out_of_tree=_no))
    _tree(srt, "sglang.srt.runtime_context", publish_role=lambda: None)
    rope_pkg = "sglang.srt.layers.rotary_embedding"
    srt[rope_pkg] = package(rope_pkg, files["sglang/srt/layers/rotary_embedding/base.py"].parent)
    _tree(srt, rope_pkg)
    for stem in ("utils", "base"):
        srt[f"{rope_pkg}.{stem}"] = load_module(
            files[f"sglang/srt/layers/rotary_embedding/{stem}.py"], f"{rope_pkg}.{stem}", srt
        )
    base = srt[f"{rope_pkg}.base"]

    norm_stubs = {k: v for k, v in srt.items() if not k.startswith(rope_pkg)}
    norm_stubs["flashinfer"] = package("flashinfer", norm=norm)
    norm_stubs["flashinfer.norm"] = norm
    norm_stubs["sgl_kernel"] = _Absent("sgl_kernel")
    for name in (
        "sglang.srt.batch_invariant_ops",
        "sglang.srt.model_executor.cuda_graph_config",
        "sglang.kernels.ops.layernorm.rmsnorm_hf",
        "sglang.kernels.ops.layernorm.norm",
    ):
        _tree(norm_stubs, name)
    layernorm = load_module(
        files["sglang/srt/layers/layernorm.py"], "sglang.srt.layers.layernorm", norm_stubs
    )

    ix_stubs = {k: v for k, v in srt.items() if not k.startswith(rope_pkg)}
    ix_stubs["einops"] = _einops()
    ix_stubs["deep_gemm"] = _Absent("deep_gemm")  # only the scorers use it
    ix_stubs["sglang.srt.layers.layernorm"] = layernorm
    ix_stubs["sglang.kernels.ops.kvcache.dsa_fused_store_index_cache"] = store
    ix_stubs.pop("sglang.kernels.ops.attention.dsa", None)  # its __init__'s names: unreached
    _tree(ix_stubs, "sglang.kernels.ops.quantization.fp8_kernel",
          fp8_dtype=torch.float8_e4m3fn, is_fp8_fnuz=_no)  # fmt: skip
    _tree(ix_stubs, "sglang.srt.compilation.compilation_config",
          register_split_op=_decorator_factory)  # fmt: skip
    dsa = "sglang.srt.layers.attention.dsa"
    _tree(ix_stubs, f"{dsa}.dsa_npu_indexer",
          DSANPUIndexerMixin=type("DSANPUIndexerMixin", (), {}))  # fmt: skip
    _tree(ix_stubs, f"{dsa}.utils", aiter_can_use_preshuffle_paged_mqa=_no)
    _tree(ix_stubs, "sglang.srt.layers.attention.kv_shard_hooks",
          get_kv_shard_pool=lambda pool: None)  # fmt: skip
    _tree(ix_stubs, "sglang.srt.layers.cp.utils", is_cp_active=lambda forward_batch: False)
    _tree(ix_stubs, "sglang.srt.model_executor.forward_context",
          get_token_to_kv_pool=_ForwardContext.get_token_to_kv_pool)  # fmt: skip
    for name in (
        "sglang.kernels.ops.attention.dsa",
        "sglang.kernels.ops.attention.dsa.fp8_fused_writer_hip",
        "sglang.kernels.ops.attention.dsa.indexer_k",
        "sglang.kernels.ops.attention.dsa.indexer_q",
        f"{dsa}.dsa_indexer_metadata",
        f"{dsa}.dsa_prefill_cuda_graph",
        f"{dsa}.paged_mqa_logits_backend",
        f"{dsa}.head_gate",
        "sglang.srt.layers.attention.graph_variants",
        "sglang.srt.layers.attention.mqa_logits_utils",
        "sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.context",
        "sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph",
        "sglang.srt.state_capturer.indexer_topk",
        "sglang.srt.layers.deep_gemm_wrapper",
        "sglang.srt.layers.cp.base",
        "sglang.srt.layers.linear",
        "sglang.srt.layers.quantization.base_config",
        rope_pkg,
        "sglang.srt.model_executor.forward_batch_info",
        "sglang.srt.model_executor.runner",
    ):
        _tree(ix_stubs, name)
    indexer = load_module(files[SGLANG_UNFUSED_FILES[0]], f"{dsa}.dsa_indexer", ix_stubs)

    # The two imports SGLang makes at call time on this path: rotate_activation's
    # (sglang.kernels.ops.quantization.hadamard) and FlashInfer's capability probe.
    calls = {
        **fi_calls,
        **{k: stubs[k] for k in ("sglang", "sglang.kernels", "sglang.kernels.ops",
                                 "sglang.kernels.ops.quantization")},
        "sglang.kernels.ops.quantization.hadamard": hadamard,
        # The indexer module itself, importable while torch.compile traces its methods.
        **{k: ix_stubs[k] for k in ("sglang.srt", "sglang.srt.layers",
                                    "sglang.srt.layers.attention", dsa)},
        f"{dsa}.dsa_indexer": indexer,
    }  # fmt: skip
    return types.SimpleNamespace(
        jit=jit, arch=jit_modules["arch"], rope=rope, hadamard=hadamard, act_quant=act_quant,
        store=store, base=base, layernorm=layernorm, norm=norm, indexer=indexer, calls=calls,
    )  # fmt: skip


def load_sglang_unfused(
    root: str | os.PathLike | None = None, *, reason: str | None = ""
) -> tuple[types.SimpleNamespace, str]:
    """The loaded modules (cached per files) and the release the files are (their SHA-256 in
    :data:`UNFUSED_SHA256`, naming any that is not the wheels'); ``RuntimeError`` with the
    reason when they cannot run (``reason``: the caller's own check, ``None`` for none)."""
    if reason == "":
        reason = sglang_unfused_missing_reason(root)
    if reason is not None:
        raise RuntimeError(f"the sglang-unfused oracle cannot run: {reason}.")
    found = sglang_unfused_files(root)
    assert found is not None
    sgl, fi = found
    key = (*sgl, *fi)
    if key not in _LOADED:
        _LOADED[key] = _load_sglang_unfused(sgl, fi)
    digests = [sha256(p) for p in key]
    releases = sorted({UNFUSED_SHA256.get(d, "unknown release") for d in digests})
    rels = (*SGLANG_UNFUSED_FILES, *FLASHINFER_FILES)
    unknown = [f for f, d in zip(rels, digests, strict=True) if d not in UNFUSED_SHA256]
    note = f"; not the wheels': {' '.join(unknown)}" if unknown else ""
    return _LOADED[key], f"{', '.join(releases)} ({len(key)} files{note})"


def sglang_unfused_build(
    root: str | os.PathLike | None = None, *, capability: tuple[int, int] | None = None
) -> list[Path]:
    """Build the path's three SGLang JIT modules as it instantiates them (fused RoPE
    ``<is_neox=true, rope_dim=64, pdl, bf16, bf16>``, Hadamard ``<bf16>``, the index-K store
    ``<bf16, int64, 64, pdl>``) through SGLang's own build code, without running them; the shared
    libraries. ``capability``: for that SM (``(9, 0)``: ``sm_90a``) instead of the local GPU's.
    FlashInfer's CuTe DSL LayerNorm compiles at its first call (``cute.compile``), not here."""
    reason = sglang_unfused_missing_reason(root, need_device=capability is None)
    module, _ = load_sglang_unfused(root, reason=reason)
    return module.jit.build(
        module.arch,
        capability,
        lambda: module.rope._jit_fused_rope_module(True, 64, torch.bfloat16, torch.bfloat16),
        lambda: module.hadamard._jit_hadamard_module(torch.bfloat16),
        lambda: module.store._jit_dsa_fused_store_module(torch.bfloat16, torch.int64, SGLANG_PAGE),
    )


# ---------------------------------------------------------------------------------- the run


@contextlib.contextmanager
def _calling(stubs: Mapping[str, types.ModuleType]) -> Iterator[None]:
    with scoped_modules(stubs):
        yield


def _skeleton_indexer(
    module: types.SimpleNamespace,
    inputs: SyntheticIndexerInputs,
    eps: float,
    cache: torch.Tensor,
    weight: torch.Tensor,
) -> Any:
    """SGLang's ``Indexer`` (its class, its methods) with the attributes its ``__init__`` gives a
    DeepSeek-V3.2 layer on CUDA (``dsa_indexer.py:285-420``), the projections given."""
    s, h, d, r = inputs.seq_len, inputs.n_heads, inputs.head_dim, inputs.rope_dim
    cls = module.indexer.Indexer
    ix = cls.__new__(cls)
    torch.nn.Module.__init__(ix)
    ix.n_heads, ix.head_dim, ix.rope_head_dim = h, d, r  # :301-303
    ix.block_size, ix.scale_fmt = _BLOCK, _SCALE_FMT  # :308-309 (deepseek_v2.py:2131-2132)
    ix.is_neox_style = True  # :307 (deepseek_v2.py:2118: not indexer_rope_interleave)
    ix.use_dsa_indexer_fusion = False  # :310-314: not is_neox_style
    ix.use_aiter_fused_fp8_writer = False  # :324-331: HIP only
    ix.alt_stream = None  # no dual stream outside capture mode; no CP (is_cp_active false)
    ix.softmax_scale = d**-0.5  # :414
    ix.wq_b = _Projection(inputs.q[:, 0].reshape(s, h * d).contiguous())
    ix.wk = _Projection(inputs.k[:, 0].contiguous())
    ix.weights_proj = _WeightsProj(weight)
    # :378-385: LayerNorm(head_dim, dtype=float32) (no eps: 1e-6); the checkpoint's BF16 weight
    # and bias load into its float32 parameters exactly.
    norm = module.layernorm.LayerNorm(d, eps=eps, dtype=torch.float32).to(inputs.q.device)
    norm.weight.data.copy_(inputs.k_norm.weight.detach().float())
    norm.bias.data.copy_(inputs.k_norm.bias.detach().float())
    ix.k_norm = norm
    # :386-394: get_rope_wrapper(rope_head_dim, rotary_dim=rope_head_dim, ...): head_size 64, so
    # forward_cuda's JIT kernel (use_fallback_kernel false); DeepSeek's YaRN subclass
    # (rope_variant.py:335) only builds another table, which is the one given here.
    with torch.device(inputs.q.device):
        rotary = module.base.RotaryEmbedding(r, r, s, 10000, True, torch.float32)
    rotary.cos_sin_cache = cache
    ix.rotary_emb = rotary
    return ix


@torch.no_grad()
def run_sglang_unfused(
    inputs: SyntheticIndexerInputs,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = SGLANG_K_NORM_EPS,
    *,
    hidden: torch.Tensor | None = None,
    weights_proj: torch.Tensor | None = None,
    root: str | os.PathLike | None = None,
) -> EngineKernelRun:
    """SGLang 0.5.23's unfused path on one sequence (batch 1, CUDA): its FP8 operands.

    Args:
        inputs: the BF16 projections (``q`` ``[S, 1, H, 128]``, ``k`` ``[S, 1, 128]``, raw ``w``
            ``[S, 1, H]``, the key LayerNorm's BF16 weight and bias), on the CUDA device.
        cos, sin: ``[>= S, rope_dim / 2]`` (float32 as SGLang's cache on CUDA): the rotary
            table, ``[cos..., sin...]`` per position (SGLang's ``cos_sin_cache``).
        eps: the key LayerNorm's epsilon (SGLang's default: the indexer passes none).
        hidden, weights_proj: ``x`` ``[S, hidden]`` BF16 and ``weights_proj.weight``
            ``[H, hidden]`` BF16 for the head-weight GEMM; default ``x = w`` and the identity,
            whose float32-output GEMM is ``fp32(w)`` exactly.

    Returns:
        :class:`EngineKernelRun`: E4M3 q ``[S, H, 128]``, E4M3 k ``[S, 128]`` and float32 k
        descales ``[S]`` read back from the page-64 index-K cache, float32 folded weights
        ``[S, H]``; ``k_float``: the BF16 key the store kernel read (after Hadamard), as float32.
    """
    module, source = load_sglang_unfused(root)
    s, h, d, r = inputs.seq_len, inputs.n_heads, inputs.head_dim, inputs.rope_dim
    device = inputs.q.device
    if d != 128 or r != 64:
        raise ValueError(
            f"SGLang's unfused path is DeepSeek-V3.2's: D = 128, rope 64 (got {d}, {r})"
        )
    cache = torch.cat((cos[:s], sin[:s]), dim=-1).float().contiguous()
    positions = torch.arange(s, dtype=torch.int64, device=device)
    if (hidden is None) != (weights_proj is None):
        raise ValueError("pass both hidden and weights_proj, or neither")
    if hidden is None:
        if inputs.w.dtype != torch.bfloat16:
            raise ValueError("a float32 w has no BF16 GEMM of its own: pass hidden, weights_proj")
        hidden = inputs.w[:, 0].contiguous()
        weights_proj = torch.eye(h, dtype=torch.bfloat16, device=device)
    assert weights_proj is not None
    ix = _skeleton_indexer(module, inputs, eps, cache, weights_proj)
    n_pages = -(-s // SGLANG_PAGE)
    buffer = torch.zeros(n_pages, (d + 4) * SGLANG_PAGE, dtype=torch.uint8, device=device)
    forward_batch = types.SimpleNamespace(out_cache_loc=positions.clone())
    q_lora = inputs.q[:, 0].reshape(s, h * d)  # wq_b's input: its stand-in returns q itself
    _ForwardContext.pool = _IndexKPool(buffer)
    try:
        with _calling(module.calls):
            # The store's JIT module first: can_use_dsa_fused_store would log a build error and
            # return False (dsa_fused_store_index_cache.py:55-65); this raises it instead.
            module.store._jit_dsa_fused_store_module(torch.bfloat16, torch.int64, SGLANG_PAGE)
            # dsa_indexer.py:2097-2125 (enable_dual_stream false, not in a CUDA graph), 2143, 2198.
            query, key, _ = ix._get_q_k_bf16(q_lora, hidden, positions, False,
                                             forward_batch=forward_batch)  # fmt: skip
            q_fp8, q_scale = module.act_quant.act_quant(query, ix.block_size, ix.scale_fmt)
            ix._store_index_k_cache(forward_batch=forward_batch, layer_id=0, key=key,
                                    act_quant=module.act_quant.act_quant)  # fmt: skip
            weights = ix._get_logits_head_gate(hidden, q_scale)
    finally:
        _ForwardContext.pool = None
    k8 = buffer[:, : SGLANG_PAGE * d].reshape(n_pages * SGLANG_PAGE, d)[:s]
    k_descale = buffer[:, SGLANG_PAGE * d :].contiguous().view(torch.float32).reshape(-1)[:s]
    ops = EngineOperands(
        q_fp8, k8.contiguous().view(torch.float8_e4m3fn), k_descale.contiguous(),
        weights.reshape(s, h),
    )  # fmt: skip
    return EngineKernelRun(ops, "sglang", f"sglang-unfused: {source}", key.float())
