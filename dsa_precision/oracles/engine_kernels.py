"""The engines' own indexer kernels as oracles, loaded unmodified from an ignored folder.

vLLM 0.33.0's DeepSeek-V3.2 / GLM-5 indexer preparation (``vllm/models/deepseek_v32/common/
kernels.py``: ``fused_norm_rope`` for the key LayerNorm + RoPE + UE8M0 quantization into the K
cache, ``fused_q`` for the query RoPE + quantization + head-weight fold) and LMDeploy 0.18.0's
(``lmdeploy/pytorch/kernels/cuda/dsa_indexer_preprocess.py``, with the ``fast_round_scale`` of
``blocked_gemm_fp8.py`` beside it) are Triton. This module runs those files as their wheels ship
them: only the few engine imports they make (``vllm.platforms``, ``vllm.triton_utils``, ...,
``lmdeploy.utils``) are replaced, for the duration of the import, by stand-ins stating Hopper's
answers (E4M3 is ``float8_e4m3fn``, no MX scales, no Blackwell CuTe DSL kernel). The code of the
kernels is never copied or edited: nothing of it is in this repository.

The folder is :data:`ENV_VAR` (``DSA_ENGINE_KERNELS``): one or more roots (``os.pathsep``
separated) holding the wheels' relative paths; ``docs/gpu-validation.md`` has the recipe. Every
oracle reports the SHA-256 of the file it ran, so a result names the engine release it checked.

Entry points build the engine's FP8 operands from the same BF16 projections as the training side
(:class:`~dsa_precision.oracles.synthetic.SyntheticIndexerInputs`) in the layout of
:class:`~dsa_precision.oracles.engine_model.EngineOperands`; :func:`operand_diff` counts the bytes that
differ. Importing this module needs neither vLLM nor LMDeploy, nor Triton until an oracle runs.

The engines' RoPE tables come from their own rotary code the same way (:func:`engine_rope`):
vLLM 0.33's ``RotaryEmbedding`` / ``DeepseekScalingRotaryEmbedding``
(``vllm/model_executor/layers/rotary_embedding/{common,base,deepseek_scaling_rope}.py``), built
under ``with torch.device(device)`` as vLLM's model loader builds them, and LMDeploy 0.18's
(``lmdeploy/pytorch/nn/rotary_embedding.py`` ``build_rotary_params``, the default backend's
``_build_rotary_embedding`` and forward), built with no device as LMDeploy builds its model;
:func:`engine_kernel_operands` takes them instead of the tables of the inputs' angles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..config import IndexerPrecisionConfig
from ..engines import EngineProfile
from ..fused_path import Impl
from ..rope import RopeSpec
from .engine_model import EngineOperands, engine_scores, engine_select
from .synthetic import SyntheticIndexerInputs
from .training import IndexerFields, training_operands

__all__ = [
    "ENGINE_FILES",
    "ENV_VAR",
    "KNOWN_SHA256",
    "ORACLE_ENGINES",
    "ROPE_ORACLES",
    "EngineKernelRun",
    "EngineRope",
    "engine_kernel_operands",
    "engine_layer_picks",
    "engine_rope",
    "kernel_files",
    "load_module",
    "missing_reason",
    "operand_diff",
    "oracle_for",
    "package_operands",
]

ENV_VAR = "DSA_ENGINE_KERNELS"

# The files each oracle runs, relative to a root of ENV_VAR (the first one is the entry module).
_VLLM_ROPE = "vllm/model_executor/layers/rotary_embedding"
_LMDEPLOY_ROPE = "lmdeploy/pytorch"
ENGINE_FILES: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm/models/deepseek_v32/common/kernels.py",),
    "lmdeploy": (
        "lmdeploy/pytorch/kernels/cuda/dsa_indexer_preprocess.py",
        "lmdeploy/pytorch/kernels/cuda/blocked_gemm_fp8.py",
    ),
    # The engines' RoPE table construction (engine_rope).
    "vllm-rope": (
        f"{_VLLM_ROPE}/common.py",
        f"{_VLLM_ROPE}/base.py",
        f"{_VLLM_ROPE}/deepseek_scaling_rope.py",
    ),
    "lmdeploy-rope": (
        f"{_LMDEPLOY_ROPE}/backends/rotary_embedding.py",
        f"{_LMDEPLOY_ROPE}/backends/default/rotary_embedding.py",
        f"{_LMDEPLOY_ROPE}/nn/rotary_embedding.py",
    ),
}

# SHA-256 of the files as the wheels vllm-0.33.0 and lmdeploy-0.18.0 ship them.
KNOWN_SHA256: dict[str, str] = {
    "23be4ed95ae476fcb4193c4e253c19fdf4b5ae951c50fedf6a3299f4c25ba25a": "vllm 0.33.0",
    "d69da20cc7fabc39c3c2a63fe63d1d6fb7e133010dacde3dc03fe607af80b258": "lmdeploy 0.18.0",
    "4c95787790c4554f903078b74805d03ca540bcce618bc73822b996c819e564ba": "lmdeploy 0.18.0",
    "af4825138c1d8ee3823bfad04dadd91f6657818f867756c676faeb9d14d64f02": "vllm 0.33.0",
    "c81804498f08f072356a26b41967f211475df2694dabf5da9f488c074d1fdef5": "vllm 0.33.0",
    "5c22b73a8ca290b97ee5546e38d652a4a1276ab017c7d7b5ef89e7cc9c1ab76a": "vllm 0.33.0",
    "ab8efa0b54b081c9a8f398c0102136f70e0bc41196c6264f8b1996955b57ac64": "lmdeploy 0.18.0",
    "55b6799cff70465514d15be3d38e6c5c90dcb0e44b512ab4fb8168dfa9e05b07": "lmdeploy 0.18.0",
    "a4cde2277745f7af71fd6710993d7180adcb18ab82b4576415696b04b8c5ead6": "lmdeploy 0.18.0",
}

# Engine profile -> the engine whose own rotary code builds its RoPE tables, and whether vLLM's
# custom ops are on (an eager run: DeepseekScalingRotaryEmbedding then keeps its float32 cache
# for flashinfer; a compiled run casts it to the model dtype).
ROPE_ORACLES: dict[str, tuple[str, bool]] = {
    "vllm": ("vllm-rope", False),
    "vllm-eager": ("vllm-rope", True),
    "lmdeploy": ("lmdeploy-rope", False),
}

# Engine profile -> the engine whose kernels serve it. Profiles absent here have no kernel that
# runs on this setup (vllm-exact is no engine's path; vllm-legacy's kernels are vLLM 0.26-0.28's,
# CUDA: its key quantization has its own oracle, .legacy_kernel; SGLang's are JIT CUDA).
ORACLE_ENGINES: dict[str, str] = {"vllm": "vllm", "vllm-eager": "vllm", "lmdeploy": "lmdeploy"}


def _roots(root: str | os.PathLike | None = None) -> list[Path]:
    value = os.fspath(root) if root is not None else os.environ.get(ENV_VAR, "")
    return [Path(p) for p in value.split(os.pathsep) if p]


def kernel_files(engine: str, root: str | os.PathLike | None = None) -> tuple[Path, ...] | None:
    """The engine's kernel files under the first root holding all of them, or ``None``."""
    if engine not in ENGINE_FILES:
        raise ValueError(
            f"engine={engine!r} has no kernel oracle; use one of {sorted(ENGINE_FILES)}."
        )
    for r in _roots(root):
        paths = tuple(r / f for f in ENGINE_FILES[engine])
        if all(p.is_file() for p in paths):
            return paths
    return None


def missing_reason(engine: str, root: str | os.PathLike | None = None) -> str | None:
    """Why the engine's kernels (or, for ``"vllm-rope"`` / ``"lmdeploy-rope"``, its rotary
    code) cannot run here, or ``None`` when they can."""
    if kernel_files(engine, root) is None:
        where = os.fspath(root) if root is not None else os.environ.get(ENV_VAR)
        if not where:
            return f"{ENV_VAR} is not set (docs/gpu-validation.md: the engine-kernel recipe)"
        return f"{where} holds no {' + '.join(ENGINE_FILES[engine])}"
    if not engine.endswith("-rope") and importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return None


def oracle_for(profile: EngineProfile) -> str | None:
    """The engine whose own kernels build ``profile``'s operands, or ``None`` if none does."""
    return ORACLE_ENGINES.get(profile.name)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def _scoped_modules(stubs: Mapping[str, types.ModuleType]) -> Iterator[None]:
    """``sys.modules`` with ``stubs`` in place for the duration; everything restored after."""
    saved = {name: sys.modules.get(name) for name in stubs}
    added_before = set(sys.modules)
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name in set(sys.modules) - added_before:
            if name.split(".")[0] in {n.split(".")[0] for n in stubs}:
                del sys.modules[name]
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def load_module(
    path: Path, name: str, stubs: Mapping[str, types.ModuleType] | None = None
) -> types.ModuleType:
    """Execute the file ``path`` as module ``name`` with ``stubs`` importable meanwhile.

    The module keeps its own globals (its kernels see the stand-ins they imported); neither it nor
    the stand-ins stay in ``sys.modules``. ``name`` may be dotted: its parents must be among ``stubs``
    (packages, so that the file's relative imports resolve against them).
    """
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    with _scoped_modules(dict(stubs or {})):
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        finally:
            sys.modules.pop(name, None)
    return module


def _package(name: str, path: Path | None = None, **attrs: object) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [os.fspath(path)] if path is not None else []
    module.__dict__.update(attrs)
    return module


class _HopperPlatform:
    """What vLLM's ``current_platform`` answers on an H200 for the indexer kernels.

    ``is_cuda`` is ``False`` only to keep ``fused_q`` from importing its CuTe DSL kernel, which
    vLLM runs on compute capability 10.0 alone (``is_fused_q_cutedsl_supported``): on Hopper it
    takes the Triton kernel either way. Programmatic dependent launch (``is_arch_support_pdl``)
    only orders kernel launches; it is off so that any Triton release can launch the kernels.
    """

    @staticmethod
    def fp8_dtype() -> torch.dtype:
        return torch.float8_e4m3fn

    @staticmethod
    def is_cuda() -> bool:
        return False

    @staticmethod
    def is_arch_support_pdl() -> bool:
        return False


def _vllm_stubs() -> dict[str, types.ModuleType]:
    import triton
    import triton.language as tl

    @triton.jit
    def pack_ue8m0_x4(scale):  # only traced for SM100's MX scales, never on Hopper
        tl.static_assert(False, "MX scales (SM100) are not part of the Hopper oracle")
        return scale

    return {
        "vllm": _package("vllm"),
        "vllm.platforms": _package("vllm.platforms", current_platform=_HopperPlatform()),
        "vllm.triton_utils": _package("vllm.triton_utils", tl=tl, triton=triton),
        "vllm.utils": _package("vllm.utils"),
        "vllm.utils.deep_gemm": _package(
            "vllm.utils.deep_gemm", mqa_logits_use_mx_scales=lambda: False
        ),
        "vllm.v1": _package("vllm.v1"),
        "vllm.v1.attention": _package("vllm.v1.attention"),
        "vllm.v1.attention.ops": _package("vllm.v1.attention.ops"),
        "vllm.v1.attention.ops.common": _package(
            "vllm.v1.attention.ops.common", pack_ue8m0_x4=pack_ue8m0_x4
        ),
        "vllm.v1.kv_cache_interface": _package(
            "vllm.v1.kv_cache_interface", is_quantized_kv_cache=lambda dtype: dtype != "auto"
        ),
    }


def _lmdeploy_stubs(cuda_dir: Path) -> dict[str, types.ModuleType]:
    pkg = "lmdeploy.pytorch.kernels.cuda"
    return {
        "lmdeploy": _package("lmdeploy"),
        "lmdeploy.utils": _package("lmdeploy.utils", get_logger=logging.getLogger),
        "lmdeploy.pytorch": _package("lmdeploy.pytorch"),
        "lmdeploy.pytorch.kernels": _package("lmdeploy.pytorch.kernels"),
        # The real folder: ``from .blocked_gemm_fp8 import fast_round_scale`` loads that file.
        pkg: _package(pkg, cuda_dir),
        f"{pkg}.utils": _package(
            f"{pkg}.utils", get_device_props=lambda *a, **k: {}, supports_pdl=lambda *a, **k: False
        ),
    }


_LOADED: dict[tuple[str, tuple[Path, ...]], types.ModuleType] = {}


def load_engine_kernels(
    engine: str, root: str | os.PathLike | None = None
) -> tuple[types.ModuleType, str]:
    """The entry module of ``engine``'s kernels, loaded unmodified (cached per engine and files),
    and the release it is (its SHA-256 looked up); ``RuntimeError`` with the reason when the
    files are missing."""
    reason = missing_reason(engine, root)
    if reason is not None:
        raise RuntimeError(f"the {engine} kernel oracle cannot run: {reason}.")
    files = kernel_files(engine, root)
    assert files is not None
    key = (engine, files)
    if key not in _LOADED:
        if engine == "vllm":
            module = load_module(files[0], "_dsa_oracle_vllm_kernels", _vllm_stubs())
        else:
            pkg = "lmdeploy.pytorch.kernels.cuda"
            module = load_module(
                files[0], f"{pkg}.dsa_indexer_preprocess", _lmdeploy_stubs(files[0].parent)
            )
        _LOADED[key] = module
    digest = _sha256(files[0])
    return _LOADED[key], f"{KNOWN_SHA256.get(digest, 'unknown release')} (sha256 {digest[:12]})"


# -------------------------------------------------------------------------- the engines' RoPE


@dataclasses.dataclass(frozen=True)
class EngineRope:
    """The RoPE tables an engine's own rotary code built.

    Attributes:
        cos, sin: ``[positions, rope_dim / 2]`` in the engine's cache dtype, row ``p`` for
            position ``p`` (vLLM's ``cos_sin_cache`` halves; LMDeploy's per-token tables, whose
            two halves are equal).
        source: the release and file hashes that ran.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    source: str


class _VllmSwitches:
    """What vLLM's ``CustomOp.enabled()`` and ``has_flashinfer()`` answer while a rotary module
    is built: both on in an eager run (custom ops on, flashinfer installed), off when compiled."""

    eager = False


class _VllmCustomOp(torch.nn.Module):
    """vLLM's ``CustomOp`` as far as the rotary modules use it: a registry decorator and
    ``enabled()``."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__()

    @classmethod
    def register(cls, name: str) -> Callable[[type], type]:
        return lambda op: op  # the class unchanged

    def enabled(self) -> bool:
        return _VllmSwitches.eager


class _RopePlatform:
    """vLLM's ``current_platform`` for the rotary modules: CUDA (Hopper); ``is_cpu`` is false so
    ``ApplyRotaryEmb`` only tries (and fails) to import flash-attn's Triton rotary."""

    @staticmethod
    def is_cuda() -> bool:
        return True

    @staticmethod
    def is_cpu() -> bool:
        return False


def _vllm_rope_stubs(folder: Path) -> dict[str, types.ModuleType]:
    rope = "vllm.model_executor.layers.rotary_embedding"
    return {
        "vllm": _package("vllm"),
        "vllm._aiter_ops": _package(
            "vllm._aiter_ops",
            rocm_aiter_ops=types.SimpleNamespace(is_triton_rotary_embed_enabled=lambda: False),
        ),
        "vllm.logger": _package("vllm.logger", init_logger=logging.getLogger),
        "vllm.model_executor": _package("vllm.model_executor"),
        "vllm.model_executor.custom_op": _package(
            "vllm.model_executor.custom_op", CustomOp=_VllmCustomOp
        ),
        "vllm.model_executor.layers": _package("vllm.model_executor.layers"),
        # The real folder, never its __init__.py: ``from .base import ...`` finds the files.
        rope: _package(rope, folder),
        "vllm.platforms": _package("vllm.platforms", current_platform=_RopePlatform()),
        "vllm.utils": _package("vllm.utils"),
        "vllm.utils.torch_utils": _package(
            "vllm.utils.torch_utils", direct_register_custom_op=lambda **kwargs: None
        ),
        "vllm.utils.flashinfer": _package(
            "vllm.utils.flashinfer", has_flashinfer=lambda: _VllmSwitches.eager
        ),
    }


class _LmdeployBuildSpec[T]:
    """``lmdeploy.pytorch.backends.base.BuildSpec``: a typed marker base."""


def _lmdeploy_rope_stubs(root: Path) -> dict[str, types.ModuleType]:
    pkg = "lmdeploy.pytorch"
    backends = root / "lmdeploy/pytorch/backends"
    return {
        "transformers": _package("transformers", PretrainedConfig=object),
        "lmdeploy": _package("lmdeploy"),
        pkg: _package(pkg, root / "lmdeploy/pytorch"),
        f"{pkg}.backends": _package(f"{pkg}.backends", backends, get_backend=None),
        f"{pkg}.backends.base": _package(f"{pkg}.backends.base", BuildSpec=_LmdeployBuildSpec),
        f"{pkg}.backends.apply_rotary_emb": _package(
            f"{pkg}.backends.apply_rotary_emb", ApplyRotaryEmbBuildSpec=object
        ),
        f"{pkg}.backends.default": _package(f"{pkg}.backends.default", backends / "default"),
        f"{pkg}.models": _package(f"{pkg}.models"),
        f"{pkg}.models.patch": _package(
            f"{pkg}.models.patch",
            get_build_model_context=lambda: types.SimpleNamespace(enable_deterministic=False),
        ),
    }


_ROPE_LOADED: dict[tuple[str, tuple[Path, ...]], dict[str, types.ModuleType]] = {}


def _load_rope_code(engine: str, root: str | os.PathLike | None) -> tuple[dict, str]:
    """The engine's rotary modules (by file stem), loaded unmodified once, and their source."""
    reason = missing_reason(engine, root)
    if reason is not None:
        raise RuntimeError(f"the {engine} oracle cannot run: {reason}.")
    files = kernel_files(engine, root)
    assert files is not None
    key = (engine, files)
    if key not in _ROPE_LOADED:
        loaded: dict[str, types.ModuleType] = {}
        if engine == "vllm-rope":
            stubs = _vllm_rope_stubs(files[0].parent)
            rope = "vllm.model_executor.layers.rotary_embedding"
            for path in files:  # common, then base (imports .common), then the YaRN class
                name = f"{rope}.{path.stem}"
                loaded[path.stem] = stubs[name] = load_module(path, name, stubs)
        else:
            root_dir = files[0].parents[3]
            stubs = _lmdeploy_rope_stubs(root_dir)
            names = (
                "lmdeploy.pytorch.backends.rotary_embedding",
                "lmdeploy.pytorch.backends.default.rotary_embedding",
                "lmdeploy.pytorch.nn.rotary_embedding",
            )
            for label, name, path in zip(("spec", "default", "nn"), names, files, strict=True):
                loaded[label] = stubs[name] = load_module(path, name, stubs)
        _ROPE_LOADED[key] = loaded
    digests = [_sha256(p) for p in files]
    releases = sorted({KNOWN_SHA256.get(d, "unknown release") for d in digests})
    return _ROPE_LOADED[key], f"{', '.join(releases)} (sha256 {' '.join(d[:12] for d in digests)})"


def engine_rope(
    profile: EngineProfile,
    spec: RopeSpec,
    n_positions: int,
    *,
    device: torch.device | str,
    model_dtype: torch.dtype = torch.bfloat16,
    max_position_embeddings: int | None = None,
    root: str | os.PathLike | None = None,
) -> EngineRope:
    """The RoPE tables of positions ``0 .. n_positions - 1`` as ``profile``'s engine builds them,
    by its own rotary code (:data:`ROPE_ORACLES`), unmodified.

    vLLM: ``RotaryEmbedding`` (plain) or ``DeepseekScalingRotaryEmbedding`` (YaRN, what vLLM's
    DeepSeek-V3.2 / GLM-5 attention builds for a ``yarn`` checkpoint), constructed under ``with
    torch.device(device)`` as vLLM's model loader constructs the model, its ``cos_sin_cache`` in
    ``model_dtype`` (float32 for an eager YaRN run: flashinfer's); ``max_position_embeddings``
    is the plain cache's length (default ``n_positions``; YaRN's is vLLM's own,
    ``original_max_position_embeddings * factor``). LMDeploy: ``build_rotary_params`` of the
    checkpoint's ``rope_scaling`` and the default backend's rotary embedding, built with no
    device (LMDeploy builds its model so: ``inv_freq`` on the CPU) and called on ``device``
    with position ids ``[1, n]`` (its ``torch.compile``'d table function; LMDeploy falls back to
    eager itself when compiling fails), in ``model_dtype``.
    """
    if profile.name not in ROPE_ORACLES:
        raise ValueError(
            f"engine profile {profile.name!r} has no RoPE oracle here; the profiles with one: "
            f"{sorted(ROPE_ORACLES)}."
        )
    engine, eager = ROPE_ORACLES[profile.name]
    modules, source = _load_rope_code(engine, root)
    r, y = spec.rope_dim, spec.yarn
    device = torch.device(device)
    if engine == "vllm-rope":
        _VllmSwitches.eager = eager
        try:
            with torch.device(device):
                if y is None:
                    rotary = modules["base"].RotaryEmbedding(
                        r, r, max_position_embeddings or n_positions, spec.base, True, model_dtype
                    )
                else:
                    rotary = modules["deepseek_scaling_rope"].DeepseekScalingRotaryEmbedding(
                        r, r, y.original_max_position_embeddings, spec.base, True,
                        y.scaling_factor, model_dtype, beta_fast=y.beta_fast,
                        beta_slow=y.beta_slow, mscale=y.mscale, mscale_all_dim=y.mscale_all_dim,
                    )  # fmt: skip
        finally:
            _VllmSwitches.eager = False
        cache = rotary.cos_sin_cache
        if cache.shape[0] < n_positions:
            raise ValueError(
                f"vLLM's cache holds {cache.shape[0]} positions, fewer than n_positions="
                f"{n_positions}; pass max_position_embeddings >= {n_positions}."
            )
        cos, sin = cache[:n_positions].chunk(2, dim=-1)
        return EngineRope(cos.contiguous(), sin.contiguous(), source)
    spec_mod, default, nn_mod = modules["spec"], modules["default"], modules["nn"]
    rope_scaling = None
    if y is not None:
        rope_scaling = dict(
            rope_type="yarn", factor=y.scaling_factor,
            original_max_position_embeddings=y.original_max_position_embeddings,
            beta_fast=y.beta_fast, beta_slow=y.beta_slow, mscale=y.mscale,
            mscale_all_dim=y.mscale_all_dim,
        )  # fmt: skip
    params = dict(
        emb_type=spec_mod.RopeType.LinearScaling, dim=r,
        max_position_embeddings=max_position_embeddings or n_positions, base=spec.base,
    )  # fmt: skip
    params.update(nn_mod.build_rotary_params(types.SimpleNamespace(rope_scaling=rope_scaling)))
    # lmdeploy.pytorch.nn.rotary_embedding.build_rotary_embedding's spec (no partial rotary,
    # fope or mrope here); the CUDA backend builds it by the default backend's function.
    build = spec_mod.RotaryEmbeddingBuildSpec(**params)
    rotary = default._build_rotary_embedding(build)
    x = torch.empty(0, dtype=model_dtype, device=device)
    positions = torch.arange(n_positions, device=device)[None]
    cos, sin = rotary.forward(x, positions)
    return EngineRope(cos[0, :, : r // 2].contiguous(), sin[0, :, : r // 2].contiguous(), source)


@dataclasses.dataclass(frozen=True)
class EngineKernelRun:
    """The operands one engine kernel built, and what ran."""

    operands: EngineOperands
    engine: str  # "vllm" | "lmdeploy"
    source: str  # release and file hash, e.g. "vllm 0.33.0 (sha256 23be4ed95ae4)"
    # float32 keys before quantization, when the kernel writes them (vLLM's index_k_out).
    k_float: torch.Tensor | None = None


def _cos_sin(inputs: SyntheticIndexerInputs, dtype: torch.dtype, mscale: float = 1.0):
    """float32 cos / sin of the first half of the angles (``[S, rope_dim / 2]``), in ``dtype``."""
    angles = inputs.freqs[:, 0, 0, : inputs.rope_dim // 2].float()
    return (torch.cos(angles) * mscale).to(dtype), (torch.sin(angles) * mscale).to(dtype)


def engine_kernel_operands(
    inputs: SyntheticIndexerInputs,
    profile: EngineProfile,
    *,
    interleaved: bool,
    root: str | os.PathLike | None = None,
    rope: EngineRope | None = None,
) -> EngineKernelRun:
    """The FP8 operands the engine kernel of ``profile`` builds from ``inputs`` (batch 1).

    ``rope``: the engine's own RoPE tables (:func:`engine_rope`, positions ``0 .. S - 1`` at
    least); default the tables of ``inputs.freqs`` in the profile's cache dtype. ``profile``
    picks the engine (:data:`ORACLE_ENGINES`) and its cos/sin cache dtype; the key
    LayerNorm takes the model's weight and bias (vLLM holds them in float32, exact) and the
    engine's own epsilon (``profile.k_norm_eps``: vLLM and LMDeploy hard-code 1e-6, whatever the
    model says). Runs where the tensors are (CUDA; the CPU under ``TRITON_INTERPRET=1``).
    """
    engine = oracle_for(profile)
    if engine is None:
        raise ValueError(
            f"engine profile {profile.name!r} has no kernel oracle here; the profiles with one: "
            f"{sorted(ORACLE_ENGINES)}."
        )
    module, source = load_engine_kernels(engine, root)
    run = _run_vllm if engine == "vllm" else _run_lmdeploy
    eps = profile.k_norm_eps if profile.k_norm_eps is not None else inputs.k_norm.eps
    if rope is None:
        cos, sin = _cos_sin(inputs, profile.cos_sin_dtype)
    else:
        if rope.cos.shape[0] < inputs.seq_len or rope.cos.device != inputs.q.device:
            raise ValueError(
                f"rope holds {rope.cos.shape[0]} positions on {rope.cos.device}; the kernels "
                f"read {inputs.seq_len} on {inputs.q.device}."
            )
        cos, sin = rope.cos[: inputs.seq_len], rope.sin[: inputs.seq_len]
    return run(module, source, inputs, interleaved, eps, cos, sin)


def _run_vllm(module, source, inputs, interleaved, eps, cos, sin) -> EngineKernelRun:
    s, h, d = inputs.seq_len, inputs.n_heads, inputs.head_dim
    device = inputs.q.device
    cache = torch.cat((cos, sin), dim=-1).contiguous()  # vLLM's cos_sin_cache [max_pos, rope_dim]
    positions = torch.arange(s, dtype=torch.int64, device=device)
    # The index K and the head weights are one GEMM's output in vLLM (wk_weights_proj): a BF16
    # [S, D + H] buffer, the weights a strided slice of it.
    kw = torch.cat((inputs.k[:, 0], inputs.w[:, 0]), dim=-1)
    index_k, index_w = kw[:, :d], kw[:, d:]
    norm = inputs.k_norm
    ln_w = norm.weight.detach().float().contiguous()
    ln_b = norm.bias.detach().float().contiguous()
    # The MLA half of the fused kernels runs on small stand-ins (its outputs are not compared).
    mla = 16
    bf16 = dict(dtype=torch.bfloat16, device=device)
    q_c, kv_c = torch.zeros(s, mla, **bf16), torch.zeros(s, mla, **bf16)
    k_pe, ones = torch.zeros(s, 8, **bf16), torch.ones(mla, **bf16)
    mla_cache = torch.zeros(s, 8, dtype=torch.float32, device=device)
    block = 64
    n_blocks = -(-s // block)
    k_cache = torch.zeros(n_blocks, block, d + 4, dtype=torch.uint8, device=device)
    k_float = torch.empty(s, d, dtype=torch.float32, device=device)
    module.fused_norm_rope(
        positions, q_c, ones, 1e-6, kv_c, ones, 1e-6, k_pe, mla_cache,
        index_k, ln_w, ln_b, eps, cache,
        torch.zeros(s, 1, dtype=torch.int32, device=device),
        slot_mapping=positions, indexer_k_cache=k_cache,
        index_rope_interleave=interleaved, index_k_out=k_float,
    )  # fmt: skip
    flat = k_cache.view(n_blocks, block * (d + 4))
    k8 = flat[:, : block * d].reshape(n_blocks * block, d)[:s].view(torch.float8_e4m3fn)
    k_descale = flat[:, block * d :].contiguous().view(torch.float32).reshape(-1)[:s]
    q_pe = torch.zeros(s, 2, 8, **bf16)
    q8, w, _ = module.fused_q(
        positions, q_pe, mla_cache, inputs.q[:, 0].contiguous(), cache,
        torch.zeros(s, 2, mla, **bf16), torch.ones(1, dtype=torch.float32, device=device),
        index_w, d**-0.5, h**-0.5,
        index_rope_interleave=interleaved, quantize_mqa=False,
    )  # fmt: skip
    ops = EngineOperands(q8, k8.contiguous(), k_descale.contiguous(), w)
    return EngineKernelRun(ops, "vllm", source, k_float)


def _run_lmdeploy(module, source, inputs, interleaved, eps, cos, sin) -> EngineKernelRun:
    s, h, d = inputs.seq_len, inputs.n_heads, inputs.head_dim
    device = inputs.q.device
    # LMDeploy's tables are [tokens, rope_dim], the half repeated (its rotary embedding's
    # cat((freqs, freqs))): NeoX reads lane j, the interleaved layout lane j // 2.
    cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    norm = inputs.k_norm
    q8, q_scale = module.prepare_dsa_indexer_q(
        inputs.q[:, 0].contiguous(), inputs.w[:, 0].contiguous(), cos.contiguous(),
        sin.contiguous(), d**-0.5 * h**-0.5, torch.float8_e4m3fn, interleaved,
    )  # fmt: skip
    block = 64
    n_blocks = -(-s // block)
    k_cache = torch.zeros(n_blocks, block, d, dtype=torch.float8_e4m3fn, device=device)
    k_s_cache = torch.zeros(n_blocks, block, dtype=torch.float32, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    module.prepare_dsa_indexer_k_cache(
        inputs.k[:, 0].contiguous(), norm.weight.detach(), norm.bias.detach(),
        cos.contiguous(), sin.contiguous(), k_cache, k_s_cache,
        torch.tensor([0, s], **i32), torch.tensor([s], **i32),
        torch.arange(n_blocks, **i32)[None], s, eps, interleaved,
    )  # fmt: skip
    k8 = k_cache.reshape(-1, d)[:s].contiguous()
    ops = EngineOperands(q8, k8, k_s_cache.reshape(-1)[:s].contiguous(), q_scale)
    return EngineKernelRun(ops, "lmdeploy", source)


def package_operands(
    inputs: SyntheticIndexerInputs,
    profile: EngineProfile,
    *,
    interleaved: bool,
    impl: Impl = "auto",
) -> EngineOperands:
    """The package's ``rope_fp32+fp8`` operands of ``inputs`` under ``profile`` (batch 1), as the
    Megatron integration builds them, in the layout of the engines' (what :func:`operand_diff`
    compares with :func:`engine_kernel_operands`)."""
    config = IndexerPrecisionConfig(rope_fp32=True, scoring_precision="fp8", engine=profile)
    ops = training_operands(inputs, config, IndexerFields(rope_interleaved=interleaved), impl=impl)
    assert ops.k_descale is not None  # FP8 operands
    return EngineOperands(ops.q[0], ops.k[0], ops.k_descale[0], ops.weights[0])


def operand_diff(a: EngineOperands, b: EngineOperands) -> dict[str, int]:
    """How many E4M3 bytes of q and k, k descales and folded weights differ (bitwise; a NaN
    equals the same NaN bits), with the totals."""

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8 if t.element_size() == 1 else torch.int32)

    out = {}
    for name in ("q", "k", "k_descale", "weights"):
        x, y = getattr(a, name), getattr(b, name)
        if x.shape != y.shape or x.dtype != y.dtype:
            raise ValueError(
                f"operand {name}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}."
            )
        out[f"{name}_differ"] = int((bits(x) != bits(y)).sum())
        out[f"{name}_total"] = x.numel()
    return out


def engine_layer_picks(
    indexer: Any,  # a dsa_precision.megatron.PrecisionDSAIndexer (no Megatron import here)
    x: torch.Tensor,
    qr: torch.Tensor,
    topk: int,
    *,
    scores: str = "deepgemm",
    max_position_embeddings: int | None = None,
    root: str | os.PathLike | None = None,
) -> tuple[torch.Tensor, str]:
    """What the engine of the indexer's profile picks for one DSA layer's rows, from that layer's
    own projections: ``(B * S, k)`` int32 sequence-relative keys, batch-major, ascending, ``-1``
    padded (``k = min(topk, S)``), and the engine code's source (release and hashes).

    ``indexer``: a ``PrecisionDSAIndexer`` with ``rope_fp32`` (its profile has a kernel and a
    RoPE oracle: ``vllm``, ``vllm-eager``, ``lmdeploy``); ``x`` ``[S, B, hidden]`` and ``qr``
    ``[S, B, q_lora_rank]``, the DSA attention's inputs (BSHD). Per sequence, the layer's BF16
    projections (:meth:`PrecisionDSAIndexer.projections`) go to the engine's own code,
    unmodified from ``DSA_ENGINE_KERNELS``: its RoPE table construction (:func:`engine_rope`)
    and its preprocess kernels (:func:`engine_kernel_operands`); the FP8 operands are scored by
    ``scores`` (``"deepgemm"``: DeepGEMM's ``fp8_mqa_logits``, the engines' scorer; ``"exact"``:
    float64) and selected by :func:`~.engine_model.engine_select` (exact, ties to the lower
    key: the package's model of the engines' top-k step, not their kernel).
    ``max_position_embeddings``: the plain-RoPE cache length the engine builds (default ``S``;
    on CUDA each row depends on its position only).
    """
    pre = indexer.preprocess()
    if not pre.rope_fp32 or pre.rope_tables is None:
        raise ValueError(
            "engine_layer_picks: the indexer has no engine RoPE tables (dsa_indexer_rope_fp32 is "
            "off); build the layer with dsa_indexer_rope_fp32=True and the engine's profile."
        )
    profile = pre.engine
    s, batch = x.shape[0], x.shape[1]
    rope = engine_rope(
        profile, pre.rope_tables.spec, s, device=x.device,
        max_position_embeddings=max(s, max_position_embeddings or s), root=root,
    )  # fmt: skip
    interleaved = bool(indexer.config.dsa_indexer_rope_interleaved)
    rows, source = [], rope.source
    with torch.no_grad():
        for b in range(batch):
            p = indexer.projections(x[:, b : b + 1], qr[:, b : b + 1], None)
            inputs = SyntheticIndexerInputs(p.q, p.k, p.w, indexer.k_norm, p.freqs)
            run = engine_kernel_operands(
                inputs, profile, interleaved=interleaved, rope=rope, root=root
            )
            source = f"{rope.source}; {run.source}"
            rows.append(engine_select(engine_scores(run.operands, kernel=scores), topk))
    return torch.cat(rows), source
