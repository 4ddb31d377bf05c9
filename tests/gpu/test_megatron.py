"""The Megatron drop-ins on an SM90 GPU (megatron-core 0.19, Megatron's own sparse attention:
``dsa_kernel_backend="none"`` because FlashMLA is not installed on the test host).

Checked against: stock Megatron (default fields, bit for bit), the torch reference of the
package on the same operands (the owned FP8 top-k), replays (bit-exact), and the host
synchronisation debug mode (the owned top-k never waits for the host).
"""

import contextlib
import itertools

import pytest
import torch

from ..support.helpers import needs_deepgemm, no_host_sync

pytestmark = pytest.mark.gpu

HIDDEN, Q_LORA, KV_LORA, ROPE, HEADS = 512, 128, 512, 64, 16


@pytest.fixture(scope="module")
def dsap(megatron_parallel_gpu):
    import dsa_precision.megatron as dsap

    return dsap


def _config(dsap, stock=False, **overrides):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    cls = MLATransformerConfig if stock else dsap.DSAPrecisionTransformerConfig
    # Megatron's default Hadamard needs fast_hadamard_transform, which the GPU host lacks.
    overrides.setdefault("dsa_indexer_rotate_activation", False)
    overrides.setdefault("dsa_indexer_topk", 256)
    return cls(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, bf16=True,
        params_dtype=torch.bfloat16, q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_head_dim=128,
        qk_pos_emb_head_dim=ROPE, v_head_dim=128, add_bias_linear=False, apply_rope_fusion=False,
        experimental_attention_variant="dsa", dsa_indexer_n_heads=32, dsa_indexer_head_dim=128,
        dsa_indexer_loss_coeff=0.0, rope_type="rope",
        layernorm_epsilon=1e-6,  # the indexer k_norm eps vLLM and LMDeploy hard-code
        **overrides,
    )  # fmt: skip


def _have_te() -> bool:
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as specs

    return bool(specs.HAVE_TE)


def _spec_backend(dsap, spec: str):
    """The spec backend: the package's local one, or Transformer Engine's (``"te"``), the one
    real training builds its layers from."""
    if spec == "local":
        return dsap.LocalDSASpecProvider()
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        TESpecProvider,
    )

    return TESpecProvider()


# The two specs a layer is built from; TE's where Transformer Engine is installed.
SPECS = [
    pytest.param("local", id="local_spec"),
    pytest.param(
        "te",
        id="te_spec",
        marks=pytest.mark.skipif(
            not _have_te(), reason="Transformer Engine is not installed (its spec)"
        ),
    ),
]


def _attention(dsap, config, stock=False, layer_number=1, spec="local"):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsa_module_spec_for_backend,
    )
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    build = get_dsa_module_spec_for_backend if stock else dsap.get_dsa_precision_module_spec
    spec = build(config, backend=_spec_backend(dsap, spec))
    attn = build_module(
        spec.submodules.core_attention, config=config, layer_number=layer_number,
        attn_mask_type=AttnMaskType.causal, attention_type="self",
    )  # fmt: skip
    return attn.cuda().bfloat16()  # as Megatron's Float16Module leaves the parameters


def _inputs(s=2048, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    d = KV_LORA + ROPE

    def r(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)

    return (
        r(s, 1, HEADS, d).requires_grad_(),
        r(s, 1, 1, d).requires_grad_(),
        r(s, 1, HIDDEN),
        r(s, 1, Q_LORA),
        r(HEADS, 128, KV_LORA),
    )


def _forward(attn):
    from megatron.core.transformer.enums import AttnMaskType

    def run(query, key, x, qr, up_v):
        return attn(
            query, key, None, None, x, qr, attn_mask_type=AttnMaskType.causal, up_v_weight=up_v
        )

    return run


CONFIGS = {
    "baseline": {},
    "rope_fp32": {"dsa_indexer_rope_fp32": True},
    "fp8": {"dsa_indexer_scoring_precision": "fp8"},
    "rope_fp32+fp8": {"dsa_indexer_rope_fp32": True, "dsa_indexer_scoring_precision": "fp8"},
    # FP32 weights GEMM, Hadamard (the package's own transform on the rope_fp32 path)
    "sglang-unfused": {
        "dsa_indexer_rope_fp32": True,
        "dsa_indexer_scoring_precision": "fp8",
        "dsa_indexer_engine": "sglang-unfused",
        "dsa_indexer_rotate_activation": True,
    },
}


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("topk_freq", [1, 2], ids=["own_topk", "index_share"])
def test_attention_replays_bit_exact(dsap, name, topk_freq, spec):
    from dsa_precision.testing import assert_replays_bit_exact

    config = _config(dsap, dsa_indexer_topk_freq=topk_freq, **CONFIGS[name])
    attn = _attention(dsap, config, spec=spec)
    assert_replays_bit_exact(
        _forward(attn), _inputs(), backward=True, contention=True, what=f"DSAttention {name}"
    )


@pytest.mark.parametrize("spec", SPECS)
def test_default_fields_are_stock_megatron_on_the_gpu(dsap, spec):
    ours = _attention(dsap, _config(dsap), spec=spec)
    stock = _attention(dsap, _config(dsap, stock=True), stock=True, spec=spec)
    stock.load_state_dict(ours.state_dict())
    a, b = _inputs(), _inputs()
    out_a, out_b = _forward(ours)(*a), _forward(stock)(*b)
    assert torch.equal(out_a, out_b)
    out_a.float().sum().backward()
    out_b.float().sum().backward()
    assert torch.equal(a[0].grad, b[0].grad) and torch.equal(a[1].grad, b[1].grad)


BACKENDS = ["cudnn", pytest.param("deepgemm", marks=needs_deepgemm)]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("engine", ["vllm-exact", "vllm", "lmdeploy"])
def test_fp8_owned_top_k_on_each_backend(dsap, record, engine, backend, spec):
    from dsa_precision import indexer_select, reset_scoring_calls, scoring_calls, topk_agreement

    config = _config(
        dsap,
        dsa_indexer_rope_fp32=True,
        dsa_indexer_scoring_precision="fp8",
        dsa_indexer_engine=engine,
        dsa_indexer_scoring_backend=backend,
    )
    attn = _attention(dsap, config, spec=spec)
    query, _, x, qr, _ = _inputs()
    reset_scoring_calls()
    topk = attn.compute_topk(query, x, qr, None)
    assert attn.scoring_backend == backend
    assert scoring_calls("fp8", backend) >= 1 and scoring_calls() == scoring_calls("fp8")
    ops = attn.indexer.scoring_operands(x, qr)
    assert ops.q.dtype == torch.float8_e4m3fn and ops.q.is_cuda
    exact = indexer_select(ops, topk=256, backend="torch")
    agreement = topk_agreement(topk, exact).as_dict()
    record("megatron_owned_topk", engine=engine, backend=backend, spec=spec, **agreement)
    # The kernel sums in another order than the exact reference: rows may differ at their
    # boundary only, by one key (measured on the H200, local and TE specs: 0.99986-0.99992 of the
    # members, at most 1 key in a row, no broken row).
    assert agreement["broken_rows"] == 0 and agreement["flipped_max"] <= 1
    assert agreement["member_agreement"] >= 0.9995


def test_auto_backend_is_deepgemm_when_installed_else_cudnn(dsap):
    """The default dsa_indexer_scoring_backend ("auto"): the layer's FP8 scoring runs on
    DeepGEMM where it imports (the engines' own kernel, the fastest), on cuDNN otherwise."""
    from dsa_precision import reset_scoring_calls, scoring_calls
    from dsa_precision.backends import deepgemm

    config = _config(dsap, dsa_indexer_rope_fp32=True, dsa_indexer_scoring_precision="fp8")
    attn = _attention(dsap, config)
    query, _, x, qr, _ = _inputs()
    reset_scoring_calls()
    attn.compute_topk(query, x, qr, None)
    want = "deepgemm" if deepgemm._deepgemm_available() else "cudnn"
    assert attn.scoring_backend == want and scoring_calls("fp8", want) == scoring_calls() >= 1


@pytest.mark.parametrize(
    "packed, lengths", [(False, None), (True, "cuda"), (True, "cpu")],
    ids=["bshd", "thd", "thd_host_lengths"],
)  # fmt: skip
def test_owned_top_k_never_waits_for_the_host(dsap, packed, lengths):
    """No host synchronisation in the owned top-k, packed lengths on the device or on the host
    (checked there, then copied without waiting for the stream)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    config = _config(dsap, dsa_indexer_rope_fp32=True, dsa_indexer_scoring_precision="fp8")
    attn = _attention(dsap, config)
    query, _, x, qr, _ = _inputs()
    psp = None
    if packed:
        cu = torch.tensor([0, 300, 301, 1400, 2048], dtype=torch.int32, device=lengths)
        psp = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=1100,
            max_seqlen_kv=1100,
        )  # fmt: skip
    want = attn.compute_topk(query, x, qr, psp)  # warm-up: compiles the kernels
    with no_host_sync():
        got = attn.compute_topk(query, x, qr, psp)
    assert torch.equal(got, want)


def _packed_params(packed: bool):
    from megatron.core.packed_seq_params import PackedSeqParams

    if not packed:
        return None
    cu = torch.tensor([0, 300, 301, 1400, 2048], dtype=torch.int32, device="cuda")
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=1100, max_seqlen_kv=1100
    )


def _layer_step(dsap, name, topk_freq, packed):
    """Layers 1 and 2 of an FP8 model (with topk_freq=2 layer 2 reads layer 1's top-k) and a
    step: forward of both, backward; returns the output and the query / key gradients."""
    from megatron.core.transformer.enums import AttnMaskType

    config = _config(dsap, dsa_indexer_topk_freq=topk_freq, **CONFIGS[name])
    layers = [_attention(dsap, config, layer_number=n) for n in (1, 2)]
    psp = _packed_params(packed)  # built before the step: a host-to-device copy of the lengths

    def step(inputs):
        outs = []
        for layer, (query, key, x, qr, up_v) in zip(layers, inputs, strict=True):
            if packed:
                query, key = query.view(query.shape[0], *query.shape[2:]), key[:, 0]
            outs.append(
                layer(
                    query, key, None, None, x, qr, attn_mask_type=AttnMaskType.causal,
                    up_v_weight=up_v, packed_seq_params=psp,
                )
            )  # fmt: skip
        sum(o.float().square().sum() for o in outs).backward()
        return [o.detach() for o in outs] + [t.grad for inp in inputs for t in inp[:2]]

    return step


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
@pytest.mark.parametrize("topk_freq", [1, 2], ids=["own_topk", "index_share"])
@pytest.mark.parametrize("name", ["fp8", "rope_fp32+fp8"])
def test_fp8_layer_forward_and_backward_never_wait_for_the_host(dsap, name, topk_freq, packed):
    """Issue 19 item 3: the default FP8 step (the package's owned top-k, the seam, Megatron's
    sparse attention, the backward) runs under ``set_sync_debug_mode("error")``."""
    step = _layer_step(dsap, name, topk_freq, packed)
    want = step([_inputs(seed=s) for s in (0, 1)])  # warm-up: compiles the kernels
    inputs = [_inputs(seed=s) for s in (0, 1)]
    with no_host_sync():
        got = step(inputs)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("topk_freq", [1, 2], ids=["own_topk", "index_share"])
def test_megatron_recompute_gives_the_eager_gradients(dsap, topk_freq):
    """Megatron's activation recomputation (``tensor_parallel.checkpoint``, what
    ``recompute_granularity`` uses) reruns each FP8 layer in the backward: the owned layer
    restages its top-k, the reader reads the holder again; outputs and gradients are eager's."""
    from megatron.core import tensor_parallel

    config = _config(dsap, dsa_indexer_topk_freq=topk_freq, **CONFIGS["rope_fp32+fp8"])
    layers = [_attention(dsap, config, layer_number=n) for n in (1, 2)]
    results = []
    for recompute in (False, True):
        inputs = [_inputs(seed=s) for s in (0, 1)]
        outs = []
        for layer, args in zip(layers, inputs, strict=True):
            run = _forward(layer)
            outs.append(tensor_parallel.checkpoint(run, False, *args) if recompute else run(*args))
        sum(o.float().square().sum() for o in outs).backward()
        results.append([o.detach() for o in outs] + [t.grad for inp in inputs for t in inp[:2]])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_fp8_layer_forward_replays_from_a_cuda_graph(dsap):
    """CUDA-graph capture of the FP8 layer forward (owned top-k staged through the seam): the
    replay on new inputs copied into the static buffers gives the eager output."""
    config = _config(dsap, **CONFIGS["rope_fp32+fp8"])
    attn = _attention(dsap, config)
    run = _forward(attn)
    static = [t.detach().clone() for t in _inputs(seed=0)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(2):  # warm-up on a side stream, as torch.cuda.graph requires
            run(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = run(*static)
    fresh = [t.detach() for t in _inputs(seed=3)]
    for buffer, value in zip(static, fresh, strict=True):
        buffer.copy_(value)
    graph.replay()
    with torch.no_grad():
        want = run(*fresh)
    assert torch.equal(out, want)


# ------------------------------------------------------------ dsa_indexer_cuda_graph


def _graph_pair(dsap, **overrides):
    """The same FP8 layer (same weights) eager and with ``dsa_indexer_cuda_graph``."""
    fields = dict(CONFIGS["rope_fp32+fp8"], **overrides)
    eager = _attention(dsap, _config(dsap, **fields))
    graphed = _attention(dsap, _config(dsap, dsa_indexer_cuda_graph=True, **fields))
    graphed.load_state_dict(eager.state_dict())
    return eager, graphed


@pytest.mark.parametrize("backend", BACKENDS)
def test_graphed_top_k_is_the_eager_top_k_on_every_step(dsap, backend):
    """Captured on the first call, replayed on new inputs: the eager picks bit for bit, with
    the scoring calls counted per replay (the capture itself launches none) and no host
    synchronisation on a replay, on each scoring backend."""
    from dsa_precision import reset_scoring_calls, scoring_calls

    eager, graphed = _graph_pair(dsap, dsa_indexer_scoring_backend=backend)
    for seed in range(3):
        query, _, x, qr, _ = _inputs(seed=seed)
        reset_scoring_calls()
        with no_host_sync() if seed == 2 else contextlib.nullcontext():
            got = graphed.compute_topk(query, x, qr, None)
        calls = 3 if seed == 0 else 1  # the first call: two warm-up runs, the capture, a replay
        assert scoring_calls("fp8", backend) == calls and scoring_calls() == calls
        assert torch.equal(got, eager.compute_topk(query, x, qr, None)), seed
    assert len(graphed._graphs) == 1 and graphed.scoring_backend == backend
    # verify's margins: another graph, the eager picks and margins
    picks, margins = graphed.compute_topk(query, x, qr, None, margins=True)
    want_picks, want_margins = eager.compute_topk(query, x, qr, None, margins=True)
    assert torch.equal(picks, want_picks)
    assert torch.equal(margins.view(torch.int32), want_margins.view(torch.int32))  # NaN: the bits
    assert len(graphed._graphs) == 2


def test_graphed_top_k_follows_the_parameters(dsap):
    """An in-place update (the optimizer's) is read by the next replay; new storage for a
    parameter, or a new Parameter object, captures again; another sequence length captures its
    own graph."""
    eager, graphed = _graph_pair(dsap)
    query, _, x, qr, _ = _inputs(seed=0)
    first = graphed.compute_topk(query, x, qr, None)
    with torch.no_grad():
        for a, b in zip(eager.indexer.parameters(), graphed.indexer.parameters(), strict=True):
            noise = torch.randn_like(a) * 0.5
            a.add_(noise)
            b.add_(noise)
    got = graphed.compute_topk(query, x, qr, None)
    assert not torch.equal(got, first)
    assert torch.equal(got, eager.compute_topk(query, x, qr, None))
    assert len(graphed._graphs) == 1
    with torch.no_grad():
        weight = graphed.indexer.linear_wk.weight
        first_storage = weight.data  # kept: the new storage cannot reuse its address
        weight.data = first_storage.clone()
    assert torch.equal(
        graphed.compute_topk(query, x, qr, None), eager.compute_topk(query, x, qr, None)
    )
    assert len(graphed._graphs) == 2
    with torch.no_grad():  # a new Parameter object (a reload that replaces the module's);
        # `weight` keeps the second storage alive, so the new one has an address of its own
        graphed.indexer.linear_wk.weight = torch.nn.Parameter(weight.data.clone())
        graphed.indexer.linear_wk.weight.mul_(-1)
        eager.indexer.linear_wk.weight.mul_(-1)
    assert torch.equal(
        graphed.compute_topk(query, x, qr, None), eager.compute_topk(query, x, qr, None)
    )
    assert len(graphed._graphs) == 3
    query, _, x, qr, _ = _inputs(s=1024, seed=1)
    assert torch.equal(
        graphed.compute_topk(query, x, qr, None), eager.compute_topk(query, x, qr, None)
    )
    assert len(graphed._graphs) == 4


@pytest.mark.parametrize("topk_freq", [1, 2], ids=["own_topk", "index_share"])
def test_graphed_layer_trains_as_the_eager_layer(dsap, topk_freq):
    """Two layers, forward and backward, three steps on new inputs: outputs and gradients of the
    graphed layers equal the eager ones bit for bit."""
    from megatron.core.transformer.enums import AttnMaskType

    results = []
    for graph in (False, True):
        config = _config(dsap, dsa_indexer_topk_freq=topk_freq, dsa_indexer_cuda_graph=graph,
                         **CONFIGS["rope_fp32+fp8"])  # fmt: skip
        layers = [_attention(dsap, config, layer_number=n) for n in (1, 2)]
        run = []
        for step in range(3):
            inputs = [_inputs(seed=10 * step + n) for n in (0, 1)]
            outs = [
                layer(q, k, None, None, x, qr, attn_mask_type=AttnMaskType.causal, up_v_weight=v)
                for layer, (q, k, x, qr, v) in zip(layers, inputs, strict=True)
            ]
            sum(o.float().square().sum() for o in outs).backward()
            run += [o.detach() for o in outs] + [t.grad for inp in inputs for t in inp[:2]]
        results.append(run)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_a_new_layer_captures_after_every_graph_is_gone(dsap):
    """The shared pool of a device whose graphs were all dropped (models deleted) is not reused:
    a new layer captures into a new one."""
    import gc

    query, _, x, qr, _ = _inputs(seed=4)
    _, graphed = _graph_pair(dsap)
    want = graphed.compute_topk(query, x, qr, None)
    del graphed
    gc.collect()
    eager, graphed = _graph_pair(dsap)
    assert torch.equal(graphed.compute_topk(query, x, qr, None), want)
    assert torch.equal(want, eager.compute_topk(query, x, qr, None))


def test_graphed_top_k_follows_the_preprocessing_fields(dsap):
    """A Megatron field the preprocessing follows per forward (here the RoPE layout), changed
    after a capture, captures again: the replay never runs the old preprocessing."""
    eager, graphed = _graph_pair(dsap)
    query, _, x, qr, _ = _inputs(seed=6)
    before = graphed.compute_topk(query, x, qr, None)
    for layer in (eager, graphed):
        layer.config.dsa_indexer_rope_interleaved = True
    got = graphed.compute_topk(query, x, qr, None)
    assert torch.equal(got, eager.compute_topk(query, x, qr, None))
    assert not torch.equal(got, before) and len(graphed._graphs) == 2


def test_a_graph_captured_in_inference_mode_serves_training(dsap):
    """Log-probs recomputed under inference mode first, then the training forward: the graph's
    static buffers are not inference tensors."""
    eager, graphed = _graph_pair(dsap)
    query, _, x, qr, _ = _inputs(seed=7)
    with torch.inference_mode():
        first = graphed.compute_topk(query, x, qr, None)
    got = graphed.compute_topk(query, x, qr, None)
    assert torch.equal(got, first) and torch.equal(got, eager.compute_topk(query, x, qr, None))


def test_graphs_are_dropped_least_recently_used_and_a_copy_captures_its_own(dsap):
    import copy

    from dsa_precision import reset_scoring_calls, scoring_calls

    _, graphed = _graph_pair(dsap)
    graphed._graphs._max = 2
    lengths = {n: _inputs(s=n, seed=n) for n in (512, 768, 1024)}

    def call(n):
        query, _, x, qr, _ = lengths[n]
        reset_scoring_calls()
        out = graphed.compute_topk(query, x, qr, None)
        return out, scoring_calls()  # 3 for a capture (two warm-ups and the replay), else 1

    for n, calls in ((512, 3), (768, 3), (512, 1), (1024, 3), (512, 1), (768, 3)):
        assert call(n)[1] == calls, n
    twin = copy.deepcopy(graphed._graphs)  # a copied layer captures its own graphs
    assert len(graphed._graphs) == 2 and len(twin) == 0 and twin._max == 2


def _packed(cu: list[int], longest: int | None = None):
    from megatron.core.packed_seq_params import PackedSeqParams

    t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    m = longest or max(b - a for a, b in itertools.pairwise(cu))
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=t, cu_seqlens_kv=t, max_seqlen_q=m, max_seqlen_kv=m
    )


def test_packed_micro_batches_replay_one_graph_per_bucket(dsap):
    """Packed (THD) forwards from CUDA graphs: micro-batches of other sequence counts and
    lengths in one bucket (cu_seqlens padded to a power-of-two count, the length bound rounded
    up) replay one graph; the eager picks (and margins) bit for bit, no host synchronisation on
    a replay; another bucket captures its own."""
    eager, graphed = _graph_pair(dsap)
    query, _, x, qr, _ = _inputs(seed=11)
    batches = [  # cu_seqlens entries -> their bucket, longest -> its bound (rows 2048)
        [0, 300, 301, 1400, 2048],  # 5 -> 8, 1099 -> 2047 (a power of two below the rows)
        [0, 900, 1000, 2048],  # 4 -> 4, 1048 -> 2047: another bucket
        [0, 1100, 1700, 1701, 2048],  # 5 -> 8, 1100 -> 2047: the first graph again
        [0, 512, 1024, 1536, 1800, 2000, 2048],  # 7 -> 8, 512 -> 512: a third graph
    ]
    graphs = [1, 2, 2, 3]
    for i, (cu, n) in enumerate(zip(batches, graphs, strict=True)):
        psp = _packed(cu)
        with no_host_sync() if i == 2 else contextlib.nullcontext():
            got = graphed.compute_topk(query, x, qr, psp)
        assert torch.equal(got, eager.compute_topk(query, x, qr, psp)), cu
        assert len(graphed._graphs) == n, cu
    psp = _packed(batches[0])
    picks, margins = graphed.compute_topk(query, x, qr, psp, margins=True)
    want_picks, want_margins = eager.compute_topk(query, x, qr, psp, margins=True)
    assert torch.equal(picks, want_picks)
    assert torch.equal(margins.view(torch.int32), want_margins.view(torch.int32))


def test_the_default_graphs_short_forwards_and_runs_long_ones_eagerly(dsap):
    """dsa_indexer_cuda_graph's default, "auto": a forward of at most AUTO_GRAPH_MAX_ROWS rows
    replays from a graph (the eager picks bit for bit), a longer one runs eagerly."""
    from dsa_precision.megatron.graphs import AUTO_GRAPH_MAX_ROWS

    fields = CONFIGS["rope_fp32+fp8"]
    auto = _attention(dsap, _config(dsap, **fields))
    eager = _attention(dsap, _config(dsap, dsa_indexer_cuda_graph=False, **fields))
    eager.load_state_dict(auto.state_dict())
    assert auto.config.dsa_indexer_cuda_graph == "auto"
    query, _, x, qr, _ = _inputs(seed=12)
    for _ in range(2):
        assert torch.equal(
            auto.compute_topk(query, x, qr, None), eager.compute_topk(query, x, qr, None)
        )
    assert len(auto._graphs) == 1
    query, _, x, qr, _ = _inputs(s=AUTO_GRAPH_MAX_ROWS + 512, seed=13)
    assert torch.equal(
        auto.compute_topk(query, x, qr, None), eager.compute_topk(query, x, qr, None)
    )
    assert len(auto._graphs) == 1  # not captured


def test_layers_share_the_static_buffers_of_their_graphs(dsap):
    """Every graph reads its inputs from and writes its result to buffers shared by all graphs
    of one layout: two layers, replayed in turn on other inputs, each give their own eager
    picks."""
    from dsa_precision.megatron import graphs

    fields = CONFIGS["rope_fp32+fp8"]
    layers = []
    for n in (1, 2):
        eager = _attention(
            dsap, _config(dsap, dsa_indexer_cuda_graph=False, **fields), layer_number=n
        )
        graphed = _attention(
            dsap, _config(dsap, dsa_indexer_cuda_graph=True, **fields), layer_number=n
        )
        with torch.no_grad():
            for p in eager.indexer.parameters():
                p.add_(torch.randn_like(p) * 0.1 * n)
        graphed.load_state_dict(eager.state_dict())
        layers.append((eager, graphed))
    before = len(graphs._STATIC)
    for seed in range(3):
        for eager, graphed in layers:
            query, _, x, qr, _ = _inputs(seed=20 + seed)
            got = graphed.compute_topk(query, x, qr, None)
            assert torch.equal(got, eager.compute_topk(query, x, qr, None)), seed
    # x, qr in; the picks out: one set for both layers (none if an earlier test made them)
    assert len(graphs._STATIC) - before <= 3


# ------------------------------------------------------------ dsa_indexer_topk_source="replay_ties"


def _random_tie_topk(scores: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """A valid top-k of every row of ``scores`` ``(S, S)`` breaking ties at random (an engine
    kernel's freedom): ``(S, k)`` int32, ``-1`` padding."""
    g = torch.Generator(device=scores.device).manual_seed(seed)
    order = torch.rand(scores.shape, device=scores.device, generator=g).argsort(-1)
    by_score = torch.sort(scores.gather(-1, order), dim=-1, descending=True, stable=True).indices
    picks = order.gather(-1, by_score)[:, :k]
    visible = (scores > float("-inf")).sum(-1, keepdim=True)
    return torch.where(torch.arange(k, device=scores.device) < visible, picks, -1).int()


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graphed"])
def test_replay_ties_takes_the_engines_tied_rows_without_waiting_for_the_host(dsap, graph):
    """Planted ties (zeroed hidden states: rows of exact-0 scores) broken at random by the
    "engine" on the layer's own logits: replay_ties attends to the engine's picks on every row
    (the output of full replay, bit for bit), from a CUDA graph or eagerly, and a replayed
    forward (graph captured) never waits for the host."""
    from dsa_precision import indexer_scores
    from dsa_precision.capture import engine_tie_rows, pack_tie_rows

    fields = CONFIGS["rope_fp32+fp8"]
    ties = _attention(
        dsap,
        _config(
            dsap, dsa_indexer_topk_source="replay_ties", dsa_indexer_cuda_graph=graph, **fields
        ),
    )
    full = _attention(  # full replay scores nothing: no graph to capture
        dsap,
        _config(dsap, dsa_indexer_topk_source="replay", dsa_indexer_cuda_graph=False, **fields),
    )
    full.load_state_dict(ties.state_dict())
    query, key, x, qr, up_v = _inputs(seed=3)
    s = x.shape[0]
    with torch.no_grad():
        x[1000:1100] = 0  # zero indexer weights: every key of these rows scores exactly 0
        logits = indexer_scores(ties.indexer.scoring_operands(x, qr, None))[0]
    engine = _random_tie_topk(logits, 256, seed=5)
    frame = engine_tie_rows(logits, engine, torch.arange(1, s + 1, device="cuda"))
    assert frame.rows.numel() >= 100  # the zeroed rows, tied at 0
    picks = pack_tie_rows([{1: frame}], [s], seq_len=s)
    with dsap.engine_topk({1: engine}, seq_len=s):
        want = _forward(full)(query, key, x, qr, up_v)
    for step in range(3):  # the graph is captured on the first forward
        with dsap.engine_topk(picks), no_host_sync() if step == 2 else contextlib.nullcontext():
            got = _forward(ties)(query, key, x, qr, up_v)
        assert torch.equal(got, want), step
    m = dsap.topk_metrics(torch.nn.ModuleList([ties]))
    assert m["dsa_topk/layer_01/undecided_rows"] == 0
    assert m["dsa_topk/layer_01/digest_mismatch_rows"] == 0
    assert m["dsa_topk/layer_01/replayed_rows"] == 3 * frame.rows.numel()
