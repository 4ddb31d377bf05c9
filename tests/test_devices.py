"""The hot path's caches (``dsa_precision.devices``) and the tensors the package shares through them:
a cached value is never stale (a changed source, another source object or other arguments miss),
shared tensors are built outside inference mode, and nothing the caller gets back aliases them."""

import gc

import torch

from dsa_precision import IndexerPrecisionConfig, indexer_select
from dsa_precision.devices import _DerivedCache, _shared_device_tensor
from dsa_precision.hadamard import hadamard_transform

from .support.configs import CPU


class _Builds:
    """A build function that counts its calls and returns a fresh value each time."""

    def __init__(self, source: torch.Tensor) -> None:
        self.source, self.calls = source, 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        return self.source * 2


def test_derived_cache_hits_only_the_same_object_version_and_key():
    cache = _DerivedCache(size=4)
    x = torch.arange(4.0)
    build = _Builds(x)
    first = cache.get(x, "k", build)
    assert cache.get(x, "k", build) is first and build.calls == 1  # a hit: no rebuild
    assert torch.equal(cache.get(x, "other", build), first) and build.calls == 2  # another key
    x.add_(1)  # in place: the version counter moves, the cached value is stale
    again = cache.get(x, "k", build)
    assert build.calls == 3 and torch.equal(again, (torch.arange(4.0) + 1) * 2)
    x[1:3].mul_(0)  # through a view: the same version counter
    assert torch.equal(cache.get(x, "k", build), x * 2) and build.calls == 4
    with torch.no_grad():
        x.fill_(7.0)  # under no_grad too
    assert torch.equal(cache.get(x, "k", build), x * 2) and build.calls == 5


def test_derived_cache_misses_a_new_tensor_even_at_a_reused_address():
    cache = _DerivedCache(size=4)
    calls = []
    for value in (1.0, 2.0, 3.0, 4.0):  # each source dies before the next is built
        src = torch.full((8,), value)
        got = cache.get(src, "k", lambda src=src: calls.append(1) or src.clone())
        assert torch.equal(got, torch.full((8,), value))  # never the previous tensor's value
        del src, got
        gc.collect()
    assert len(calls) == 4


def test_derived_cache_does_not_remember_inference_tensors_and_builds_normal_ones():
    cache = _DerivedCache(size=4)
    with torch.inference_mode():
        x = torch.ones(3)  # an inference tensor: no version counter to key on
    build = _Builds(x)
    cache.get(x, "k", build)
    cache.get(x, "k", build)
    assert build.calls == 2
    y = torch.ones(3)
    with torch.inference_mode():
        value = cache.get(y, "k", _Builds(y))
    assert not value.is_inference()  # can still be saved for backward later


def test_derived_cache_keeps_only_its_most_recent_entries():
    cache = _DerivedCache(size=2)
    sources = [torch.full((2,), float(i)) for i in range(3)]
    builds = [_Builds(s) for s in sources]
    for s, b in zip(sources, builds, strict=True):
        cache.get(s, "k", b)
    cache.get(sources[0], "k", builds[0])  # evicted by the third: rebuilt
    cache.get(sources[2], "k", builds[2])  # still there
    assert [b.calls for b in builds] == [2, 1, 1]


def test_shared_device_tensor_is_built_once_per_arguments_outside_inference_mode():
    calls = []

    @_shared_device_tensor
    def ramp(n: int, device: torch.device) -> torch.Tensor:
        calls.append(n)
        return torch.arange(n, device=device)

    with torch.inference_mode():
        a = ramp(3, CPU)
    assert not a.is_inference()
    assert ramp(3, CPU) is a and ramp(4, CPU).tolist() == [0, 1, 2, 3] and calls == [3, 4]


# ------------------------------------------------------------------- what the package shares


def test_select_with_int_offsets_equals_tensor_offsets_and_returns_fresh_picks():
    """The int-offset path (shared constant offsets and key counts, built once) against the tensor
    path (built per call), chunked and not, for offsets that differ call by call; the picks
    returned are the caller's to modify."""
    g = torch.Generator().manual_seed(3)
    b, sq, sk, h = 2, 24, 40, 4
    q = torch.randn(b, sq, h, 128, generator=g)
    k = torch.randn(b, sk, 128, generator=g)
    w = torch.randn(b, sq, h, generator=g)
    bf16 = IndexerPrecisionConfig()
    for offset in (16, 0, 9, 16):
        for chunk in (None, 8 * b * sk * 12):
            kw = dict(topk=5, config=bf16, backend="torch", chunk_bytes=chunk)
            by_int = indexer_select(q, k, w, q_causal_offsets=offset, **kw)
            offsets = torch.full((b,), offset, dtype=torch.int64)
            assert torch.equal(by_int, indexer_select(q, k, w, q_causal_offsets=offsets, **kw))
            by_int.fill_(-7)  # the caller's tensor: nothing cached changes
            again = indexer_select(q, k, w, q_causal_offsets=offset, **kw)
            assert torch.equal(again, indexer_select(q, k, w, q_causal_offsets=offsets, **kw))


def test_derived_cache_lets_the_values_of_a_freed_source_go():
    cache = _DerivedCache(size=8)
    keep = torch.ones(4)
    cache.get(keep, "k", _Builds(keep))
    for _ in range(3):  # per-call sources (THD angles gathered each forward)
        tmp = torch.ones(4)
        cache.get(tmp, "k", _Builds(tmp))
        del tmp
    gc.collect()
    cache.get(keep, "k", _Builds(keep))  # the next call drops the freed sources' entries
    assert len(cache) == 1


def test_a_graph_capture_bypasses_both_caches(monkeypatch):
    """While a CUDA graph is being captured (a stand-in here; the real capture is the GPU test
    ``test_select_with_int_offsets_builds_its_constants_outside_a_graph_capture``) every call
    builds its own value and nothing is read from or stored into the caches."""
    from dsa_precision import devices

    calls = []

    @_shared_device_tensor
    def ones(n: int, device: torch.device) -> torch.Tensor:
        calls.append(n)
        return torch.ones(n, device=device)

    cache = _DerivedCache(size=4)
    x = torch.ones(2)
    before = ones(2, CPU)
    cached = cache.get(x, "k", _Builds(x))
    monkeypatch.setattr(devices, "_capturing", lambda device: True)
    assert ones(2, CPU) is not before and ones(3, CPU) is not ones(3, CPU)
    assert cache.get(x, "k", _Builds(x)) is not cached
    monkeypatch.undo()
    assert ones(2, CPU) is before and cache.get(x, "k", _Builds(x)) is cached
    assert calls == [2, 2, 3, 3] and len(cache) == 1


def test_hot_path_constants_are_built_once(monkeypatch):
    """The float32 LayerNorm epsilon, the float32 Hadamard constant and the log2 UE8M0 band are
    device constants built once, not a ``torch.tensor(..., device=...)`` per call (on CUDA a
    blocking host-to-device copy: a host synchronisation on every forward)."""
    from dsa_precision.engines import Fp8Rule
    from dsa_precision.preprocess import layer_norm_fp32_ops
    from dsa_precision.quantize import _fp8_descale

    x = torch.randn(4, 128)
    rule = Fp8Rule(scale_ratio="divide", ue8m0_ceil="log2")
    amax = x.abs().amax(-1)

    def run():
        return (
            layer_norm_fp32_ops(x, None, None, 1e-6, fma=False),
            hadamard_transform(x, torch.float32, scale_fp32=True),
            _fp8_descale(amax, rule),
        )

    first = run()
    built = []
    real = torch.tensor

    def counting(*args, **kwargs):
        built.append(args[:1])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", counting)
    again = run()
    assert built == []
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


def test_device_constant_made_in_inference_mode_serves_backward():
    """A cached constant first built under inference mode is a normal tensor: a later training
    step can save it for backward (the float32 Hadamard scale multiplies a tensor with grad)."""

    with torch.inference_mode():
        hadamard_transform(torch.randn(2, 64), torch.float32, scale_fp32=True)
    x = torch.randn(2, 64, requires_grad=True)
    hadamard_transform(x, torch.float32, scale_fp32=True).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
