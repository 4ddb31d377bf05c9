"""Layer-level conformance: Megatron's DSA layer with the drop-ins against the engines' own code.

For each model (``glm5``: 32 indexer heads, interleaved RoPE, plain RoPE of base 1e6; ``v32``:
64 heads, NeoX RoPE, DeepSeek-V3.2's YaRN: factor 40, original 4096, beta 32 / 1, mscale 1 / 1),
each ``use_cpu_initialization`` and each profile with an engine oracle, this builds Megatron's DSA
core attention from a ``DSAPrecisionTransformerConfig`` (``rope_fp32+fp8`` with the profile; the
k_norm epsilon 1e-6 set by ``dsa_indexer_k_norm_epsilon`` over a model-wide 1e-5, Megatron's own
DSA test pattern), takes the indexer's BF16 projections from that layer
(:meth:`PrecisionDSAIndexer.projections`) and hands the same projections to the engine's own
code: its RoPE table construction (vLLM 0.33's and SGLang 0.5.23's rotary modules built on the
device as their loaders build them; LMDeploy 0.18's, its ``inv_freq`` on the CPU) and its indexer
kernels (SGLang's fused JIT CUDA for ``sglang-fused``, the interleaved model only; its unfused
path for ``sglang-unfused``, the NeoX one, FlashInfer's CuTe DSL LayerNorm included)
(``conformance.engine_kernels``), all unmodified from ``DSA_ENGINE_KERNELS``.
Compared: the tables (the layer's against the engine's, and Megatron's own angles against the
engine's, for Megatron's ``inv_freq`` where the layer has it and built on the CPU), every q / k
E4M3 byte, k descale and folded head weight (the layer's own operands -- the fused kernel on
CUDA -- and the torch reference), then the rows whose top-k is identical: both operand sets
scored by the same scorer (``--scores``), and the layer's own top-k
(:meth:`PrecisionDSAIndexer.forward_with_scores`, the package's scoring pinned to the same
scorer: ``dsa_indexer_scoring_backend`` "deepgemm", or "torch" for ``--scores exact``) against the
engine's.

GPU (docs/gpu-validation.md, "Layer conformance"):

    DSA_ENGINE_KERNELS=$PWD/.engine-kernels PYTHONPATH=$PWD:/root/dg/DeepGEMM \\
        python tools/layer_conformance.py --out OUT_DIR

CPU, a smoke run of the same code under Triton's interpreter (``--no-fma``: the interpreter does
not contract, so the layer's profile is taken with ``fma=False``; the interpreter's casts are
corrected by tests/support/engine_oracles.py in tests/interpreter/test_layer_conformance.py):

    TRITON_INTERPRET=1 python tools/layer_conformance.py --device cpu --seq 32 --topk 8 \\
        --scores exact --no-fma --out OUT_DIR

Prints one markdown table last; writes ``layer_conformance.json`` to ``--out``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# conformance/ (the engine oracles) lives beside the package, not in it
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import time
import traceback
import types

import torch

from conformance import engine_kernels as ek
from conformance.legacy_kernel import package_key
from dsa_precision import ENGINE_PROFILES, EngineProfile, prepare_indexer_operands
from dsa_precision.cli.engine_model import EngineOperands, engine_scores, engine_select
from dsa_precision.cli.synthetic import SyntheticIndexerInputs
from dsa_precision.rope import RopePositions, rope_tables

# name: (indexer heads, interleaved RoPE, Megatron's RoPE fields)
MODELS = {
    "glm5": (32, True, dict(rope_type="rope", rotary_base=1e6)),
    "v32": (
        64, False,
        dict(
            rope_type="yarn", rotary_base=10000, rotary_scaling_factor=40,
            original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
}  # fmt: skip
HIDDEN, Q_LORA = 512, 256


# The profiles with both oracles: the engine's RoPE code and its kernels (SGLang's JIT CUDA needs
# nvcc and apache-tvm-ffi where it runs: ek.missing_reason("sglang")); vllm-legacy's engine side
# is vLLM 0.28.0's compiled key path and query kernel in a child process
# (tools/vllm_legacy_engine.py) and its CUDA key quantization here (DSA_VLLM_LEGACY).
LEGACY = "vllm-legacy"
ORACLE_PROFILES = sorted(
    p
    for p in ek.ROPE_ORACLES
    if p in ek.ORACLE_ENGINES or p in ek.JIT_ORACLE_ENGINES or p == LEGACY
)

# The layer's scoring backend for each --scores: the layer's own top-k is scored by the scorer
# the engine's rows are scored by (DeepGEMM's kernel, or the exact float64 reference).
LAYER_BACKENDS = {"deepgemm": "deepgemm", "exact": "torch"}


def _config(model: str, profile: EngineProfile, cpu_init: bool, topk: int, scores: str):
    import dsa_precision.megatron as dsap

    heads, interleaved, rope = MODELS[model]
    return dsap.DSAPrecisionTransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=cpu_init,
        bf16=True, params_dtype=torch.bfloat16, q_lora_rank=Q_LORA, kv_lora_rank=64,
        qk_head_dim=64, qk_pos_emb_head_dim=64, v_head_dim=64, add_bias_linear=False,
        apply_rope_fusion=False, experimental_attention_variant="dsa",
        dsa_indexer_n_heads=heads, dsa_indexer_head_dim=128, dsa_indexer_topk=topk,
        dsa_indexer_loss_coeff=0.0, dsa_indexer_rotate_activation=bool(profile.hadamard),
        dsa_indexer_rope_interleaved=interleaved,
        layernorm_epsilon=1e-5, dsa_indexer_k_norm_epsilon=1e-6,
        dsa_indexer_rope_fp32=True, dsa_indexer_scoring_precision="fp8",
        dsa_indexer_engine=profile, dsa_indexer_scoring_backend=LAYER_BACKENDS[scores], **rope,
    )  # fmt: skip


def _indexer(config, device: torch.device, seed: int):
    """The DSA core attention's indexer, built from the package's spec with Megatron's local
    modules (seeded; random LayerNorm affine parameters), on ``device``."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from dsa_precision.megatron import LocalDSASpecProvider, get_dsa_precision_module_spec

    torch.manual_seed(seed)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    spec = get_dsa_precision_module_spec(config, backend=LocalDSASpecProvider())
    attn = build_module(
        spec.submodules.core_attention, config=config, layer_number=1,
        attn_mask_type=AttnMaskType.causal, attention_type="self", cp_comm_type=None,
    )  # fmt: skip
    indexer = attn.indexer.to(device)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        norm = indexer.k_norm
        norm.weight.copy_(1 + 0.2 * torch.randn(norm.weight.shape, generator=g))
        norm.bias.copy_(0.2 * torch.randn(norm.bias.shape, generator=g))
    return indexer


def _megatron_cpu_tables(config, s: int, device: torch.device, dtype: torch.dtype):
    """cos / sin ``[s, 32]`` of Megatron's own angles with its ``inv_freq`` built on the CPU (its
    classes with ``use_cpu_initialization=True``; ``get_emb`` moves it to the current device,
    where the angles and cos / sin are computed), rounded to ``dtype``: the accident the
    engine's tables avoid."""
    from megatron.core.models.common.embeddings import RotaryEmbedding, YarnRotaryEmbedding

    common = dict(rotary_base=config.rotary_base, use_cpu_initialization=True)
    if config.rope_type == "rope":
        freqs, mscale = RotaryEmbedding(64, 1.0, **common).get_emb(s), 1.0
    else:
        freqs, mscale = YarnRotaryEmbedding(
            64, scaling_factor=config.rotary_scaling_factor,
            original_max_position_embeddings=config.original_max_position_embeddings,
            beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
            mscale_all_dim=config.mscale_all_dim, **common,
        ).get_emb(s)  # fmt: skip
    cos, sin = rope_tables(freqs.to(device), mscale, dtype)
    return cos[:, 0, 0, :32], sin[:, 0, 0, :32]


def _differ(a: torch.Tensor, b: torch.Tensor) -> int:
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    return int((a.contiguous().view(bits) != b.contiguous().view(bits)).sum())


def _as_engine(ops) -> EngineOperands:
    return EngineOperands(ops.q[0], ops.k[0], ops.k_descale[0], ops.weights[0])


def _rows_identical(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    same = (a.sort(-1).values == b.sort(-1).values).all(dim=-1)
    return float(same.float().mean()), int((~same).sum())


def _layer_side(model: str, profile, cpu_init: bool, args, *, operands: bool = True):
    """The Megatron layer with the drop-ins under ``profile``: its projections, its operands
    (fused kernel and torch reference) and its own top-k, from seeded weights and inputs
    (``operands=False``: the projections and the preprocessing only, what the engine needs)."""
    device, s = torch.device(args.device), args.seq
    config = _config(model, profile, cpu_init, args.topk, args.scores)
    indexer = _indexer(config, device, args.seed)
    g = torch.Generator().manual_seed(args.seed + 2)
    x = torch.randn(s, 1, HIDDEN, generator=g).to(torch.bfloat16).to(device)
    qr = torch.randn(s, 1, Q_LORA, generator=g).to(torch.bfloat16).to(device)
    # An engine whose head-weight GEMM outputs float32 (sglang-unfused) multiplies x by the
    # layer's weights_proj itself: both sides from the GEMM's BF16 inputs.
    weights_fp32 = profile.weights_dtype == "fp32"
    with torch.no_grad():
        p = indexer.projections(x, qr, None, weights_fp32)
        pre = indexer.preprocess()
        if not operands:
            return types.SimpleNamespace(config=config, indexer=indexer, x=x, p=p, pre=pre)
        layer_ops = indexer.scoring_operands(x, qr)
        torch_ops = prepare_indexer_operands(
            pre, p.q, p.k, p.w, p.freqs, config=indexer.precision, mscale=p.mscale,
            positions=p.positions, impl="torch",
        )  # fmt: skip
        mask = torch.full((s, s), float("-inf"), device=device).triu_(1)
        _, layer_topk = indexer.forward_with_scores(x, qr, mask)
    return types.SimpleNamespace(
        config=config, indexer=indexer, x=x, p=p, pre=pre, layer_ops=layer_ops,
        torch_ops=torch_ops, layer_topk=layer_topk, weights_fp32=weights_fp32,
    )  # fmt: skip


def _record(model: str, name: str, cpu_init: bool, args) -> dict:
    heads, interleaved, _ = MODELS[model]
    device, s = torch.device(args.device), args.seq
    profile = ENGINE_PROFILES[name]
    layer_profile = dataclasses.replace(profile, fma=False) if args.no_fma else profile
    # vllm-legacy's rule is known once the engine has compiled: the operands wait for it.
    side = _layer_side(model, layer_profile, cpu_init, args, operands=name != LEGACY)
    rec: dict = {"model": model, "heads": heads, "interleaved": interleaved, "profile": name,
                 "use_cpu_initialization": cpu_init}  # fmt: skip
    # The engine: its own tables, then its own kernels on the layer's projections.
    spec = side.pre.rope_tables.spec
    inputs = SyntheticIndexerInputs(side.p.q, side.p.k, side.p.w, side.indexer.k_norm, side.p.freqs)
    if name == LEGACY:
        rope, run, legacy, engine_k = _legacy_engine(
            args, inputs, spec, interleaved, f"{model}-{cpu_init}"
        )
        rec["engine_rope"], rec["engine_kernel"] = rope.source, run.source
        # The key LayerNorm Inductor compiled and kept for this size (vllm_legacy_profile): the
        # layer takes that kernel's rule (same seeded weights and inputs).
        layer_profile = dataclasses.replace(layer_profile, layernorm=legacy["layernorm_rule"])
        side = _layer_side(model, layer_profile, cpu_init, args)
        rec["layer_layernorm"] = layer_profile.layernorm
        ours = package_key(inputs, layer_profile, interleaved=interleaved, pre=side.pre)
        rec[LEGACY] = {**legacy, "k_bf16_differ": _differ(ours, engine_k)}
    else:
        rope = ek.engine_rope(
            profile, spec, s, device=device,
            max_position_embeddings=max(s, args.plain_max_position),
        )  # fmt: skip
        rec["engine_rope"] = rope.source
        gemm = (
            (side.x[:, 0], side.indexer.linear_weights_proj.weight.detach())
            if side.weights_fp32
            else None
        )
        run = ek.engine_kernel_operands(
            inputs, profile, interleaved=interleaved, rope=rope, weights_gemm=gemm
        )
        rec["engine_kernel"] = run.source
    config, pre, p = side.config, side.pre, side.p
    layer_ops, torch_ops, layer_topk = side.layer_ops, side.torch_ops, side.layer_topk
    indexer = side.indexer
    ours_cos, ours_sin = pre.engine_rope_rows(
        RopePositions.first(s), s, device, p.freqs, dtype=rope.cos.dtype
    )
    mcos, msin = rope_tables(p.freqs, p.mscale, rope.cos.dtype)
    ccos, csin = _megatron_cpu_tables(config, s, device, rope.cos.dtype)
    rec["tables"] = {
        "entries": 2 * rope.cos.numel(),
        "dtype": str(rope.cos.dtype).removeprefix("torch."),
        "layer_differ": _differ(ours_cos[:, :32], rope.cos) + _differ(ours_sin[:, :32], rope.sin),
        "megatron_angles_differ": _differ(mcos[:, 0, 0, :32], rope.cos)
        + _differ(msin[:, 0, 0, :32], rope.sin),
        "megatron_cpu_inv_freq_differ": _differ(ccos, rope.cos) + _differ(csin, rope.sin),
    }
    eng_top = engine_select(engine_scores(run.operands, kernel=args.scores), args.topk)
    for label, ops in (("layer", layer_ops), ("torch", torch_ops)):
        mine = _as_engine(ops)
        top = engine_select(engine_scores(mine, kernel=args.scores), args.topk)
        frac, bad = _rows_identical(top, eng_top)
        rec[label] = {**ek.operand_diff(mine, run.operands), "rows_identical": frac,
                      "rows_differ": bad}  # fmt: skip
    frac, bad = _rows_identical(layer_topk[0].to(eng_top.dtype), eng_top)
    assert indexer.scoring_backend == LAYER_BACKENDS[args.scores]  # the scorer compared
    rec["layer_topk"] = {"rows_identical": frac, "rows_differ": bad,
                         "backend": indexer.scoring_backend}  # fmt: skip
    return rec


def _legacy_engine(args, inputs: SyntheticIndexerInputs, spec, interleaved: bool, tag: str):
    """vLLM 0.28.0's side of a ``vllm-legacy`` cell: its key path and query kernel in a child
    (``tools/vllm_legacy_engine.py``; ``--engine-torch`` first on its ``PYTHONPATH``, Inductor's
    and Triton's output kept under ``--out``/vllm-legacy/TAG), its key quantized here by vLLM
    0.28.0's CUDA kernel (:mod:`conformance.legacy_kernel`). Returns the engine's
    tables, its operands, what the child ran (with the LayerNorm rule of the kernel Inductor
    kept: ``layernorm_rule``) and its BF16 key before quantization."""
    from conformance import legacy_kernel
    from conformance.legacy_key import inductor_layernorm_rule

    if not inputs.q.is_cuda:
        raise RuntimeError(
            "vllm-legacy's key quantization is vLLM 0.28.0's CUDA kernel: run this cell on CUDA "
            "(tests/interpreter/test_legacy_key.py checks its key path on the CPU)."
        )
    reason = legacy_kernel.missing_reason()
    if reason is not None:
        raise RuntimeError(f"the vLLM 0.28 key kernel cannot run: {reason}.")
    work = (args.out / LEGACY / tag).resolve()
    work.mkdir(parents=True, exist_ok=True)
    norm = inputs.k_norm
    torch.save(
        dict(
            kw=torch.cat((inputs.k[:, 0], inputs.w[:, 0]), dim=-1), q=inputs.q[:, 0],
            norm_weight=norm.weight.detach(), norm_bias=norm.bias.detach(),
            spec=spec,
            interleaved=interleaved,
            max_position_embeddings=max(inputs.seq_len, args.plain_max_position),
        ),
        work / "inputs.pt",
    )  # fmt: skip
    env = dict(os.environ)
    repo = Path(__file__).resolve().parents[1]
    paths = [os.path.abspath(args.engine_torch)] if args.engine_torch else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(repo), env.get("PYTHONPATH", "")]).strip(
        os.pathsep
    )
    env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor")  # compiled fresh, kept
    env["TRITON_CACHE_DIR"] = str(work / "triton")
    cmd = [sys.executable, str(repo / "tools" / "vllm_legacy_engine.py"),
           str(work / "inputs.pt"), str(work / "engine.pt")]  # fmt: skip
    subprocess.run(cmd, env=env, check=True)
    out = torch.load(work / "engine.pt", weights_only=False)
    source = out["source"]
    # Inductor's generated Triton code, one level under --out (what the key's bits are made of).
    code = args.out / f"{LEGACY}-inductor-code"
    code.mkdir(exist_ok=True)
    for path in sorted((work / "inductor").rglob("*.py")):
        if "@triton.jit" in path.read_text(errors="replace"):
            shutil.copy(path, code / f"{tag}-{path.name}")
    # The configuration Inductor's autotuner kept for each kernel, and what Triton compiled
    # (TTGIR layouts, PTX, launch metadata): the order of its float32 sums.
    for path in sorted((work / "inductor").rglob("*.best_config")):
        shutil.copy(path, code / f"{tag}-{path.name}")
    for path in sorted((work / "triton").rglob("triton_*")):
        if path.suffix in (".ttgir", ".ptx", ".json"):
            shutil.copy(path, code / f"{tag}-{path.parent.name[:8]}-{path.name}")
    if args.engine_torch and not Path(source["torch_file"]).is_relative_to(
        Path(os.path.abspath(args.engine_torch))
    ):
        raise RuntimeError(
            f"the vllm-legacy child imported torch {source['torch']} from {source['torch_file']}, "
            f"not from --engine-torch {args.engine_torch}."
        )
    device = inputs.q.device
    k = out["k"].to(device)
    key = legacy_kernel.vllm_legacy_key_quant(k)
    cos, sin = out["cos_sin_cache"].to(device).chunk(2, dim=-1)
    rope = ek.EngineRope(cos.contiguous(), sin.contiguous(), source["rope"])
    ops = EngineOperands(out["q"].to(device), key.k, key.k_descale, out["weights"].to(device))
    rule, kernel = inductor_layernorm_rule(work / "inductor")
    legacy = {**source, "key_kernel": key.source, "k_bf16_entries": k.numel(),
              "layernorm_rule": rule, "layernorm_kernel": kernel}  # fmt: skip
    run = ek.EngineKernelRun(ops, "vllm", f"{source['query_kernel']}; {key.source}")
    return rope, run, legacy, k


def _row(rec: dict) -> str:
    if "error" in rec:
        return f"| {rec['model']} | {rec['use_cpu_initialization']} | `{rec['profile']}` | error: {rec['error'][:80]} |"
    t, lay, ref = rec["tables"], rec["layer"], rec["torch"]
    rule = f" (`{rec['layer_layernorm']}`)" if "layer_layernorm" in rec else ""
    return (
        f"| {rec['model']} (H={rec['heads']}) | {rec['use_cpu_initialization']} | "
        f"`{rec['profile']}`{rule} | {t['layer_differ']} / {t['entries']} ({t['dtype']}) | "
        f"{t['megatron_angles_differ']} / {t['megatron_cpu_inv_freq_differ']} | "
        f"{lay['q_differ']} / {lay['k_differ']} / {lay['k_descale_differ']} / "
        f"{lay['weights_differ']} | {ref['q_differ'] + ref['k_differ']} | "
        f"{lay['rows_identical'] * 100:.2f} % | {rec['layer_topk']['rows_identical'] * 100:.2f} % |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--profiles", nargs="+", default=ORACLE_PROFILES, choices=ORACLE_PROFILES)
    p.add_argument("--cpu-init", nargs="+", default=["true", "false"], choices=["true", "false"])
    p.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    p.add_argument("--scores", default="deepgemm", choices=("deepgemm", "exact"))
    p.add_argument("--no-fma", action="store_true", help="the layer's profile with fma=False")
    p.add_argument(
        "--plain-max-position", type=int, default=65536,
        help="vLLM's cache length of the plain-RoPE model (the checkpoint's "
        "max_position_embeddings; on CUDA each row depends on its position only)",
    )  # fmt: skip
    p.add_argument(
        "--engine-torch", default=None,
        help="vllm-legacy: a folder of torch (and its Triton) first on the PYTHONPATH of the "
        "child that compiles vLLM 0.28.0's key path (its pin: torch 2.13.0, Triton 3.7.1)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("layer_conformance"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    env = {
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
    }
    print(json.dumps(env), flush=True)
    results: dict = {"env": env, "records": []}
    with _megatron(args.device):
        for model in args.models:
            for cpu_init in (c == "true" for c in args.cpu_init):
                for name in args.profiles:
                    if name == "vllm-eager" and MODELS[model][2]["rope_type"] != "yarn":
                        continue  # vLLM's eager run of a plain-RoPE model is the vllm profile
                    layout = ENGINE_PROFILES[name].rope_interleaved
                    if layout is not None and layout != MODELS[model][1]:
                        continue  # not the engine's path for this model (sglang-fused: GLM-5)
                    t0 = time.perf_counter()
                    try:
                        rec = _record(model, name, cpu_init, args)
                    except Exception as exc:  # keep measuring the others; the log says why
                        traceback.print_exc()
                        rec = {"model": model, "profile": name,
                               "use_cpu_initialization": cpu_init, "error": repr(exc)}  # fmt: skip
                    rec["seconds"] = round(time.perf_counter() - t0, 2)
                    print(json.dumps(rec), flush=True)
                    results["records"].append(rec)
    (args.out / "layer_conformance.json").write_text(json.dumps(results, indent=1))
    print(
        f"\nS={args.seq}, top-{args.topk}, seed {args.seed}; {env['gpu']}, torch {env['torch']}, "
        f"Triton {env['triton']}; scores: {args.scores}\n"
    )
    print("| model | use_cpu_initialization | profile | tables differ (layer vs engine) | "
          "Megatron angles differ (its inv_freq / built on the CPU) | q / k / k-scale / weights "
          "bytes differ (layer) | q + k bytes differ (reference) | rows identical (same scorer) "
          "| layer's own top-k rows identical |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(_row(r) for r in results["records"]))
    return 0 if all("error" not in r for r in results["records"]) else 1


@contextlib.contextmanager
def _megatron(device: str):
    """A single-process Megatron (TP = PP = CP = 1); on the CPU, Megatron's GPU requests answered
    there (``dsa_precision.testing.megatron.megatron_on_cpu``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from dsa_precision.testing.megatron import megatron_on_cpu

    started = not dist.is_initialized()
    if started:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    try:
        with megatron_on_cpu() if device == "cpu" else contextlib.nullcontext():
            yield
    finally:
        if started:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
