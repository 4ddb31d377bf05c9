"""pytest plugin: run Megatron-LM's unit tests in one CPU process (both modes of ``run.py``).

Loaded with ``-p cpu_plugin`` (``tests/megatron_lm`` on ``PYTHONPATH``, Megatron-LM's checkout
as the working directory), in the stock and the swapped run alike, so that whatever it changes is
the same in both and a difference between the modes can only come from the drop-ins. It changes
only Megatron-LM's *test* side -- never an attribute of a ``megatron`` module: names inside the
test modules (through :mod:`_rebind`), the suite's ``Utils`` helper, pytest hooks, and, for
listed tests only, torch's CUDA device placement.

Process and helpers (whenever CUDA is absent):

* ``tests.test_utils.python_scripts.download_unit_tests_dataset`` is replaced, before the suite's
  ``conftest.py`` imports it, by a module whose ``download_and_extract_asset`` does nothing (the
  real one needs ``requests``/``click`` and downloads into ``/opt/data``; no DSA test reads it).
* ``tests.unit_tests.test_utilities.Utils.initialize_distributed`` creates a one-rank ``gloo``
  process group on an in-memory store (the original calls ``torch.cuda.set_device`` and uses
  NCCL), and ``Utils.destroy_model_parallel`` skips ``torch.cuda.synchronize``/``empty_cache``.
  ``parallel_state.initialize_model_parallel`` then runs unchanged on that group: TP/PP/CP sizes
  of 1 work; larger sizes fail as they would with one GPU.

Names rebound in every module under ``<Megatron-LM>/tests`` (see :mod:`_rebind`; originals are
matched by identity wherever a test imports them from):

=====================================================  =======================================
original (``megatron.core...``)                        test modules see
=====================================================  =======================================
``tensor_parallel.random.model_parallel_cuda_manual_   ``_cpu_manual_seed``: initializes and
seed``                                                 resets the RNG tracker, adds no CUDA
                                                       generator states (set-ups call it before
                                                       building modules; with
                                                       ``use_cpu_initialization=True`` nothing
                                                       reads those states)
``extensions.transformer_engine.TELinear``             ``post_training.modelopt.layers.Linear``
(without TE a ``MagicMock`` that "builds" mocks)       (Megatron's plain local linear; takes
                                                       ``parallel_mode="duplicated"`` as the
                                                       DSA indexer passes it)
``extensions.transformer_engine.TENorm``               ``transformer.torch_norm.WrappedTorchNorm``
(raises without TE)                                    (torch LayerNorm/RMSNorm per
                                                       ``config.normalization``, as
                                                       ``LocalSpecProvider.layer_norm`` gives
                                                       without Apex)
``extensions.transformer_engine_spec_provider.``       ``CPUSpecProvider``: Megatron's
``TESpecProvider``                                     ``LocalSpecProvider`` plus ``linear()`` ->
                                                       modelopt ``Linear`` (the same as
                                                       ``dsa_precision.megatron.
                                                       LocalDSASpecProvider``, defined here so the
                                                       stock run does not import the package)
``models.gpt.experimental_attention_variant_module_    wrapper: when called with ``backend=None``
specs.get_experimental_attention_variant_module_spec``  and Megatron would resolve its default
and ``get_transformer_layer_with_experimental_         (``TESpecProvider``, a ``NameError``
attention_variant_spec``                               without TE; a test that patched
                                                       ``_get_backend_spec_provider`` is left
                                                       alone) it passes ``CPUSpecProvider()``;
                                                       otherwise the original call, unchanged
``utils.is_fa_min_version``                            ``False`` (no flash-attn version is
(raises ``ModuleNotFoundError`` without flash-attn)    installed) -- ``test_hybrid_model``
                                                       evaluates it in a class-level ``skipif``,
                                                       which otherwise stops the file collecting
=====================================================  =======================================

The TE rows and the builder wrappers apply only when Transformer Engine is not installed, the
``is_fa_min_version`` row only without flash-attn, the seed row only without CUDA.
``swap_plugin`` wraps the builder wrappers (never the other way round).

Imports of modules that are not installed, answered in test modules only
(:func:`_rebind.stub_import`; an installed module is always used):

* ``transformer_engine.pytorch.fp8.check_fp8_support`` -> ``(False, reason)`` (``test_hybrid_model``
  imports it at module level; without it the whole file fails to collect);
* ``megatron.rl.rl_utils.selective_log_softmax`` (Megatron-LM's ``megatron/rl`` is not part of
  megatron-core) -> a function that raises ``NotImplementedError``: it lets
  ``test_dsa_gpt_mamba_equivalence`` collect; its tests are CUDA-gated and skip before calling it.

CPU placement, for the tests listed in ``CPU_DEVICE_TESTS`` only (node-id prefixes:
``test_attention_variant_dsa.py``'s ``TestRotateActivation``, ``TestDSAIndexer``,
``TestDSAttention``), during their setup, call and teardown (so class-scoped set-ups are
covered):

* ``torch.cuda.current_device`` returns ``"cpu"`` (Megatron's ``RotaryEmbedding`` places
  ``inv_freq`` on it whatever ``use_cpu_initialization`` says; the package's own CPU tests do the
  same), and
* a ``TorchFunctionMode`` makes CUDA placement land on the CPU: ``Tensor.cuda()`` (hence
  ``Module.cuda()``) returns the CPU tensor itself, a ``device="cuda[:n]"``/``torch.device("cuda")``
  keyword of any torch function (factories: ``randn``, ``ones``, ``arange``, ``tensor``...) and a
  CUDA device given positionally to ``Tensor.to`` become ``"cpu"``. ``torch.cuda.is_available()``
  stays ``False``; nothing else changes.

CUDA-gated tests un-skipped (``UNSKIP_CUDA_TESTS``: ``TestDSAIndexer``, ``TestDSAttention``):
in these classes, whose tests only
*place* tensors and modules on CUDA (no CUDA kernel: cuDNN/TileLang/FlashMLA), the
``skipif(not torch.cuda.is_available(), reason="CUDA not available")`` marks are removed at
collection, so they run with the placement above. No assertion is touched; tests that need CUDA
kernels, several ranks or Mamba kernels keep failing/skipping as before, the same in both modes.

Deliberately not adapted: the TP/CP>1 tests (one process: ``world_size (1) is not divisible``);
``test_absorbed_mla::test_functionality`` (its core attention is a mock, no DSA module; it uses
``use_cpu_initialization=False``, i.e. CUDA RNG-tracker states, a 7168-wide model, and without TE
AbsorbedMLA rejects modelopt ``Linear`` down projections); the unfused native-parity tests (their
helper skips without CUDA at run time; a full 7168-wide layer at 1-4k tokens, 10 iterations, is
far too slow on a CPU); ``hybrid_stack_spec`` users (a TE-built module constant, not deep-copyable
without TE; most also need Mamba kernels); the CUDA-gated GPT/Hybrid equivalence tests (TE-named
state-dict remapping).

Instrumentation: a global ``torch.nn`` submodule-registration hook records, per test (its setup,
call and teardown), the classes of ``DSAIndexer``/``DSAttention`` instances (any subclass, so
``PrecisionDSA*`` in the swapped run) constructed during it ("built"), and at the end of each
call the ones held by the test's class or instance (class-scoped set-ups, "held"). Written to
``$DSA_CPU_REPORT`` (JSON, keyed by node id) for ``run.py``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import sys
import types
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import _rebind
import pytest
import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer, DSAttention
from torch.overrides import TorchFunctionMode

_DOWNLOAD_MODULE = "tests.test_utils.python_scripts.download_unit_tests_dataset"
_EAV = "tests/unit_tests/transformer/experimental_attention_variant/"
_DSA_FILE = _EAV + "test_attention_variant_dsa.py"

# Node-id prefixes of the tests that run with CUDA placement redirected to the CPU.
CPU_DEVICE_TESTS = (
    _DSA_FILE + "::TestRotateActivation::",
    _DSA_FILE + "::TestDSAIndexer::",
    _DSA_FILE + "::TestDSAttention::",
)
# Node-id prefixes whose "CUDA not available" skipif marks are removed (placement-only CUDA use).
UNSKIP_CUDA_TESTS = (
    _DSA_FILE + "::TestDSAIndexer::",
    _DSA_FILE + "::TestDSAttention::",
)
_CUDA_SKIP_REASON = "CUDA not available"

# Decided once, at import: tests monkeypatch ``torch.cuda.is_available`` (and a failed undo must
# not switch the adaptations off for the rest of the file).
_HAVE_CUDA = torch.cuda.is_available()
_DSA_TYPES = (DSAIndexer, DSAttention)
_STATE: dict[str, Any] = {"nodeid": None}
_USED: dict[str, dict[str, set[str]]] = {}  # nodeid -> {"built": {...}, "held": {...}}


def _megatron_root() -> str:
    return os.path.abspath(os.environ.get("MEGATRON_LM_ROOT", os.getcwd()))


# -- process and helpers -------------------------------------------------------------------------


def _stub_download_module() -> None:
    stub = types.ModuleType(_DOWNLOAD_MODULE)
    stub.__doc__ = "cpu_plugin stub: Megatron-LM's unit-test assets are not downloaded."

    def download_and_extract_asset(assets_dir=None) -> bool:
        return False

    stub.download_and_extract_asset = download_and_extract_asset
    sys.modules[_DOWNLOAD_MODULE] = stub


def _cpu_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    *args,
    force_reset_rng: bool = False,
    **kwargs,
) -> None:
    """CPU stand-in for ``model_parallel_cuda_manual_seed``: tracker set up, no CUDA states."""
    from megatron.core.tensor_parallel import random as mp_random

    mp_random.initialize_rng_tracker(
        te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset=force_reset_rng
    )
    mp_random.get_cuda_rng_tracker().reset()


def _patch_utils() -> None:
    import megatron.core.parallel_state as ps

    from tests.unit_tests import test_utilities

    utils = test_utilities.Utils

    def initialize_distributed() -> None:
        for var in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
            os.environ.pop(var, None)
        if not torch.distributed.is_initialized() and utils.rank >= 0:
            store = torch.distributed.HashStore()
            utils.store = store
            torch.distributed.init_process_group(
                backend="gloo",
                world_size=utils.world_size,
                rank=utils.rank,
                store=store,
                timeout=timedelta(minutes=1),
            )
        utils.inited = True

    def destroy_model_parallel() -> None:
        for var in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
            os.environ.pop(var, None)
        if not utils.inited:
            return
        try:
            torch.distributed.barrier()
        except Exception:
            utils.inited = False
            return
        ps.destroy_model_parallel()
        utils.inited = False

    utils.initialize_distributed = staticmethod(initialize_distributed)
    utils.destroy_model_parallel = staticmethod(destroy_model_parallel)


# -- local modules instead of Transformer Engine ------------------------------------------------


class CPUSpecProvider(LocalSpecProvider):
    """Megatron's ``LocalSpecProvider`` plus the plain ``linear()`` the DSA spec asks for
    (modelopt's local ``Linear``; ``LocalSpecProvider`` has none)."""

    def linear(self) -> type:
        from megatron.core.post_training.modelopt.layers import Linear

        return Linear


def _default_backend_builder(original, resolver_holder, resolver):
    """``original`` with ``backend=CPUSpecProvider()`` where Megatron would build its default
    ``TESpecProvider`` (``backend=None``, no TE, ``_get_backend_spec_provider`` not patched)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def builder(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("backend") is None and (
            getattr(resolver_holder, "_get_backend_spec_provider", None) is resolver
        ):
            bound.arguments["backend"] = CPUSpecProvider()
        return original(*bound.args, **bound.kwargs)

    builder.__dsa_cpu_backend__ = True
    return builder


def _register_local_modules() -> None:
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as eav_specs
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if te_ext.HAVE_TE:
        return
    _rebind.register(te_ext.TELinear, Linear)
    _rebind.register(te_ext.TENorm, WrappedTorchNorm)
    _rebind.register(TESpecProvider, CPUSpecProvider)
    if eav_specs.HAVE_TE:
        return
    resolver = eav_specs._get_backend_spec_provider
    for name in (
        "get_experimental_attention_variant_module_spec",
        "get_transformer_layer_with_experimental_attention_variant_spec",
    ):
        original = getattr(eav_specs, name)
        _rebind.register(original, _default_backend_builder(original, eav_specs, resolver))


def _register_fa_version() -> None:
    """``is_fa_min_version`` without flash-attn: ``False`` instead of ``ModuleNotFoundError``."""
    import importlib.util

    from megatron.core import utils as core_utils

    if importlib.util.find_spec("flash_attn") is not None:
        return
    original = core_utils.is_fa_min_version

    @functools.wraps(original)
    def is_fa_min_version(version, check_equality=True):
        return False

    _rebind.register(original, is_fa_min_version)


def _register_import_stubs() -> None:
    fp8 = types.ModuleType("transformer_engine.pytorch.fp8")
    fp8.__doc__ = "cpu_plugin stand-in: Transformer Engine is not installed."

    def check_fp8_support() -> tuple[bool, str]:
        return False, "Transformer Engine is not installed (cpu_plugin stand-in)"

    fp8.check_fp8_support = check_fp8_support
    _rebind.stub_import(fp8.__name__, fp8)

    rl_utils = types.ModuleType("megatron.rl.rl_utils")
    rl_utils.__doc__ = "cpu_plugin stand-in: Megatron-LM's megatron/rl is not in megatron-core."

    def selective_log_softmax(*args, **kwargs):
        raise NotImplementedError(
            "megatron.rl is not installed (megatron-core only); cpu_plugin stand-in"
        )

    rl_utils.selective_log_softmax = selective_log_softmax
    _rebind.stub_import(rl_utils.__name__, rl_utils)


# -- CUDA placement on the CPU for listed tests --------------------------------------------------


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value == "cuda" or value.startswith("cuda:")
    return False


class CudaPlacementOnCPU(TorchFunctionMode):
    """``Tensor.cuda()`` returns the tensor; a CUDA ``device=`` keyword (any torch function) or a
    CUDA device passed positionally to ``Tensor.to`` becomes ``"cpu"``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda_device(arg) else arg for arg in args)
        return func(*args, **kwargs)


def _listed(nodeid: str, prefixes: tuple[str, ...]) -> bool:
    return any(nodeid.startswith(prefix) for prefix in prefixes)


@contextlib.contextmanager
def _cpu_placement(item) -> Iterator[None]:
    if _HAVE_CUDA or not _listed(item.nodeid, CPU_DEVICE_TESTS):
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        with CudaPlacementOnCPU():
            yield
    finally:
        torch.cuda.current_device = saved


# -- which DSA modules each test built or held ---------------------------------------------------


def _record(nodeid: str | None, kind: str, module: Any) -> None:
    if nodeid is not None:
        entry = _USED.setdefault(nodeid, {"built": set(), "held": set()})
        entry[kind].add(type(module).__name__)


def _on_submodule_registered(module, name, submodule):
    if isinstance(module, _DSA_TYPES):
        _record(_STATE["nodeid"], "built", module)
    return None


def _record_held(item) -> None:
    owners = [getattr(item, "cls", None), getattr(item, "instance", None)]
    for owner in owners:
        if owner is None:
            continue
        for value in list(vars(owner).values()):
            if isinstance(value, torch.nn.Module):
                for module in value.modules():
                    if isinstance(module, _DSA_TYPES):
                        _record(item.nodeid, "held", module)


@contextlib.contextmanager
def _phase(item) -> Iterator[None]:
    _STATE["nodeid"] = item.nodeid
    try:
        with _cpu_placement(item):
            yield
    finally:
        _STATE["nodeid"] = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _phase(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _phase(item):
        try:
            return (yield)
        finally:
            _record_held(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with _phase(item):
        return (yield)


def pytest_collection_modifyitems(session, config, items) -> None:
    if _HAVE_CUDA:
        return
    for item in items:
        if not _listed(item.nodeid, UNSKIP_CUDA_TESTS):
            continue
        item.own_markers[:] = [
            mark
            for mark in item.own_markers
            if not (mark.name == "skipif" and mark.kwargs.get("reason") == _CUDA_SKIP_REASON)
        ]


def pytest_sessionfinish(session, exitstatus) -> None:
    path = os.environ.get("DSA_CPU_REPORT")
    if not path:
        return
    report = {
        nodeid: {kind: sorted(names) for kind, names in entry.items()}
        for nodeid, entry in _USED.items()
    }
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"dsa_modules": report, "rebound": _rebind.rebound()}, fh, indent=1)


# -- set-up at import (before the suite's conftest and test modules are imported) ---------------

_stub_download_module()
if not _HAVE_CUDA:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    _rebind.register(model_parallel_cuda_manual_seed, _cpu_manual_seed)
_register_local_modules()
_register_fa_version()
_register_import_stubs()
torch.nn.modules.module.register_module_module_registration_hook(_on_submodule_registered)
_rebind.activate(os.path.join(_megatron_root(), "tests"))


def pytest_configure(config) -> None:
    if not _HAVE_CUDA:
        _patch_utils()


def pytest_report_header(config) -> list[str]:
    cuda = _HAVE_CUDA
    return [
        f"cpu_plugin: CUDA {'available (Utils untouched)' if cuda else 'absent: gloo Utils, CPU seed'}",
        f"cpu_plugin: CUDA placement on the CPU for {len(CPU_DEVICE_TESTS)} test group(s); "
        f"CUDA-only skips lifted for {len(UNSKIP_CUDA_TESTS)}",
    ]
