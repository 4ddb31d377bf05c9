"""The seam into Megatron's ``DSAttention.forward`` and the decisions taken once, on the CPU.

An owned (FP8) layer hands its top-k to Megatron's forward through a context-local staging
(``attention._Staging``) read by the ``skip_topk`` / ``index_share`` / ``source_layer`` properties
and the two holder methods. Checked here against the layer itself run alone, eagerly: no attribute
of the module changes during a call; a nested forward of the same or another layer while one is
staged computes its own picks; threads see no staging of another; activation recomputation
(``torch.utils.checkpoint``, reentrant and not) and interleaved micro-batches give the eager
outputs and gradients bit for bit. Megatron's own ``tensor_parallel.checkpoint`` needs CUDA: it
runs in tests/gpu/test_megatron.py. The config side: the precision fields are frozen once
validated, the Megatron fields they were validated against are re-validated on assignment.
"""

import argparse
import dataclasses
import threading
import unittest.mock

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import dsa_precision.megatron as dsap
from dsa_precision import IndexerPrecisionConfig, indexer_select, reset_scoring_calls, scoring_calls
from dsa_precision.audit import PrecisionMismatchError
from dsa_precision.megatron import attention as attention_module
from dsa_precision.megatron import config as config_module

from ..support.megatron import (
    CONFIGS,
    attention_inputs,
    make_attention,
    make_config,
    packed_params,
    run_attention,
)

FP8 = dict(dsa_indexer_scoring_precision="fp8")


def _shared_pair(**fields):
    """Layers 1 (computes, owned with FP8) and 2 (reads layer 1's top-k) of one sharing group."""
    config = make_config(**fields, dsa_indexer_topk_freq=2, num_layers=2)
    return make_attention(config), make_attention(config, layer_number=2)


def _stale_topk(like: torch.Tensor) -> torch.Tensor:
    """A causal top-k that is not the layer's: each row's first keys."""
    return torch.arange(like.shape[-1]).expand_as(like).contiguous().to(like.dtype)


# -------------------------------------------------------------------------------- the seam


def test_staging_changes_no_attribute_of_the_module():
    attn = make_attention(make_config(**FP8))
    inp = attention_inputs()
    topk = attn.compute_topk(inp["query"], inp["x"], inp["qr"], None)
    before = dict(vars(attn))
    built = dict(attn._built)
    assert (attn.skip_topk, attn.index_share, attn.source_layer) == (False, False, 1)
    with attention_module._Staging(attn, topk):
        assert (attn.skip_topk, attn.index_share, attn.source_layer) == (True, True, 1)
        assert attn._get_index_share_topk_holder(None, None) == {1: topk}
        assert attn._get_index_share_topk_length_holder(None, None) == {}
        now = dict(vars(attn))
        assert now.keys() == before.keys() and all(now[k] is before[k] for k in now)
        assert attn._built == built
    assert (attn.skip_topk, attn.index_share, attn.source_layer) == (False, False, 1)


def test_a_nested_forward_of_the_staged_layer_computes_its_own_top_k():
    """Reentrancy: the layer runs again (new inputs) while its top-k is staged; it attends to
    the picks of the new inputs, not the staged ones (the old route, which set ``skip_topk`` on
    the module, read the staged indices here)."""
    attn = make_attention(make_config(**FP8))
    first, second = attention_inputs(seed=0), attention_inputs(seed=1)
    alone = run_attention(attn, attention_inputs(seed=1))
    staged = _stale_topk(attn.compute_topk(first["query"], first["x"], first["qr"], None))
    with attention_module._Staging(attn, staged):
        nested = run_attention(attn, second)
        assert attn.skip_topk  # still staged for the outer call
    assert torch.equal(nested, alone)


@pytest.mark.parametrize("other", ["fp8", "bf16", "reader"])
def test_a_nested_forward_of_another_layer_leaves_the_staged_top_k(other):
    """While layer A's top-k is staged, layer B (owned FP8, Megatron's BF16, an index-share
    reader) runs as it runs alone, and A's Megatron forward then reads A's staged picks: its
    output is a stock Megatron reader's handed those picks through the holder."""
    layer_a = make_attention(make_config(**FP8))
    if other == "reader":
        source, layer_b = _shared_pair(**FP8)
        run_attention(source, attention_inputs(seed=5))  # fills the holder B reads
    else:
        layer_b = make_attention(make_config(**(FP8 if other == "fp8" else {})), seed=3)
    alone_b = run_attention(layer_b, attention_inputs(seed=2))
    inp = attention_inputs()
    topk = _stale_topk(layer_a.compute_topk(inp["query"], inp["x"], inp["qr"], None))
    with attention_module._Staging(layer_a, topk):
        nested_b = run_attention(layer_b, attention_inputs(seed=2))
        out_a = super(dsap.PrecisionDSAttention, layer_a).forward(
            inp["query"], inp["key"], None, None, inp["x"], inp["qr"],
            attn_mask_type=_causal(), up_v_weight=inp["up_v_weight"],
        )  # fmt: skip
    assert torch.equal(nested_b, alone_b)
    stock_cfg = make_config(config_module.MLATransformerConfig, dsa_indexer_topk_freq=2)
    reader = make_attention(stock_cfg, stock=True, layer_number=2)
    reader._get_index_share_topk_holder(None, None)[1] = topk
    assert torch.equal(out_a, run_attention(reader, attention_inputs()))


def _causal():
    from megatron.core.transformer.enums import AttnMaskType

    return AttnMaskType.causal


def test_another_thread_sees_no_staged_top_k():
    attn = make_attention(make_config(**FP8))
    inp = attention_inputs()
    seen = []
    with attention_module._Staging(attn, torch.zeros(2, 16, 8, dtype=torch.int32)):
        thread = threading.Thread(target=lambda: seen.append((attn.skip_topk, attn.index_share)))
        thread.start()
        thread.join()
        assert attn.skip_topk
    assert seen == [(False, False)]
    assert torch.isfinite(run_attention(attn, inp).float()).all()


def _run_pair(layers, inputs, recompute: str | None):
    outs = []
    for layer, inp in zip(layers, inputs, strict=True):
        args = (inp["query"], inp["key"], inp["x"], inp["qr"], inp["up_v_weight"])

        def fn(q, k, x, qr, up_v, layer=layer):
            return layer(q, k, None, None, x, qr, attn_mask_type=_causal(), up_v_weight=up_v)

        if recompute is None:
            outs.append(fn(*args))
        else:
            outs.append(checkpoint(fn, *args, use_reentrant=recompute == "reentrant"))
    return outs


@pytest.mark.parametrize("recompute", ["reentrant", "non_reentrant"])
def test_activation_recomputation_gives_the_eager_outputs_and_gradients(recompute):
    """Each layer's forward is rerun in the backward (the owned layer recomputes and restages
    its top-k, the reader reads the holder again): outputs and gradients are the eager ones."""
    results = {}
    for mode in (None, recompute):
        layers = _shared_pair(**FP8)
        inputs = [attention_inputs(seed=s) for s in (0, 1)]
        outs = _run_pair(layers, inputs, mode)
        sum(o.float().square().sum() for o in outs).backward()
        results[mode] = (outs, [(i["query"].grad, i["key"].grad) for i in inputs])
    (eager_out, eager_grads), (out, grads) = results[None], results[recompute]
    for a, b in zip(eager_out, out, strict=True):
        assert torch.equal(a, b)
    for (qa, ka), (qb, kb) in zip(eager_grads, grads, strict=True):
        assert torch.equal(qa, qb) and torch.equal(ka, kb)


def test_interleaved_micro_batches_give_the_sequential_gradients():
    """Forward micro-batch 1, forward micro-batch 2, backward 1, backward 2 (a pipeline
    schedule's order) against forward + backward of each in turn, on the same owned layer."""
    grads = {}
    for order in ("sequential", "interleaved"):
        attn = make_attention(make_config(**FP8))
        batches = [attention_inputs(seed=s) for s in (0, 1)]
        if order == "sequential":
            for inp in batches:
                run_attention(attn, inp).float().square().sum().backward()
        else:
            losses = [run_attention(attn, inp).float().square().sum() for inp in batches]
            for loss in losses:
                loss.backward()
        grads[order] = [(i["query"].grad, i["key"].grad) for i in batches]
    for (qa, ka), (qb, kb) in zip(grads["sequential"], grads["interleaved"], strict=True):
        assert torch.equal(qa, qb) and torch.equal(ka, kb)


def test_routing_state_is_decided_at_construction():
    attn = make_attention(make_config(**FP8, dsa_indexer_topk_freq=2, num_layers=2))
    with pytest.raises(AttributeError, match=r"DSA layer 1: skip_topk is decided when the layer"):
        attn.skip_topk = True
    with pytest.raises(AttributeError, match=r"index_share is decided .* \(it is True\)"):
        attn.index_share = False
    assert attn.owns_topk() and not attn.skip_topk and attn.index_share


# ----------------------------------------------------------------------- decided once


def test_a_forward_builds_and_validates_nothing(monkeypatch):
    """The precision, its validation and the preprocessing module are built with the layer; an
    FP8 forward constructs none of them again."""
    from dsa_precision import preprocess

    config = make_config(**FP8, dsa_indexer_rope_fp32=True)
    attn = make_attention(config)
    calls = []
    for owner, name in (
        (preprocess.IndexerPreprocess, "__init__"),
        (IndexerPrecisionConfig, "__post_init__"),
    ):
        real = getattr(owner, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    monkeypatch.setattr(
        config_module, "_validate_precision", lambda c: calls.append("validate") or 1 / 0
    )
    built = attn.indexer.preprocess()
    out = run_attention(attn, attention_inputs())
    out.float().sum().backward()
    assert calls == [] and attn.indexer.preprocess() is built
    assert attn.precision is config.dsa_indexer_precision


@pytest.mark.parametrize(
    "field, value",
    [
        ("dsa_indexer_topk_source", "replay"),
        ("dsa_indexer_topk_source", "everything"),
        ("dsa_indexer_scoring_precision", "bf16"),
        ("dsa_indexer_rope_fp32", True),
        ("dsa_indexer_engine", "sglang"),
        ("dsa_indexer_cuda_graph", True),
    ],
)
def test_precision_fields_are_frozen_once_validated(field, value):
    """Issue 17 item 8: a field changed after the layer is built is never read unvalidated; the
    assignment raises with the field's name, and the layer keeps its decision."""
    config = make_config(**FP8)
    attn = make_attention(config)
    before = getattr(config, field)
    with pytest.raises(AttributeError, match=rf"{field} is frozen .* asked {value!r}"):
        setattr(config, field, value)
    assert getattr(config, field) == before and attn.topk_source == "compute"
    setattr(config, field, before)  # the same value is no change
    changed = dataclasses.replace(config, dsa_indexer_scoring_precision="bf16")
    assert not changed.dsa_indexer_precision.fp8  # the documented way: a new config


def test_megatron_fields_behind_the_precision_are_revalidated():
    config = make_config(**FP8)
    with pytest.raises(ValueError, match=r"dsa_indexer_loss_coeff=0\.1 rejected \(kept 0\.0\)"):
        config.dsa_indexer_loss_coeff = 0.1
    assert config.dsa_indexer_loss_coeff == 0.0
    with pytest.raises(ValueError, match=r"dsa_indexer_scoring_relu=False rejected"):
        config.dsa_indexer_scoring_relu = False
    assert config.dsa_indexer_scoring_relu is True
    with pytest.raises(ValueError, match=r"'vllm' does not apply the Hadamard rotation"):
        config.dsa_indexer_rotate_activation = True  # the default profile's engine path has none
    assert not config.dsa_indexer_rotate_activation
    exact = make_config(**FP8, dsa_indexer_engine="vllm-exact")
    exact.dsa_indexer_rotate_activation = True  # still honoured there: accepted
    assert exact.dsa_indexer_rotate_activation
    plain = make_config()  # Megatron's behaviour: the indexer loss stays Megatron's to set
    plain.dsa_indexer_loss_coeff = 0.1
    assert plain.dsa_indexer_loss_coeff == 0.1


def test_a_plain_megatron_config_cannot_carry_loose_precision_fields():
    config = make_config(config_module.MLATransformerConfig)
    config.dsa_indexer_scoring_precision = "fp8"  # nothing would validate or freeze it
    with pytest.raises(TypeError, match=r"MLATransformerConfig carries dsa_indexer_scoring_prec"):
        make_attention(config)


# ------------------------------------------------------------ dsa_indexer_cuda_graph


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, r"dsa_indexer_cuda_graph=True: the graph replays the owned FP8 top-k"),
        (dict(**FP8, dsa_indexer_topk_source="replay"), r"'replay' does not score"),
    ],
)
def test_cuda_graph_needs_an_owned_fp8_top_k(fields, message):
    with pytest.raises(ValueError, match=message):
        make_config(dsa_indexer_cuda_graph=True, **fields)
    with pytest.raises(TypeError, match=r"dsa_indexer_cuda_graph='yes': pass True, False or"):
        make_config(dsa_indexer_cuda_graph="yes", **FP8)
    # The default, "auto", asks for nothing that could be refused: BF16 and replay take it.
    assert make_config(**fields).dsa_indexer_cuda_graph == "auto"


def test_cuda_graph_is_decided_per_layer_at_construction():
    config = make_config(**FP8, dsa_indexer_cuda_graph=True, dsa_indexer_topk_freq=2, num_layers=2)
    computing, reading = make_attention(config), make_attention(config, layer_number=2)
    assert computing._graphs is not None and len(computing._graphs) == 0
    assert reading._graphs is None  # it reuses layer 1's top-k: nothing to capture
    assert make_attention(make_config(**FP8, dsa_indexer_cuda_graph=False))._graphs is None
    assert make_attention(make_config())._graphs is None  # BF16: Megatron's own top-k
    auto = make_attention(make_config(**FP8))  # the default, "auto"
    assert auto._graphs is not None and len(auto._graphs) == 0


def test_auto_graphs_only_what_it_can_capture_and_runs_the_rest_eagerly():
    """dsa_indexer_cuda_graph="auto" (the default): a forward it cannot capture (CPU tensors
    here) or of more than AUTO_GRAPH_MAX_ROWS rows runs eagerly, without a word; True takes
    every forward (and raises on one it cannot capture: the test below)."""
    from dsa_precision.megatron.graphs import AUTO_GRAPH_MAX_ROWS

    auto = make_attention(make_config(**FP8))
    inp = attention_inputs()
    layout = auto.rank_layout(inp["query"], inp["x"], None)
    assert not auto.graph_applies(inp["x"], layout)  # on the CPU
    want = make_attention(make_config(**FP8, dsa_indexer_cuda_graph=False))
    assert torch.equal(
        auto.compute_topk(inp["query"], inp["x"], inp["qr"], None),
        want.compute_topk(inp["query"], inp["x"], inp["qr"], None),
    )
    assert len(auto._graphs) == 0
    cuda_like = torch.empty(AUTO_GRAPH_MAX_ROWS + 1, 1, 1, device="meta")
    with unittest.mock.patch.object(torch.Tensor, "is_cuda", True):
        assert auto.graph_applies(cuda_like[:AUTO_GRAPH_MAX_ROWS], layout)
        assert not auto.graph_applies(cuda_like, layout)  # longer: the device's bound
    forced = make_attention(make_config(**FP8, dsa_indexer_cuda_graph=True))
    assert forced.graph_applies(inp["x"], layout)


@pytest.mark.parametrize("rope_fp32", [False, True], ids=["fp8", "rope_fp32+fp8"])
@pytest.mark.parametrize(
    "rows, cu",
    [(64, [0, 20, 64]), (512, [0, 100, 300, 310, 400, 512]), (48, [0, 48])],
    ids=["pad_entry", "buckets", "one_sequence"],
)
def test_a_packed_graph_s_buckets_select_the_same_keys(rows, cu, rope_fp32):
    """What a packed forward's graph reads instead of the micro-batch's own metadata
    (graph_packing: cu_seqlens padded with empty sequences to a power-of-two count, the length
    bound rounded up) selects exactly the same keys and margins, eagerly on the CPU (torch
    scoring): the buckets change no pick."""
    from dsa_precision.megatron.graphs import _graph_packing

    config = make_config(**FP8, dsa_indexer_rope_fp32=rope_fp32, dsa_indexer_cuda_graph=False)
    attn = make_attention(config)
    inp = attention_inputs(sq=rows, b=1, packed=True)
    psp = packed_params(cu)
    layout = attn.rank_layout(inp["query"], inp["x"], psp)
    padded, bound = _graph_packing(layout, rows, torch.device("cpu"))
    n = len(cu)
    assert padded.numel() == max(2, 1 << (n - 1).bit_length()) and padded.dtype == torch.int32
    assert padded[:n].tolist() == cu and set(padded[n:].tolist()) <= {cu[-1]}
    longest = psp.max_seqlen_q
    pow2 = max(256, 1 << (longest - 1).bit_length())
    assert bound == (longest if longest == rows else min(pow2, rows - 1))
    bucketed = packed_params(cu)
    bucketed.cu_seqlens_q = bucketed.cu_seqlens_kv = padded
    bucketed.max_seqlen_q = bucketed.max_seqlen_kv = bound
    args = (inp["query"], inp["x"], inp["qr"])
    for margins in (False, True):
        want = attn.compute_topk(*args, psp, margins=margins)
        got = attn.compute_topk(*args, bucketed, margins=margins)
        for a, b in zip(*(t if margins else (t,) for t in (want, got)), strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (rows, cu, margins)


def test_cuda_graph_refuses_a_forward_it_cannot_capture():
    """An explicit request that cannot be honoured raises, naming the field (CPU tensors here;
    the CUDA cases -- replays bit for bit, recapture on new parameter storage -- are GPU tests)."""
    attn = make_attention(make_config(**FP8, dsa_indexer_cuda_graph=True))
    inp = attention_inputs()
    with pytest.raises(RuntimeError, match=r"dsa_indexer_cuda_graph=True cannot capture .* on cpu"):
        attn.compute_topk(inp["query"], inp["x"], inp["qr"], None)
    with pytest.raises(RuntimeError, match=r"layer 1: dsa_indexer_cuda_graph=True cannot capture"):
        run_attention(attn, inp)


def test_cuda_graph_flag_round_trips_through_megatron_args():

    parser = dsap.add_dsa_precision_args(argparse.ArgumentParser())
    for flag, field in (("true", True), ("false", False), ("auto", "auto")):
        args = parser.parse_args(["--dsa-indexer-cuda-graph", flag])
        assert config_module._graph_flag(args.dsa_indexer_cuda_graph) == field
    assert parser.parse_args([]).dsa_indexer_cuda_graph == "auto"
    with pytest.raises(SystemExit):  # argparse names the choices
        parser.parse_args(["--dsa-indexer-cuda-graph", "yes"])


def test_an_mla_config_without_an_indexer_takes_the_fields():
    """Megatron-LM's own MLA tests (test_absorbed_mla) build configs with no DSA indexer; the
    fields have nothing to act on there (a spec builder refuses a spec without a DSA layer for
    them), so the config does not ask for indexer heads."""
    config = make_config(
        experimental_attention_variant=None,
        dsa_indexer_n_heads=None,
        dsa_indexer_head_dim=None,
        dsa_indexer_rope_fp32=True,
        dsa_indexer_engine="vllm-exact",
    )
    assert config.dsa_indexer_precision.rope_fp32
    with pytest.raises(ValueError, match=r"dsa_indexer_n_heads=None must be a positive integer"):
        make_config(dsa_indexer_n_heads=None, dsa_indexer_rope_fp32=True)  # width without heads


def _snapshot() -> dict[str, object]:
    """Every attribute of megatron-core's DSA modules and classes, by identity."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.experimental_attention_variant import (
        dsa,
        dsa_cudnn_kernels,
        dsa_kernels,
        dsa_layout,
        dsa_masking,
    )

    out = {}
    for module in (dsa, dsa_cudnn_kernels, dsa_kernels, dsa_layout, dsa_masking, rope_utils):
        for name, value in vars(module).items():
            out[f"{module.__name__}.{name}"] = value
            if isinstance(value, type) and value.__module__ == module.__name__:
                for attr, member in vars(value).items():
                    out[f"{module.__name__}.{name}.{attr}"] = member
    return out


def test_building_and_running_the_drop_ins_changes_no_megatron_attribute():
    before = _snapshot()
    for name, fields in CONFIGS.items():
        config = make_config(**fields, dsa_indexer_topk_freq=2, num_layers=2)
        first, second = make_attention(config), make_attention(config, layer_number=2)
        inputs = attention_inputs()
        first_out = run_attention(first, inputs)
        first_out.float().sum().backward()
        run_attention(second, attention_inputs())
        assert torch.isfinite(first_out.float()).all(), name
    after = _snapshot()
    changed = [k for k in before if after.get(k) is not before[k]]
    assert not changed and set(after) == set(before), changed


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
@pytest.mark.parametrize("share", [False, True], ids=["own", "index_share"])
def test_default_configuration_is_bit_identical_to_stock(packed, share):
    extra = dict(dsa_indexer_topk_freq=2, num_layers=2) if share else {}
    ours_cfg = make_config(**extra)
    stock_cfg = make_config(**extra)
    ours = [make_attention(ours_cfg, layer_number=n) for n in (1, 2)]
    stock = [make_attention(stock_cfg, stock=True, layer_number=n) for n in (1, 2)]
    for a, b in zip(ours, stock, strict=True):
        b.load_state_dict(a.state_dict())
    kw = {}
    if packed:
        kw_a, kw_b = dict(packed_seq_params=packed_params([0, 5, 16])), {}
        kw_b["packed_seq_params"] = packed_params([0, 5, 16])
    else:
        kw_a = kw_b = kw
    a_in = [attention_inputs(b=1 if packed else 2, packed=packed) for _ in range(2)]
    b_in = [attention_inputs(b=1 if packed else 2, packed=packed) for _ in range(2)]
    for layers, inputs, kwargs in ((ours, a_in, kw_a), (stock, b_in, kw_b)):
        outs = [
            run_attention(layer, inp, **kwargs) for layer, inp in zip(layers, inputs, strict=True)
        ]
        sum(o.float().sum() for o in outs).backward()
        inputs.append(outs)
    for a, b in zip(a_in[2], b_in[2], strict=True):
        assert torch.equal(a, b)
    for i in range(2):
        assert torch.equal(a_in[i]["query"].grad, b_in[i]["query"].grad)
        assert torch.equal(a_in[i]["key"].grad, b_in[i]["key"].grad)


@pytest.mark.parametrize("rope_fp32", [False, True], ids=["fp8", "rope_fp32+fp8"])
@pytest.mark.parametrize("batch", [1, 2])
def test_fp8_top_k_is_the_package_selection_of_the_layer_operands(rope_fp32, batch):
    config = make_config(dsa_indexer_scoring_precision="fp8", dsa_indexer_rope_fp32=rope_fp32)
    attn = make_attention(config)
    inp = attention_inputs(b=batch)
    reset_scoring_calls()
    topk = attn.compute_topk(inp["query"], inp["x"], inp["qr"], None)
    assert scoring_calls("fp8") >= 1 and scoring_calls("bf16") == 0
    ops = attn.indexer.scoring_operands(inp["x"], inp["qr"])
    assert ops.q.dtype == torch.float8_e4m3fn
    assert torch.equal(topk, indexer_select(ops, topk=8))


def test_fp8_packed_top_k_has_global_packed_key_rows():
    from dsa_precision import indexer_select_varlen

    config = make_config(dsa_indexer_scoring_precision="fp8")
    attn = make_attention(config)
    inp = attention_inputs(b=1, packed=True)
    cu = [0, 3, 9, 16]
    topk = attn.compute_topk(inp["query"], inp["x"], inp["qr"], packed_params(cu))
    ops = attn.indexer.scoring_operands(inp["x"], inp["qr"], packed_params(cu))
    t = torch.tensor(cu, dtype=torch.int32)
    local = indexer_select_varlen(
        ops, topk=8, cu_seqlens_q=t, cu_seqlens_k=t, max_seqlen_q=7, max_seqlen_k=7
    )
    starts = torch.repeat_interleave(t[:-1], t[1:] - t[:-1])
    want = torch.where(local >= 0, local + starts[:, None], local)
    assert topk.shape == (1, 16, 8) and torch.equal(topk[0], want)


def test_fp8_attention_is_megatrons_attention_on_the_owned_indices():
    """A stock Megatron skip layer handed the owned indices through its index-share holder
    produces the same output and gradients as the FP8 layer."""
    config = make_config(dsa_indexer_scoring_precision="fp8")
    ours = make_attention(config)
    stock_cfg = make_config(make_config().__class__.__mro__[1], dsa_indexer_topk_freq=2)
    reader = make_attention(stock_cfg, stock=True, layer_number=2)
    a, b = attention_inputs(), attention_inputs()
    topk = ours.compute_topk(a["query"], a["x"], a["qr"], None)
    reader._get_index_share_topk_holder(None, None)[1] = topk
    out_a, out_b = run_attention(ours, a), run_attention(reader, b)
    assert torch.equal(out_a, out_b)
    out_a.float().sum().backward()
    out_b.float().sum().backward()
    assert torch.equal(a["query"].grad, b["query"].grad)


def test_fp8_index_sharing_hands_the_owned_indices_to_the_next_layer():
    config = make_config(dsa_indexer_scoring_precision="fp8", dsa_indexer_topk_freq=2, num_layers=2)
    first, second = make_attention(config), make_attention(config, layer_number=2)
    assert first.owns_topk() and not second.owns_topk() and second.indexer is None
    inp = attention_inputs()
    run_attention(first, inp)
    holder = second._get_index_share_topk_holder(None, None)
    assert torch.equal(holder[1], first.compute_topk(inp["query"], inp["x"], inp["qr"], None))
    assert torch.isfinite(run_attention(second, attention_inputs()).float()).all()
    assert not first.skip_topk and first.index_share  # the reader state is restored


def test_attention_needs_the_precision_indexer():
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsa_module_spec_for_backend,
    )
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    config = make_config()
    spec = get_dsa_module_spec_for_backend(config, backend=dsap.LocalDSASpecProvider())
    core = dataclasses.replace(spec.submodules.core_attention, module=dsap.PrecisionDSAttention)
    with pytest.raises(TypeError, match="needs a PrecisionDSAIndexer, got DSAIndexer"):
        build_module(
            core, config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
            attention_type="self",
        )  # fmt: skip


def test_strict_mode_catches_a_scoring_call_in_another_precision(monkeypatch):
    monkeypatch.setenv("DSA_PRECISION_STRICT", "1")
    config = make_config(dsa_indexer_scoring_precision="fp8")
    attn = make_attention(config)
    run_attention(attn, attention_inputs())  # the configured path passes
    bf16 = IndexerPrecisionConfig()
    # A defect that prepares BF16 operands for an FP8 layer is caught at its scoring call.
    monkeypatch.setattr(attn.indexer, "_precision", bf16)
    with pytest.raises(PrecisionMismatchError, match=r"ran in bf16 .* but fp8 is configured"):
        run_attention(attn, attention_inputs())
