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
(:class:`~dsa_precision.cli.synthetic.SyntheticIndexerInputs`) in the layout of
:class:`~dsa_precision.cli.engine_model.EngineOperands`; :func:`operand_diff` counts the bytes that
differ. Importing this module needs neither vLLM nor LMDeploy, nor Triton until an oracle runs.

SGLang 0.5.23's fused indexer (``sglang/kernels/ops/attention/dsa/indexer_{k,q}.py``, the CUDA
sources ``deepseek_v32/indexer_k.cuh`` and ``deepseek_v4/main_norm_rope.cuh`` with the headers
they include) is JIT CUDA, built by SGLang's own build code less its cache (:mod:`.sglang_jit`);
its unfused path (DeepSeek-V3.2) runs from :mod:`.sglang_unfused`. :data:`JIT_ORACLE_ENGINES`
names the profiles they serve.

The engines' RoPE tables come from their own rotary code the same way (:func:`engine_rope`):
vLLM 0.33's ``RotaryEmbedding`` / ``DeepseekScalingRotaryEmbedding``
(``vllm/model_executor/layers/rotary_embedding/{common,base,deepseek_scaling_rope}.py``), built
under ``with torch.device(device)`` as vLLM's model loader builds them, and LMDeploy 0.18's
(``lmdeploy/pytorch/nn/rotary_embedding.py`` ``build_rotary_params``, the default backend's
``_build_rotary_embedding`` and forward), built with no device as LMDeploy builds its model;
:func:`engine_kernel_operands` takes them instead of the tables of the inputs' angles.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import logging
import os
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dsa_precision.cli.demo_operands import IndexerFields, training_operands
from dsa_precision.cli.engine_model import EngineOperands, engine_scores, engine_select
from dsa_precision.cli.synthetic import SyntheticIndexerInputs
from dsa_precision.config import IndexerPrecisionConfig
from dsa_precision.engines import EngineProfile
from dsa_precision.preprocess_kernel import Impl
from dsa_precision.rope import RopeSpec

from .loader import ENV_VAR, EngineKernelRun, load_module, package, roots, sha256
from .sglang_jit import (
    SGLANG_COMMON_HEADERS,
    SGLANG_JIT,
    SGLANG_JIT_DIR_VAR,
    SGLANG_JIT_PY,
    SGLANG_K_NORM_EPS,
    SGLANG_KERNELS,
    SGLANG_PAGE,
    SGLANG_SHARED_SHA256,
    SglangJit,
    sglang_jit_dir,
    sglang_stubs,
    sglang_toolchain_reason,
)
from .sglang_unfused import run_sglang_unfused, sglang_unfused_missing_reason

__all__ = [
    "ENGINE_FILES",
    "ENV_VAR",
    "JIT_ORACLE_ENGINES",
    "KNOWN_SHA256",
    "ORACLE_ENGINES",
    "PINNED_SHA256",
    "ROPE_ORACLES",
    "SGLANG_JIT_DIR_VAR",
    "SGLANG_K_NORM_EPS",
    "EngineKernelRun",
    "EngineRope",
    "engine_kernel_operands",
    "engine_layer_picks",
    "engine_layer_scores",
    "engine_rope",
    "engine_rotary",
    "kernel_files",
    "load_module",
    "missing_reason",
    "operand_diff",
    "oracle_for",
    "package_operands",
    "rope_code",
    "sglang_build",
    "sglang_jit_dir",
    "sglang_toolchain_reason",
]

# The files each oracle runs, relative to a root of ENV_VAR (the first one is the entry module).
_VLLM_ROPE = "vllm/model_executor/layers/rotary_embedding"
_LMDEPLOY_ROPE = "lmdeploy/pytorch"
_SGLANG_ROPE = "sglang/srt/layers/rotary_embedding"
_VLLM_ROPE_FILES = tuple(
    f"{_VLLM_ROPE}/{name}.py" for name in ("common", "base", "deepseek_scaling_rope")
)
# The fused kernels' headers (indexer_k.cuh, main_norm_rope.cuh: nvcc -M under SGLang's flags).
_SGLANG_HEADERS = tuple(
    sorted(
        (
            *SGLANG_COMMON_HEADERS,
            "deepseek_v4/fp4_utils.cuh",
            "deepseek_v4/fp8_utils.cuh",
            "deepseek_v4/kv_layout.cuh",
        )
    )
)
ENGINE_FILES: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm/models/deepseek_v32/common/kernels.py",),
    "lmdeploy": (
        "lmdeploy/pytorch/kernels/cuda/dsa_indexer_preprocess.py",
        "lmdeploy/pytorch/kernels/cuda/blocked_gemm_fp8.py",
    ),
    # vLLM 0.28.0's query kernel for vllm-legacy (.legacy_q; its key kernel is CUDA: .legacy_kernel).
    "vllm-legacy-q": ("vllm/model_executor/layers/sparse_attn_indexer.py",),
    # The engines' RoPE table construction (engine_rope).
    "vllm-rope": _VLLM_ROPE_FILES,
    # vLLM 0.28.0's (vllm-legacy): the same three files at that release (PINNED_SHA256).
    "vllm-legacy-rope": _VLLM_ROPE_FILES,
    "lmdeploy-rope": (
        f"{_LMDEPLOY_ROPE}/backends/rotary_embedding.py",
        f"{_LMDEPLOY_ROPE}/backends/default/rotary_embedding.py",
        f"{_LMDEPLOY_ROPE}/nn/rotary_embedding.py",
    ),
    # SGLang 0.5.23's (in import order: base imports utils, yarn base, rope_variant all three).
    "sglang-rope": tuple(
        f"{_SGLANG_ROPE}/{name}.py" for name in ("utils", "base", "yarn", "rope_variant")
    ),
    # SGLang 0.5.23's fused DSA indexer (GLM-5, interleaved RoPE): the two Python wrappers that
    # JIT-compile and call the CUDA kernels, the pure-Python half of SGLang's JIT build (how it
    # composes the wrapper translation unit, its flags and its build.ninja), the two kernel
    # sources and every header they include (nvcc -M). The loader's build cache (compile/
    # cache.py) is not among them: the oracle keeps its own build folder (sglang_jit_dir).
    "sglang": (
        f"{SGLANG_KERNELS}/ops/attention/dsa/indexer_k.py",
        f"{SGLANG_KERNELS}/ops/attention/dsa/indexer_q.py",
        f"{SGLANG_KERNELS}/ops/attention/dsv4/utils.py",
        *(f"{SGLANG_JIT}/utils/{name}.py" for name in SGLANG_JIT_PY),
        f"{SGLANG_JIT}/csrc/deepseek_v32/indexer_k.cuh",
        f"{SGLANG_JIT}/csrc/deepseek_v4/main_norm_rope.cuh",
        *(f"{SGLANG_JIT}/include/sgl_kernel/{name}" for name in _SGLANG_HEADERS),
    ),
}

# SHA-256 of the files as the wheels vllm-0.33.0, lmdeploy-0.18.0 and sglang-0.5.23 ship them.
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
    # sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl: ENGINE_FILES["sglang"], in order, less
    # the files both SGLang oracles run (SGLANG_SHARED_SHA256, the last entry).
    "d421f877d20799ab5f00fadf550fa33a36fb02bfa62ebf8194700254222d6f8d": "sglang 0.5.23",
    "b5bf9d3384e6a0ff1e23d55653d4408663d900c277b6df46ec533f2135ee29dc": "sglang 0.5.23",
    "14c23af783cf8c301b9a125f689fb97447574778de7c433263b0a656e6e051f8": "sglang 0.5.23",
    "18b93a66c8d194a00c2c4010059839c9a1439d36292d834b62068e6e570987a5": "sglang 0.5.23",
    "c4804fc56cb17e3c15b8635f264ba4c7e22ec3334657855d263cb112716705a7": "sglang 0.5.23",
    "dfe6a3b56809e9a3a1e6f36985aca51d25b5455cbe491031429e34b0b64137e9": "sglang 0.5.23",
    "6b686494e4ee7ac6f12f972e1033837ff020d1629e833e06f57f304ed0c5f022": "sglang 0.5.23",
    "4c6a1f9636a0d23e751910dacabb80a88d1d59dea129b20a92fea8863d9f0bea": "sglang 0.5.23",
    # vllm-0.28.0-cp38-abi3-manylinux_2_28_x86_64.whl: ENGINE_FILES["vllm-legacy-q"].
    "22d1d98bd475b1dc22de85d0e414d0490860de50c8bbd26371175e5ea6411116": "vllm 0.28.0",
    # ENGINE_FILES["sglang-rope"] (yarn.py, rope_variant.py; utils.py and base.py are shared).
    "c67436ffa26f096bfb426e6d5561acd189073fc919aa2b152b5f6ae82ce1f361": "sglang 0.5.23",
    "262b371e4c420677f08238ef78687e0da1e2cfe837e3b4f95368067cab6289b6": "sglang 0.5.23",
    **SGLANG_SHARED_SHA256,
}

# The files of an engine whose paths another release shares (vLLM 0.28.0's rotary code beside
# 0.33.0's, in another root): kernel_files takes the first root whose files are these, by hash.
# base.py is the same file in both releases.
PINNED_SHA256: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm-legacy-rope": (
        "vllm 0.28.0",
        (
            "39bf5bb498ae45ca7a38269e85aa8b9b257a00c919e2d4d14a7ceb44ac7e9c98",
            "c81804498f08f072356a26b41967f211475df2694dabf5da9f488c074d1fdef5",
            "b6b72b77ac71e69bfefe7a9b1bcc0c1518679adc37eb5082685cc75450741c63",
        ),
    ),
}

# Engine profile -> the engine whose own rotary code builds its RoPE tables, and whether vLLM's
# custom ops are on (an eager run: DeepseekScalingRotaryEmbedding then keeps its float32 cache
# for flashinfer; a compiled run casts it to the model dtype).
ROPE_ORACLES: dict[str, tuple[str, bool]] = {
    "vllm": ("vllm-rope", False),
    "vllm-eager": ("vllm-rope", True),
    "vllm-legacy": ("vllm-legacy-rope", False),
    "lmdeploy": ("lmdeploy-rope", False),
    "sglang-fused": ("sglang-rope", False),
    "sglang-unfused": ("sglang-rope", False),
}

# Engine profile -> the engine whose kernels serve it. Profiles absent here have no kernel that
# runs on this setup (vllm-exact is no engine's path; vllm-legacy's kernels are vLLM 0.26-0.28's,
# CUDA: its key quantization has its own oracle, .legacy_kernel; SGLang's are JIT CUDA, below).
ORACLE_ENGINES: dict[str, str] = {"vllm": "vllm", "vllm-eager": "vllm", "lmdeploy": "lmdeploy"}
# Profiles whose engine kernels are JIT CUDA (SGLang's, compiled by nvcc through SGLang's own
# build code and loaded by apache-tvm-ffi): engine_kernel_operands runs them (on the H200 every
# byte equals sglang-fused's: docs/numerics.md, section 8.5). They are kept out of ORACLE_ENGINES
# (the inference side of the demo, the default of the conformance tools): building them needs
# nvcc and tvm-ffi at run time, which a Triton-only host lacks.
# sglang-unfused's path (DeepSeek-V3.2: six launches, FlashInfer's CuTe DSL LayerNorm among
# them, section 8.6) runs from SGLang's and FlashInfer's files by .sglang_unfused.
JIT_ORACLE_ENGINES: dict[str, str] = {"sglang-fused": "sglang", "sglang-unfused": "sglang-unfused"}


def kernel_files(engine: str, root: str | os.PathLike | None = None) -> tuple[Path, ...] | None:
    """The engine's kernel files under the first root holding all of them, or ``None``."""
    if engine not in ENGINE_FILES:
        raise ValueError(
            f"engine={engine!r} has no kernel oracle; use one of {sorted(ENGINE_FILES)}."
        )
    pinned = PINNED_SHA256[engine][1] if engine in PINNED_SHA256 else None
    for r in roots(root):
        paths = tuple(r / f for f in ENGINE_FILES[engine])
        if all(p.is_file() for p in paths) and (
            pinned is None or tuple(sha256(p) for p in paths) == pinned
        ):
            return paths
    return None


def missing_reason(engine: str, root: str | os.PathLike | None = None) -> str | None:
    """Why the engine's kernels (or, for the ``"*-rope"`` engines, its rotary code) cannot run
    here, or ``None`` when they can."""
    if engine == "sglang-unfused":  # two wheels' files and three toolchains: its own check
        return sglang_unfused_missing_reason(root)
    if kernel_files(engine, root) is None:
        where = os.fspath(root) if root is not None else os.environ.get(ENV_VAR)
        if not where:
            return f"{ENV_VAR} is not set (docs/gpu-validation.md: the engine-kernel recipe)"
        release = " at the pinned release (PINNED_SHA256)" if engine in PINNED_SHA256 else ""
        return f"{where} holds no {' + '.join(ENGINE_FILES[engine])}{release}"
    if engine == "sglang":
        return sglang_toolchain_reason()
    if not engine.endswith("-rope") and importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return None


def oracle_for(profile: EngineProfile) -> str | None:
    """The engine whose own kernels build ``profile``'s operands, or ``None`` if none does."""
    return ORACLE_ENGINES.get(profile.name)


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
        "vllm": package("vllm"),
        "vllm.platforms": package("vllm.platforms", current_platform=_HopperPlatform()),
        "vllm.triton_utils": package("vllm.triton_utils", tl=tl, triton=triton),
        "vllm.utils": package("vllm.utils"),
        "vllm.utils.deep_gemm": package(
            "vllm.utils.deep_gemm", mqa_logits_use_mx_scales=lambda: False
        ),
        "vllm.v1": package("vllm.v1"),
        "vllm.v1.attention": package("vllm.v1.attention"),
        "vllm.v1.attention.ops": package("vllm.v1.attention.ops"),
        "vllm.v1.attention.ops.common": package(
            "vllm.v1.attention.ops.common", pack_ue8m0_x4=pack_ue8m0_x4
        ),
        "vllm.v1.kv_cache_interface": package(
            "vllm.v1.kv_cache_interface", is_quantized_kv_cache=lambda dtype: dtype != "auto"
        ),
    }


def _lmdeploy_stubs(cuda_dir: Path) -> dict[str, types.ModuleType]:
    pkg = "lmdeploy.pytorch.kernels.cuda"
    return {
        "lmdeploy": package("lmdeploy"),
        "lmdeploy.utils": package("lmdeploy.utils", get_logger=logging.getLogger),
        "lmdeploy.pytorch": package("lmdeploy.pytorch"),
        "lmdeploy.pytorch.kernels": package("lmdeploy.pytorch.kernels"),
        # The real folder: ``from .blocked_gemm_fp8 import fast_round_scale`` loads that file.
        pkg: package(pkg, cuda_dir),
        f"{pkg}.utils": package(
            f"{pkg}.utils", get_device_props=lambda *a, **k: {}, supports_pdl=lambda *a, **k: False
        ),
    }


_LOADED: dict[tuple[str, tuple[Path, ...]], types.ModuleType] = {}


def load_engine_kernels(
    engine: str, root: str | os.PathLike | None = None, *, reason: str | None = ""
) -> tuple[types.ModuleType, str]:
    """The entry module of ``engine``'s kernels, loaded unmodified (cached per engine and files),
    and the release it is (its SHA-256 looked up); ``RuntimeError`` with the reason when the
    files are missing. ``reason``: why the kernels cannot run, when the caller checked it
    itself (``None``: they can; default: :func:`missing_reason`)."""
    if reason == "":
        reason = missing_reason(engine, root)
    if reason is not None:
        raise RuntimeError(f"the {engine} kernel oracle cannot run: {reason}.")
    files = kernel_files(engine, root)
    assert files is not None
    key = (engine, files)
    if key not in _LOADED:
        if engine == "vllm":
            module = load_module(files[0], "_dsa_oracle_vllm_kernels", _vllm_stubs())
        elif engine == "sglang":
            module = _load_sglang(files)
        else:
            pkg = "lmdeploy.pytorch.kernels.cuda"
            module = load_module(
                files[0], f"{pkg}.dsa_indexer_preprocess", _lmdeploy_stubs(files[0].parent)
            )
        _LOADED[key] = module
    return _LOADED[key], _release(engine, files)


def _release(engine: str, files: tuple[Path, ...]) -> str:
    """The release the files are (their SHA-256 in :data:`KNOWN_SHA256`): the entry file's for
    the Triton engines; for SGLang, whose every file is compiled or run, all of them, naming
    those that are not the wheel's."""
    if engine == "sglang":
        digests = [sha256(p) for p in files]
        releases = sorted({KNOWN_SHA256.get(d, "unknown release") for d in digests})
        pairs = zip(ENGINE_FILES[engine], digests, strict=True)
        unknown = [f for f, d in pairs if d not in KNOWN_SHA256]
        note = f"; not the wheel's: {' '.join(unknown)}" if unknown else ""
        return f"{', '.join(releases)} ({len(files)} files{note})"
    digest = sha256(files[0])
    return f"{KNOWN_SHA256.get(digest, 'unknown release')} (sha256 {digest[:12]})"


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
        "vllm": package("vllm"),
        "vllm._aiter_ops": package(
            "vllm._aiter_ops",
            rocm_aiter_ops=types.SimpleNamespace(is_triton_rotary_embed_enabled=lambda: False),
        ),
        "vllm.logger": package("vllm.logger", init_logger=logging.getLogger),
        "vllm.model_executor": package("vllm.model_executor"),
        "vllm.model_executor.custom_op": package(
            "vllm.model_executor.custom_op", CustomOp=_VllmCustomOp
        ),
        "vllm.model_executor.layers": package("vllm.model_executor.layers"),
        # The real folder, never its __init__.py: ``from .base import ...`` finds the files.
        rope: package(rope, folder),
        "vllm.platforms": package("vllm.platforms", current_platform=_RopePlatform()),
        "vllm.utils": package("vllm.utils"),
        "vllm.utils.torch_utils": package(
            "vllm.utils.torch_utils", direct_register_custom_op=lambda **kwargs: None
        ),
        "vllm.utils.flashinfer": package(
            "vllm.utils.flashinfer", has_flashinfer=lambda: _VllmSwitches.eager
        ),
    }


class _LmdeployBuildSpec[T]:
    """``lmdeploy.pytorch.backends.base.BuildSpec``: a typed marker base."""


def _lmdeploy_rope_stubs(root: Path) -> dict[str, types.ModuleType]:
    pkg = "lmdeploy.pytorch"
    backends = root / "lmdeploy/pytorch/backends"
    return {
        "transformers": package("transformers", PretrainedConfig=object),
        "lmdeploy": package("lmdeploy"),
        pkg: package(pkg, root / "lmdeploy/pytorch"),
        f"{pkg}.backends": package(f"{pkg}.backends", backends, get_backend=None),
        f"{pkg}.backends.base": package(f"{pkg}.backends.base", BuildSpec=_LmdeployBuildSpec),
        f"{pkg}.backends.apply_rotary_emb": package(
            f"{pkg}.backends.apply_rotary_emb", ApplyRotaryEmbBuildSpec=object
        ),
        f"{pkg}.backends.default": package(f"{pkg}.backends.default", backends / "default"),
        f"{pkg}.models": package(f"{pkg}.models"),
        f"{pkg}.models.patch": package(
            f"{pkg}.models.patch",
            get_build_model_context=lambda: types.SimpleNamespace(enable_deterministic=False),
        ),
    }


class _SglangRopeSwitches:
    """The device SGLang's ``get_device()`` names while a rotary module is built (its model
    loader's ``target_device``; DeepSeek's YaRN class builds its tables there explicitly)."""

    device = "cuda"


class _SglangRopeEnvs:
    """``sglang.srt.environ.envs`` for the rotary modules: ``SGLANG_ROPE_CACHE_FP32`` off (on
    CUDA the cache stays float32 regardless), ``SGLANG_ROPE_CACHE_ALIGN`` its default."""

    SGLANG_ROPE_CACHE_FP32 = types.SimpleNamespace(get=lambda: False)
    SGLANG_ROPE_CACHE_ALIGN = types.SimpleNamespace(get=lambda: 128)


def _sglang_rope_stubs(folder: Path) -> dict[str, types.ModuleType]:
    """SGLang's answers on a CUDA host (``is_cuda`` true, every other platform false), no RL
    on-policy role (``publish_role()`` is ``None``: the cache on the device, not the CPU), and
    ``BaseFusedOp`` as the ``torch.nn.Module`` it is; the fused RoPE kernels it imports on CUDA
    are never called while building tables."""
    rope = "sglang.srt.layers.rotary_embedding"
    no = lambda *args, **kwargs: False  # noqa: E731
    utils = package(
        "sglang.srt.utils",
        is_cuda=lambda: True,
        get_compiler_backend=lambda: "inductor",
        get_device=lambda *args: _SglangRopeSwitches.device,
    )
    for name in ("is_hip", "is_npu", "is_cpu", "is_xpu", "is_musa", "is_mps",
                 "cpu_has_amx_support", "get_bool_env_var"):  # fmt: skip
        setattr(utils, name, no)
    return {
        "sglang": package("sglang"),
        "sglang.kernels": package("sglang.kernels"),
        "sglang.kernels.fused_op": package("sglang.kernels.fused_op", BaseFusedOp=torch.nn.Module),
        "sglang.kernels.ops": package("sglang.kernels.ops"),
        "sglang.kernels.ops.attention": package("sglang.kernels.ops.attention"),
        "sglang.kernels.ops.attention.rope": package(
            "sglang.kernels.ops.attention.rope", apply_rope_with_cos_sin_cache_inplace=None
        ),
        "sglang.srt": package("sglang.srt"),
        "sglang.srt.environ": package("sglang.srt.environ", envs=_SglangRopeEnvs()),
        "sglang.srt.layers": package("sglang.srt.layers"),
        # The real folder, never its __init__.py (the factory and every model's classes).
        rope: package(rope, folder),
        "sglang.srt.platforms": package(
            "sglang.srt.platforms", current_platform=types.SimpleNamespace(is_out_of_tree=no)
        ),
        "sglang.srt.runtime_context": package(
            "sglang.srt.runtime_context", publish_role=lambda: None, get_exec=lambda: None
        ),
        "sglang.srt.utils": utils,
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
        if engine in ("vllm-rope", "vllm-legacy-rope", "sglang-rope"):
            if engine != "sglang-rope":
                stubs, rope = _vllm_rope_stubs(files[0].parent), _VLLM_ROPE.replace("/", ".")
            else:
                stubs, rope = _sglang_rope_stubs(files[0].parent), _SGLANG_ROPE.replace("/", ".")
            for path in files:  # each file after the ones it imports (ENGINE_FILES' order)
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
    digests = [sha256(p) for p in files]
    if engine in PINNED_SHA256:  # kernel_files checked every hash
        releases = [PINNED_SHA256[engine][0]]
    else:
        releases = sorted({KNOWN_SHA256.get(d, "unknown release") for d in digests})
    return _ROPE_LOADED[key], f"{', '.join(releases)} (sha256 {' '.join(d[:12] for d in digests)})"


def _rope_engine(profile: EngineProfile) -> str:
    if profile.name not in ROPE_ORACLES:
        raise ValueError(
            f"engine profile {profile.name!r} has no RoPE oracle here; the profiles with one: "
            f"{sorted(ROPE_ORACLES)}."
        )
    return ROPE_ORACLES[profile.name][0]


def rope_code(
    profile: EngineProfile, root: str | os.PathLike | None = None
) -> tuple[dict[str, types.ModuleType], str]:
    """The rotary modules of ``profile``'s engine (by file stem), loaded unmodified once, and
    their release and hashes: for a compiler that imports the code it traces by module name."""
    return _load_rope_code(_rope_engine(profile), root)


def engine_rotary(
    profile: EngineProfile,
    spec: RopeSpec,
    *,
    device: torch.device | str,
    model_dtype: torch.dtype = torch.bfloat16,
    max_position_embeddings: int,
    neox: bool = True,
    root: str | os.PathLike | None = None,
) -> tuple[Any, str]:
    """The rotary module ``profile``'s engine builds (vLLM's or SGLang's own class, as
    :func:`engine_rope` describes), and the release and file hashes that ran: the module whose
    ``cos_sin_cache`` the tables are and whose ``forward_native`` the engine's compiled model
    rotates with (``neox``: its ``is_neox_style``, which the tables do not depend on).
    ``ValueError`` for LMDeploy's (its tables are a function, not a module)."""
    engine = _rope_engine(profile)
    if engine == "lmdeploy-rope":
        raise ValueError("LMDeploy's rotary embedding is a table function: use engine_rope.")
    eager = ROPE_ORACLES[profile.name][1]
    modules, source = _load_rope_code(engine, root)
    r, y = spec.rope_dim, spec.yarn
    vllm = engine != "sglang-rope"
    # vLLM's loader builds the model under its device, with custom ops on in an eager run;
    # SGLang's under its target device, DeepSeek's YaRN class at get_device() explicitly.
    _VllmSwitches.eager, _SglangRopeSwitches.device = (
        (eager, "cuda") if vllm else (False, str(torch.device(device)))
    )
    plain, scaled = ("base", "deepseek_scaling_rope") if vllm else ("base", "rope_variant")
    try:
        with torch.device(device):
            if y is None:
                rotary = modules[plain].RotaryEmbedding(
                    r, r, max_position_embeddings, spec.base, neox, model_dtype
                )
            else:
                rotary = modules[scaled].DeepseekScalingRotaryEmbedding(
                    r, r, y.original_max_position_embeddings, spec.base, neox,
                    y.scaling_factor, model_dtype, beta_fast=y.beta_fast,
                    beta_slow=y.beta_slow, mscale=y.mscale, mscale_all_dim=y.mscale_all_dim,
                )  # fmt: skip
    finally:
        _VllmSwitches.eager, _SglangRopeSwitches.device = False, "cuda"
    return rotary, source


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
    eager itself when compiling fails), in ``model_dtype``. SGLang: what its indexer's
    ``get_rope_wrapper`` builds (``RotaryEmbedding`` for a plain checkpoint; for a YaRN one
    DeepSeek's ``deepseek_yarn``, ``DeepseekScalingRotaryEmbedding``), constructed under ``with
    torch.device(device)`` as its model loader constructs the model, the cache left in float32
    as SGLang leaves it on CUDA; ``max_position_embeddings`` as vLLM's.
    """
    engine = _rope_engine(profile)
    if engine != "lmdeploy-rope":
        rotary, source = engine_rotary(
            profile, spec, device=device, model_dtype=model_dtype,
            max_position_embeddings=max_position_embeddings or n_positions, root=root,
        )  # fmt: skip
        vllm = engine != "sglang-rope"
        cache = rotary.cos_sin_cache
        if cache.shape[0] < n_positions:
            raise ValueError(
                f"{'vLLM' if vllm else 'SGLang'}'s cache holds {cache.shape[0]} positions, fewer "
                f"than n_positions={n_positions}; pass max_position_embeddings >= {n_positions}."
            )
        cos, sin = cache[:n_positions].chunk(2, dim=-1)
        return EngineRope(cos.contiguous(), sin.contiguous(), source)
    modules, source = _load_rope_code(engine, root)
    r, y = spec.rope_dim, spec.yarn
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
    weights_gemm: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> EngineKernelRun:
    """The FP8 operands the engine kernel of ``profile`` builds from ``inputs`` (batch 1).

    ``weights_gemm``: ``(x [S, hidden], weight [H, hidden])`` BF16, the head-weight GEMM's
    inputs, for ``sglang-unfused`` (whose code multiplies them into float32 itself); default its
    identity on ``inputs.w`` (the float32 product is then ``inputs.w`` exactly).

    ``rope``: the engine's own RoPE tables (:func:`engine_rope`, positions ``0 .. S - 1`` at
    least); default the tables of ``inputs.freqs`` in the profile's cache dtype. ``profile``
    picks the engine (:data:`ORACLE_ENGINES`) and its cos/sin cache dtype; the key
    LayerNorm takes the model's weight and bias (vLLM holds them in float32, exact) and the
    engine's own epsilon (``profile.k_norm_eps``: vLLM and LMDeploy hard-code 1e-6, whatever the
    model says). Runs where the tensors are (CUDA; the CPU under ``TRITON_INTERPRET=1``).
    """
    engine = oracle_for(profile) or JIT_ORACLE_ENGINES.get(profile.name)
    if engine is None:
        raise ValueError(
            f"engine profile {profile.name!r} has no kernel oracle here; the profiles with one: "
            f"{sorted({**ORACLE_ENGINES, **JIT_ORACLE_ENGINES})}."
        )
    if engine == "sglang-unfused":  # loaded by run_sglang_unfused; its files checked first
        if (reason := missing_reason(engine, root)) is not None:
            raise RuntimeError(f"the {engine} kernel oracle cannot run: {reason}.")
    else:
        module, source = load_engine_kernels(engine, root)
    if weights_gemm is not None and engine != "sglang-unfused":
        raise ValueError(
            f"weights_gemm: the {engine} kernels take the BF16 head-weight projection (inputs.w); "
            "only sglang-unfused multiplies the GEMM's inputs itself."
        )
    eps = profile.k_norm_eps if profile.k_norm_eps is not None else inputs.k_norm.eps
    if engine == "sglang" or engine == "sglang-unfused":
        # Indexer.__init__ builds LayerNorm(self.head_dim, dtype=...) with no eps: SGLang's
        # LayerNorm default, 1e-6, whatever the checkpoint (srt/layers/layernorm.py:1019-1030,
        # srt/layers/attention/dsa/dsa_indexer.py:378-385), as the sglang profiles say.
        eps = SGLANG_K_NORM_EPS
    if rope is None:
        cos, sin = _cos_sin(inputs, profile.cos_sin_dtype)
    else:
        if rope.cos.shape[0] < inputs.seq_len or rope.cos.device != inputs.q.device:
            raise ValueError(
                f"rope holds {rope.cos.shape[0]} positions on {rope.cos.device}; the kernels "
                f"read {inputs.seq_len} on {inputs.q.device}."
            )
        cos, sin = rope.cos[: inputs.seq_len], rope.sin[: inputs.seq_len]
    if engine == "sglang-unfused":
        if interleaved:
            raise ValueError(
                "SGLang's unfused indexer is its NeoX path (use_dsa_indexer_fusion = _is_cuda and "
                "... and not is_neox_style): an interleaved model takes sglang-fused's kernels."
            )
        hidden, weight = weights_gemm if weights_gemm is not None else (None, None)
        return run_sglang_unfused(
            inputs, cos, sin, eps, hidden=hidden, weights_proj=weight, root=root
        )
    run = {"vllm": _run_vllm, "lmdeploy": _run_lmdeploy, "sglang": _run_sglang}[engine]
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


def _load_sglang(files: tuple[Path, ...]) -> types.ModuleType:
    """SGLang's indexer wrappers and JIT build code, loaded unmodified with the stand-ins."""
    root = files[0].parents[5]  # the folder holding sglang/
    stubs = sglang_stubs(root)
    jit = SglangJit.load(lambda rel: root / rel, stubs, " ".join(sha256(p) for p in files))
    dsv4 = "sglang.kernels.ops.attention.dsv4.utils"
    stubs[dsv4] = load_module(root / f"{SGLANG_KERNELS}/ops/attention/dsv4/utils.py", dsv4, stubs)
    dsa = "sglang.kernels.ops.attention.dsa"
    out = types.ModuleType("_dsa_oracle_sglang")
    out.__dict__.update(jit=jit, arch=jit.m["arch"])
    for stem in ("indexer_k", "indexer_q"):
        setattr(out, stem, load_module(root / f"{SGLANG_KERNELS}/ops/attention/dsa/{stem}.py",
                                       f"{dsa}.{stem}", stubs))  # fmt: skip
    return out


def sglang_build(
    root: str | os.PathLike | None = None, *, capability: tuple[int, int] | None = None
) -> list[Path]:
    """Build SGLang's fused indexer modules (the k store kernel and the q kernel, BF16, as the
    indexer instantiates them) through SGLang's own JIT code, without running them; the shared
    libraries. ``capability``: compile for that SM (``(9, 0)``: ``sm_90a``, as SGLang on an H200)
    instead of the local GPU's, e.g. on a machine without one. Needs nvcc and apache-tvm-ffi."""
    reason = missing_reason("sglang", root)
    if capability is not None and kernel_files("sglang", root) is not None:
        reason = sglang_toolchain_reason(need_device=False)
    module, _ = load_engine_kernels("sglang", root, reason=reason)
    return module.jit.build(
        module.arch,
        capability,
        lambda: module.indexer_k._jit_k_indexer_norm_rope_store_module(torch.bfloat16, SGLANG_PAGE),
        lambda: module.indexer_q._jit_main_q_indexer_rope_first_quant_module(torch.bfloat16),
    )


def _run_sglang(module, source, inputs, interleaved, eps, cos, sin) -> EngineKernelRun:
    """SGLang 0.5.23's fused path (``Indexer._fused_q_prepare_and_store``, one stream): the
    k store kernel writes the index-K cache, the q kernel returns E4M3 q and folded weights."""
    if not interleaved:
        raise ValueError(
            "SGLang's fused indexer serves interleaved indexer RoPE only (use_dsa_indexer_fusion "
            "= _is_cuda and ... and not is_neox_style); a NeoX model takes its unfused path."
        )
    s, h, d = inputs.seq_len, inputs.n_heads, inputs.head_dim
    device = inputs.q.device
    # The rotary embedding's float32 cos_sin_cache [max_pos, rope_dim]: [cos..., sin...].
    cache = torch.cat((cos, sin), dim=-1).float().contiguous()
    positions = torch.arange(s, dtype=torch.int64, device=device)
    # wk_weights_proj: one BF16 GEMM output [S, D + H]; key and weights_raw are its two slices
    # (kw.split([head_dim, n_heads], dim=-1)), passed strided as SGLang passes them.
    kw = torch.cat((inputs.k[:, 0], inputs.w[:, 0]), dim=-1)
    key, weights_raw = kw.split([d, h], dim=-1)
    norm = inputs.k_norm
    n_pages = -(-s // SGLANG_PAGE)
    k_cache = torch.zeros(n_pages, (d + 4) * SGLANG_PAGE, dtype=torch.uint8, device=device)
    module.indexer_k.fused_k_indexer_norm_rope_store(
        key, k_cache, positions.clone(), norm.weight.detach().float().contiguous(),
        norm.bias.detach().float().contiguous(), eps, cache, positions, SGLANG_PAGE,
    )  # fmt: skip
    k8 = k_cache[:, : SGLANG_PAGE * d].reshape(n_pages * SGLANG_PAGE, d)[:s]
    k_descale = k_cache[:, SGLANG_PAGE * d :].contiguous().view(torch.float32).reshape(-1)[:s]
    q_scale_gate = d**-0.5 * h**-0.5  # self.softmax_scale * self.n_heads**-0.5, Python floats
    q8, w = module.indexer_q.fused_q_indexer_rope_first_quant(
        inputs.q[:, 0].contiguous(), weights_raw, q_scale_gate, cache, positions
    )
    ops = EngineOperands(
        q8, k8.contiguous().view(torch.float8_e4m3fn), k_descale.contiguous(), w.reshape(s, h)
    )
    return EngineKernelRun(ops, "sglang", source)


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
    # The model's Hadamard rotation as the profile's engine path has it (sglang-unfused's on).
    fields = IndexerFields(hadamard=bool(profile.hadamard), rope_interleaved=interleaved)
    ops = training_operands(inputs, config, fields, impl=impl)
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


def engine_layer_scores(
    indexer: Any,  # a dsa_precision.megatron.PrecisionDSAIndexer (no Megatron import here)
    x: torch.Tensor,
    qr: torch.Tensor,
    *,
    scores: str = "deepgemm",
    max_position_embeddings: int | None = None,
    root: str | os.PathLike | None = None,
) -> tuple[list[torch.Tensor], str]:
    """What the engine of the indexer's profile scores for one DSA layer's rows, from that
    layer's own projections: per sequence, ``(S, S)`` float32 logits (``-inf`` past each row's
    position), and the engine code's source (release and hashes).

    ``indexer``: a ``PrecisionDSAIndexer`` with ``rope_fp32`` (its profile has a kernel and a
    RoPE oracle: ``vllm``, ``vllm-eager``, ``lmdeploy``, ``sglang-fused``, ``sglang-unfused``); ``x`` ``[S, B, hidden]`` and ``qr``
    ``[S, B, q_lora_rank]``, the DSA attention's inputs (BSHD). Per sequence, the layer's BF16
    projections (:meth:`PrecisionDSAIndexer.projections`) go to the engine's own code,
    unmodified from ``DSA_ENGINE_KERNELS``: its RoPE table construction (:func:`engine_rope`)
    and its preprocess kernels (:func:`engine_kernel_operands`); the FP8 operands are scored by
    ``scores`` (``"deepgemm"``: DeepGEMM's ``fp8_mqa_logits``, the engines' scorer; ``"exact"``:
    float64). ``max_position_embeddings``: the plain-RoPE cache length the engine builds
    (default ``S``; on CUDA each row depends on its position only).
    """
    pre = indexer.preprocess()
    if not pre.rope_fp32 or pre.rope_tables is None:
        raise ValueError(
            "engine_layer_scores: the indexer has no engine RoPE tables (dsa_indexer_rope_fp32 "
            "is off); build the layer with dsa_indexer_rope_fp32=True and the engine's profile."
        )
    profile = pre.engine
    s, batch = x.shape[0], x.shape[1]
    rope = engine_rope(
        profile, pre.rope_tables.spec, s, device=x.device,
        max_position_embeddings=max(s, max_position_embeddings or s), root=root,
    )  # fmt: skip
    interleaved = bool(indexer.config.dsa_indexer_rope_interleaved)
    weights_fp32 = profile.weights_dtype == "fp32"  # the engine multiplies x by weights_proj
    logits, source = [], rope.source
    with torch.no_grad():
        for b in range(batch):
            p = indexer.projections(x[:, b : b + 1], qr[:, b : b + 1], None, weights_fp32)
            inputs = SyntheticIndexerInputs(p.q, p.k, p.w, indexer.k_norm, p.freqs)
            gemm = (x[:, b], indexer.linear_weights_proj.weight.detach()) if weights_fp32 else None
            run = engine_kernel_operands(
                inputs, profile, interleaved=interleaved, rope=rope, root=root, weights_gemm=gemm
            )
            source = f"{rope.source}; {run.source}"
            logits.append(engine_scores(run.operands, kernel=scores))
    return logits, source


def engine_layer_picks(
    indexer: Any,
    x: torch.Tensor,
    qr: torch.Tensor,
    topk: int,
    *,
    scores: str = "deepgemm",
    max_position_embeddings: int | None = None,
    root: str | os.PathLike | None = None,
) -> tuple[torch.Tensor, str]:
    """What the engine of the indexer's profile picks for one DSA layer's rows: the logits of
    :func:`engine_layer_scores` (its arguments) selected by :func:`~dsa_precision.cli.engine_model.engine_select`
    (exact, ties to the lower key: the package's model of the engines' top-k step, not their
    kernel). Returns ``(B * S, k)`` int32 sequence-relative keys, batch-major, ascending, ``-1``
    padded (``k = min(topk, S)``), and the engine code's source."""
    logits, source = engine_layer_scores(
        indexer, x, qr, scores=scores, max_position_embeddings=max_position_embeddings, root=root
    )
    return torch.cat([engine_select(s, topk) for s in logits]), source
