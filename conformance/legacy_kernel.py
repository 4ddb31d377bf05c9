"""vLLM 0.28.0's own CUDA key quantization for the DSA indexer as an oracle of ``vllm-legacy``.

vLLM 0.26-0.28 quantize the indexer key in CUDA, fused with the cache write:
``indexer_k_quant_and_cache`` (vLLM 0.28.0 ``csrc/libtorch_stable/cache_kernels.cu:547-608``, the
launcher ``:1605-1644``), which vLLM's model code calls with ``quant_block_size=128`` and
``scale_fmt="ue8m0"`` (``vllm/model_executor/models/deepseek_v2.py:677-678``,
``vllm/model_executor/layers/sparse_attn_indexer.py:400-406``). vLLM's prebuilt extension does not
load against every torch, so ``tools/vllm_legacy_kernel.sh`` compiles that file, unmodified, with
the headers it includes and the repository's binding into one library,
``torch.ops.dsa_vllm_legacy.indexer_k_quant_and_cache`` (``docs/gpu-validation.md`` has the recipe).
Nothing of vLLM is in this repository.

:data:`ENV_VAR` (``DSA_VLLM_LEGACY``) names the build folder: the library and the ``SHA256SUMS`` of
the vLLM files it was compiled from, which name the release (:data:`SOURCE_SHA256`).
:func:`vllm_legacy_key_quant` runs the kernel on a BF16 key; :func:`legacy_kernel_key` feeds it the
package's own ``vllm-legacy`` preprocessing of synthetic inputs (LayerNorm and RoPE, rounded to
BF16 as vLLM 0.26-0.28 round them), so what is compared is the key quantization alone.
Importing this module loads nothing; the oracle needs CUDA.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from dsa_precision.cli.synthetic import SyntheticIndexerInputs
from dsa_precision.engines import ENGINE_PROFILES, EngineProfile
from dsa_precision.preprocess import IndexerPreprocess

__all__ = [
    "ENV_VAR",
    "LIBRARY",
    "RELEASE",
    "SOURCE_SHA256",
    "LegacyKeyRun",
    "legacy_kernel_key",
    "library_source",
    "load_kernel",
    "missing_reason",
    "package_key",
    "vllm_legacy_key_quant",
]

ENV_VAR = "DSA_VLLM_LEGACY"
LIBRARY = "dsa_vllm_legacy.so"
RELEASE = "vllm 0.28.0"

# SHA-256 of the files the library is compiled from, as vLLM 0.28.0's sdist ships them
# (paths under vllm-0.28.0/; tools/vllm_legacy/SHA256SUMS holds the same list).
SOURCE_SHA256: dict[str, str] = {
    "LICENSE": "c71d239df91726fc519c6eb72d318ec65820627232b2f796219e87dcf35d0ab4",
    "csrc/cuda_compat.h": "959bc9e0e73e020d777530b18bf12160d35cc4eb976335955395729700b2f975",
    "csrc/cuda_utils.h": "02ef2db7face2cfbaecb4b4cf4f2b4760de00e19de797449b5d08fe5e7adc222",
    "csrc/torch_utils.h": "b4275d1aed23d3024f1bd0cc059d1f4ec1fc132cab01a2a8cea4e48e4bfb1d8f",
    "csrc/attention/attention_dtypes.h": "adbf81937188baa7a4215e51dd4f3ae7ce74f92a90b54f7cdf783d96ea483d53",
    "csrc/attention/attention_generic.cuh": "a9eed8b72c93948c71c90784eaacddf6dafd229cdf12f5df0ce1f05cd21aa41e",
    "csrc/attention/dtype_bfloat16.cuh": "eb5118767d89e5f9de1bf6953ab5cd0e80cdb3040c2bb9001130d1b2ccb92e43",
    "csrc/attention/dtype_float16.cuh": "fb6eb4daeb98fc1c4eeb6ea55ebb7f76d2fb725e17c1cab63e5f4b1c4298dbe2",
    "csrc/attention/dtype_float32.cuh": "5d9b84448e6886650f7456606cddc812f0d9a014ef17ed98a92e24b5d4464e00",
    "csrc/attention/dtype_fp8.cuh": "dde54da39de7b1e439d700109f18fd79d8ceb4ed03425bfee2e2a9d8337412ca",
    "csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh": "95cc778701c56e0cb7c65e8d2cd59bc1e345a036599be9fbf523033918d7f90b",
    "csrc/libtorch_stable/cache_kernels.cu": "3b32cb972fc98bf53daf483900fadf8c818b20df346eb85920e9987f79833604",
    "csrc/libtorch_stable/concat_mla_q.cuh": "08f08cd7dbfba9337b73b2e34760419fc6bbb647f1222bdb89168fee17fcc98b",
    "csrc/libtorch_stable/cuda_vec_utils.cuh": "97255c093bda8d054185803d14930fd910ce0cdcdabe9157898c9ee9f4f33be4",
    "csrc/libtorch_stable/dispatch_utils.h": "0397432fab9020f2b39f3053d019f8b4fee78d78f4ac41c72490dd1b84a41fed",
    "csrc/libtorch_stable/quantization/vectorization.cuh": "6b28cf0cfe9e948c989274adbfa46c6cdec393bf245efb49678213eca15171e7",
    "csrc/libtorch_stable/quantization/vectorization_utils.cuh": "991d501211c90a6a5c88d1062723b04c73ca1418d84f8aa07e255bd97128dff8",
    "csrc/libtorch_stable/torch_utils.h": "f619e1943039a67a3254f7e0679e1f3e0faa9d8fccae795f3b20df9e91a8a429",
}
_KERNEL_FILE = "csrc/libtorch_stable/cache_kernels.cu"
_QUANT_BLOCK = 128  # vLLM's quant_block_size: one scale per 128-lane key
_CACHE_BLOCK = 64  # tokens per cache block (the layout is per token; any block size would do)


def _folder(root: str | os.PathLike | None) -> Path | None:
    value = os.fspath(root) if root is not None else os.environ.get(ENV_VAR, "")
    return Path(value) if value else None


def missing_reason(root: str | os.PathLike | None = None) -> str | None:
    """Why the kernel cannot run here, or ``None`` when it can."""
    folder = _folder(root)
    if folder is None:
        return f"{ENV_VAR} is not set (docs/gpu-validation.md: the vLLM 0.28 kernel recipe)"
    for name in (LIBRARY, "SHA256SUMS"):
        if not (folder / name).is_file():
            return f"{folder} holds no {name} (bash .vllm-legacy/build.sh builds it)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def library_source(folder: str | os.PathLike) -> str:
    """What the library in ``folder`` was compiled from, by the file hashes its build recorded
    (``SHA256SUMS``): the release when they are all :data:`SOURCE_SHA256`, and the kernel file's
    hash."""
    built = {}
    for line in (Path(folder) / "SHA256SUMS").read_text().splitlines():
        digest, _, path = line.partition("  ")
        built[path] = digest
    release = RELEASE if built == SOURCE_SHA256 else "unknown release"
    return f"{release} {_KERNEL_FILE} (sha256 {built.get(_KERNEL_FILE, '?')[:12]})"


_LOADED: dict[Path, str] = {}


def load_kernel(root: str | os.PathLike | None = None) -> str:
    """Load the built library once (its op registers with torch) and return what it is:
    the release and the kernel file's hash. ``RuntimeError`` with the reason when it cannot run."""
    reason = missing_reason(root)
    if reason is not None:
        raise RuntimeError(f"the vLLM 0.28 kernel oracle cannot run: {reason}.")
    folder = _folder(root)
    assert folder is not None
    folder = folder.resolve()
    if folder not in _LOADED:
        torch.ops.load_library(os.fspath(folder / LIBRARY))
        _LOADED[folder] = library_source(folder)
    return _LOADED[folder]


@dataclasses.dataclass(frozen=True)
class LegacyKeyRun:
    """The key operands vLLM 0.28.0's kernel wrote, read back from its cache layout."""

    k: torch.Tensor  # (S, D) float8_e4m3fn
    k_descale: torch.Tensor  # (S,) float32, one per key
    source: str  # e.g. "vllm 0.28.0 csrc/libtorch_stable/cache_kernels.cu (sha256 3b32cb972fc9)"


def vllm_legacy_key_quant(
    k: torch.Tensor, *, root: str | os.PathLike | None = None
) -> LegacyKeyRun:
    """Quantize ``k`` (``[S, 128]`` bfloat16 on CUDA) by vLLM 0.28.0's
    ``indexer_k_quant_and_cache`` as vLLM calls it (block 128, ``"ue8m0"``), into vLLM's
    indexer cache layout (per block of 64 tokens: the E4M3 bytes, then one float32 scale per
    token) at slots ``0 .. S - 1``, and read the bytes and scales back."""
    source = load_kernel(root)
    if k.ndim != 2 or k.shape[1] != _QUANT_BLOCK or k.dtype != torch.bfloat16 or not k.is_cuda:
        raise ValueError(
            f"k must be [S, {_QUANT_BLOCK}] bfloat16 on CUDA (one scale per key); got "
            f"{tuple(k.shape)} {k.dtype} on {k.device}."
        )
    s, d = k.shape
    n_blocks, entry = -(-s // _CACHE_BLOCK), d + 4  # the key's bytes and its float32 scale
    cache = torch.zeros(n_blocks, _CACHE_BLOCK, entry, dtype=torch.uint8, device=k.device)
    slots = torch.arange(s, dtype=torch.int64, device=k.device)
    torch.ops.dsa_vllm_legacy.indexer_k_quant_and_cache(
        k.contiguous(), cache, slots, _QUANT_BLOCK, "ue8m0"
    )
    flat = cache.view(n_blocks, _CACHE_BLOCK * entry)
    k8 = flat[:, : _CACHE_BLOCK * d].reshape(-1, d)[:s].view(torch.float8_e4m3fn)
    scales = flat[:, _CACHE_BLOCK * d :].contiguous().view(torch.float32).reshape(-1)[:s]
    return LegacyKeyRun(k8.contiguous(), scales, source)


def package_key(
    inputs: SyntheticIndexerInputs,
    profile: EngineProfile | None = None,
    *,
    interleaved: bool,
    pre: IndexerPreprocess | None = None,
) -> torch.Tensor:
    """The key of ``inputs`` after the package's preprocessing under ``profile`` (default
    ``vllm-legacy``): ``[S, D]`` bfloat16 in the engine's lane order, what that profile's engine
    quantizes. Megatron de-interleaves the RoPE lanes of an ``interleaved`` model into halves;
    the engines rotate each adjacent pair in place, so the pairs go back (as the package's FP8
    operands do). ``pre``: a layer's own preprocessing (its engine RoPE tables of positions
    ``0 .. S - 1``) instead of one built here on ``inputs.freqs``. ``ValueError`` when the
    profile does not round its key to BF16."""
    profile = profile or ENGINE_PROFILES["vllm-legacy"]
    if pre is None:
        pre = IndexerPreprocess(
            inputs.head_dim, inputs.rope_dim, k_norm=inputs.k_norm, rope_interleaved=interleaved,
            rotate_activation=False, rope_fp32=True, engine=profile,
        )  # fmt: skip
    elif pre.engine != profile or not pre.rope_fp32 or pre.rope_interleaved != interleaved:
        differ = [
            f"{f.name}={getattr(pre.engine, f.name)!r}"
            for f in dataclasses.fields(profile)
            if f.name != "name" and getattr(pre.engine, f.name) != getattr(profile, f.name)
        ]
        raise ValueError(
            f"pre preprocesses under {pre.engine.name!r} (rope_fp32={pre.rope_fp32}, "
            f"rope_interleaved={pre.rope_interleaved}{''.join(', ' + d for d in differ)}), not "
            f"{profile.name!r} with rope_fp32 and rope_interleaved={interleaved}."
        )
    with torch.no_grad():
        _, k = pre(inputs.q, inputs.k, inputs.freqs)
    key = k[:, 0].to(torch.bfloat16)
    if not torch.equal(key.float(), k[:, 0].float()):
        raise ValueError(f"engine profile {profile.name!r} does not round its key to BF16.")
    if not interleaved:
        return key
    half, lanes = inputs.rope_dim // 2, torch.arange(inputs.head_dim, device=key.device)
    pairs = torch.stack((lanes[:half], lanes[half : 2 * half]), dim=-1).flatten()
    return key[:, torch.cat((pairs, lanes[2 * half :]))]


def legacy_kernel_key(
    inputs: SyntheticIndexerInputs,
    profile: EngineProfile | None = None,
    *,
    interleaved: bool,
    root: str | os.PathLike | None = None,
) -> LegacyKeyRun:
    """vLLM 0.28.0's kernel on the package's preprocessed key of ``inputs`` (:func:`package_key`;
    default profile ``vllm-legacy``): the E4M3 key bytes and float32 scales vLLM 0.26-0.28 store,
    to compare with the profile's own ``k`` and ``k_descale`` operands."""
    return vllm_legacy_key_quant(package_key(inputs, profile, interleaved=interleaved), root=root)
