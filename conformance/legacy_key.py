"""vLLM 0.28.0's indexer key and query as its compiled model builds them: the engine side of
``vllm-legacy``'s layer-level conformance.

vLLM 0.26-0.28's ``Indexer.forward`` (the generic ``deepseek_v2`` indexer, its fused-query branch
on CUDA: ``vllm/model_executor/models/deepseek_v2.py:740-765``) splits the BF16 output of the
fused ``wk_weights_proj`` GEMM into the key and the raw head weights, normalises the key with
vLLM's ``LayerNorm`` (``model_executor/layers/layernorm.py:310-325``: ``F.layer_norm`` of the
float32 key with float32 weight and bias, eps 1e-6 as ``deepseek_v2.py:674`` builds it, then
``type_as`` the BF16 key), rotates its first ``rope_dim`` lanes with the rotary module's
``forward_native`` (vLLM's default compiled run turns custom ops off) and concatenates the key
again; the query goes through the Triton kernel ``fused_indexer_q_rope_quant`` (:mod:`.legacy_q`)
with the same rotary module's ``cos_sin_cache``. The model runs inside ``torch.compile``, so the
key's bits are what Inductor generates for those lines.

This module loads vLLM 0.28.0's files unmodified (``layernorm.py`` here, the rotary code through
:func:`.engine_kernels.engine_rotary`, the query kernel through :func:`.legacy_q.load`), calls
them in ``Indexer.forward``'s order and compiles that key path with Inductor under vLLM 0.28's
``inductor_compile_config`` defaults (:func:`vllm_inductor_options`), the token dimension dynamic
as vLLM marks it. It is narrower than vLLM's own run in two ways, which the results state: the
compiled graph is this key path, not vLLM's whole-model graph, and vLLM's pass manager does not
run (its default passes fuse RMSNorm and quantization patterns, none of which this path holds);
and the compiler is the ``torch`` of the process that runs it (``tools/vllm_legacy_engine.py``
runs it in a child process under the torch vLLM 0.28 pins, 2.13.0). The key's quantization is
vLLM's CUDA kernel (:mod:`.legacy_kernel`), run by the caller on :attr:`LegacyEngineRun.k`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
from pathlib import Path
from typing import Any

import torch

from dsa_precision.engines import ENGINE_PROFILES, LayerNormArith
from dsa_precision.rope import RopeSpec

from . import legacy_q
from .engine_kernels import engine_rotary, rope_code
from .engine_kernels import missing_reason as files_missing_reason
from .loader import load_module, package, roots, scoped_modules, sha256

__all__ = [
    "LAYERNORM_FILE",
    "LAYERNORM_SHA256",
    "VLLM_K_NORM_EPS",
    "LegacyEngineRun",
    "inductor_layernorm_rule",
    "legacy_engine_run",
    "load_layernorm",
    "missing_reason",
    "vllm_inductor_options",
]

LAYERNORM_FILE = "vllm/model_executor/layers/layernorm.py"
LAYERNORM_SHA256 = "3460eba01758849027bb59b8592626406e33ab25b23d2def729bb0ec42afce67"  # 0.28.0
# Indexer.__init__: self.k_norm = LayerNorm(self.head_dim, eps=1e-6) (deepseek_v2.py:674).
VLLM_K_NORM_EPS = 1e-6


def _layernorm_file(root: str | os.PathLike | None) -> Path | None:
    for r in roots(root):
        path = r / LAYERNORM_FILE
        if path.is_file() and sha256(path) == LAYERNORM_SHA256:
            return path
    return None


def missing_reason(root: str | os.PathLike | None = None) -> str | None:
    """Why vLLM 0.28.0's key and query cannot be built here, or ``None``: its ``layernorm.py``,
    rotary files and query kernel under a root of ``DSA_ENGINE_KERNELS``."""
    for engine in ("vllm-legacy-rope", "vllm-legacy-q"):
        if (reason := files_missing_reason(engine, root)) is not None:
            return reason
    if _layernorm_file(root) is None:
        return f"no root of DSA_ENGINE_KERNELS holds vLLM 0.28.0's {LAYERNORM_FILE}"
    return None


def _layernorm_stubs() -> dict[str, types.ModuleType]:
    """What ``layernorm.py`` imports, for its other classes (RMSNorm and kin: custom ops whose
    registration is all that runs at import)."""

    class CustomOp(torch.nn.Module):
        @classmethod
        def register(cls, name: str):
            return lambda op: op

    return {
        "vllm": package("vllm"),
        "vllm.kernels": package("vllm.kernels"),
        "vllm.envs": package("vllm.envs"),
        "vllm.ir": package("vllm.ir"),
        "vllm.logger": package("vllm.logger", init_logger=lambda name: None),
        "vllm.model_executor": package("vllm.model_executor"),
        "vllm.model_executor.custom_op": package(
            "vllm.model_executor.custom_op", CustomOp=CustomOp
        ),
        "vllm.model_executor.layers": package("vllm.model_executor.layers"),
        "vllm.model_executor.layers.batch_invariant": package(
            "vllm.model_executor.layers.batch_invariant", rms_norm_batch_invariant=None
        ),
    }


_LAYERNORM: dict[Path, types.ModuleType] = {}


def load_layernorm(root: str | os.PathLike | None = None) -> types.ModuleType:
    """vLLM 0.28.0's ``layernorm.py`` (its ``LayerNorm`` class), loaded unmodified once."""
    path = _layernorm_file(root)
    if path is None:
        raise RuntimeError(f"the vllm-legacy key oracle cannot run: {missing_reason(root)}.")
    if path not in _LAYERNORM:
        _LAYERNORM[path] = load_module(path, "_dsa_oracle_vllm028_layernorm", _layernorm_stubs())
    return _LAYERNORM[path]


def vllm_inductor_options() -> dict[str, bool]:
    """vLLM 0.28.0's ``CompilationConfig.__post_init__`` defaults for Inductor
    (``vllm/config/compilation.py:915-987``): auto-functionalization v1, combo kernels with their
    benchmark (torch >= 2.9, not on the CPU), and on torch < 2.12 no size, alignment or scalar
    asserts (``VLLM_LOGGING_LEVEL`` is not DEBUG); those this torch's Inductor knows."""
    from torch._inductor import config

    options = {"enable_auto_functionalized_v2": False}
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if torch.cuda.is_available():
        options.update(combo_kernels=True, benchmark_combo_kernel=True)
    if version < (2, 12):
        options.update(size_asserts=False, alignment_asserts=False, scalar_asserts=False)
    return {k: v for k, v in options.items() if hasattr(config, k)}


@dataclasses.dataclass(frozen=True)
class LegacyEngineRun:
    """What vLLM 0.28.0's code built for one sequence.

    Attributes:
        k: ``[S, D]`` bfloat16, the key after LayerNorm and RoPE, what vLLM quantizes.
        q: ``[S, H, D]`` float8_e4m3fn, the query kernel's bytes.
        weights: ``[S, H]`` float32, the folded head weights.
        cos_sin_cache: ``[S, rope_dim]`` the rotary module's cache rows ``0 .. S - 1``
            (``[cos..., sin...]``, the model dtype).
        source: what ran: the files' releases and hashes, the compiler and its options.
    """

    k: torch.Tensor
    q: torch.Tensor
    weights: torch.Tensor
    cos_sin_cache: torch.Tensor
    source: dict[str, object]


def legacy_engine_run(
    kw: torch.Tensor,
    q: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    spec: RopeSpec,
    *,
    interleaved: bool,
    max_position_embeddings: int,
    compiled: bool = True,
    root: str | os.PathLike | None = None,
) -> LegacyEngineRun:
    """vLLM 0.28.0's key and query of one sequence at positions ``0 .. S - 1``.

    Args:
        kw: ``[S, D + H]`` bfloat16, the fused ``wk_weights_proj`` GEMM's output (the key, then
            the raw head weights), as ``Indexer.forward`` receives it.
        q: ``[S, H, D]`` bfloat16, the ``wq_b`` output.
        norm_weight, norm_bias: ``[D]``, the checkpoint's key LayerNorm affine parameters
            (vLLM holds them in float32: loaded exactly).
        spec: the model's RoPE (plain base, or DeepSeek's YaRN).
        interleaved: the indexer's RoPE layout (vLLM's ``indexer_rope_interleave``).
        max_position_embeddings: the plain rotary module's cache length (YaRN's is vLLM's own).
        compiled: Inductor (vLLM's default run); ``False`` runs the same code eagerly.
    """
    s, h, d = q.shape
    if kw.shape != (s, d + h) or kw.dtype != torch.bfloat16 or q.dtype != torch.bfloat16:
        raise ValueError(
            f"kw must be [S, D + H] = [{s}, {d + h}] bfloat16 beside q [S, H, D] bfloat16; got kw "
            f"{tuple(kw.shape)} {kw.dtype}, q {tuple(q.shape)} {q.dtype}."
        )
    device, r = kw.device, spec.rope_dim
    layernorm = load_layernorm(root)
    norm = layernorm.LayerNorm(d, eps=VLLM_K_NORM_EPS).to(device)
    with torch.no_grad():
        norm.weight.copy_(norm_weight.float())
        norm.bias.copy_(norm_bias.float())
    rotary, rope_source = engine_rotary(
        ENGINE_PROFILES["vllm-legacy"], spec, device=device,
        max_position_embeddings=max_position_embeddings, neox=not interleaved, root=root,
    )  # fmt: skip
    positions = torch.arange(s, dtype=torch.int64, device=device)

    def key(kw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        k = norm(kw[:, :d])
        k_pe, k_nope = torch.split(k, [r, d - r], dim=-1)
        k_pe = k_pe.unsqueeze(1)
        _, k_pe = rotary.forward_native(positions, torch.empty_like(k_pe), k_pe)
        return torch.cat([k_pe.reshape(-1, r), k_nope], dim=-1)

    options: dict[str, Any] = {**vllm_inductor_options()} if compiled else {}
    if compiled:
        torch._dynamo.mark_dynamic(kw, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        key = torch.compile(key, backend="inductor", fullgraph=True, options=options)
    module, q_source = legacy_q.load(root)
    # Dynamo imports the modules of the code it traces by name: vLLM's files, importable while
    # they compile and run.
    rope_modules, _ = rope_code(ENGINE_PROFILES["vllm-legacy"], root)
    importable = {m.__name__: m for m in (layernorm, *rope_modules.values())}
    with torch.no_grad(), scoped_modules(importable):
        k = key(kw, positions)
        q8, w = module.fused_indexer_q_rope_quant(
            positions, q.contiguous(), rotary.cos_sin_cache, kw[:, d:], d**-0.5, h**-0.5,
            rotary.is_neox_style,
        )  # fmt: skip
    import triton

    source: dict[str, object] = {
        "rope": rope_source,
        "layernorm": f"vllm 0.28.0 (sha256 {LAYERNORM_SHA256[:12]})",
        "query_kernel": q_source,
        "torch": torch.__version__,
        "torch_file": torch.__file__,
        "triton": triton.__version__,
        "compiled": compiled,
        "inductor_options": options,
    }
    cache = rotary.cos_sin_cache[:s].contiguous()
    return LegacyEngineRun(k.contiguous(), q8, w.reshape(s, h), cache, source)


# Inductor's kernel for the key LayerNorm: "triton_per_..." (persistent) or "triton_red_..."
# (looped), named after the fused ops (..._native_layer_norm_...).
_LN_KERNEL = re.compile(r"def (triton_(per|red)_fused_\w*native_layer_norm\w*)\(")


def inductor_layernorm_rule(cache_dir: str | os.PathLike) -> tuple[LayerNormArith, str]:
    """The ``EngineProfile.layernorm`` rule of the key LayerNorm kernel Inductor generated and
    kept in ``cache_dir`` (a ``TORCHINDUCTOR_CACHE_DIR``, e.g. vLLM's compile cache), and a line
    saying what was read: a looped reduction is ``"fp32-welford"``; a persistent one is
    ``"fp32-inductor-x1"`` or ``"fp32-inductor-x8"`` by the ``XBLOCK`` of the ``.best_config``
    its autotuner wrote beside it (docs/numerics.md, section 8.4). Raises unless exactly one such
    kernel is there."""
    found = []
    for path in sorted(Path(cache_dir).rglob("*.py")):
        text = path.read_text(errors="replace")
        if "async_compile.triton(" in text:  # the wrapper quoting the kernel, not its file
            continue
        for m in _LN_KERNEL.finditer(text):
            found.append((path, m.group(1), m.group(2)))
    if len({name for _, name, _ in found}) != 1:
        names = sorted({name for _, name, _ in found})
        raise ValueError(
            f"cache_dir={os.fspath(cache_dir)!r} holds {len(names)} LayerNorm kernels ({names}); "
            "point it at the Inductor cache of one compiled key path."
        )
    path, name, kind = found[0]
    if kind == "red":
        return "fp32-welford", f"{name} (looped Welford reduction)"
    # Inductor's local autotune cache: <hash of the kernel file's name>.best_config, in the
    # kernel file's folder (runtime/autotune_cache.py).
    best = sorted(path.parent.glob("*.best_config"))
    if len(best) != 1:
        raise ValueError(
            f"{name} is a persistent reduction but {path.parent} holds {len(best)} .best_config "
            "files, not one: Inductor writes it when the kernel first runs; run the compiled key "
            "once, then read the cache."
        )
    xblock = json.loads(best[0].read_text())["XBLOCK"]
    if xblock not in (1, 8, 32):
        raise ValueError(f"{name} kept XBLOCK {xblock}, not one of the measured 1, 8, 32.")
    rule: LayerNormArith = "fp32-inductor-x1" if xblock == 1 else "fp32-inductor-x8"
    return rule, f"{name} (persistent reduction, XBLOCK {xblock} kept by the autotuner)"
