"""Determinism registry: every kernel-dispatching source file -> the replay tests that cover it.

A replay test runs the code twice (or more) on the same inputs and compares the outputs bit for
bit through :func:`dsa_precision.testing.assert_replays_bit_exact`. The CPU gate
(``tests/determinism/test_gate.py``) checks *coverage*, not edits:

(a) every kernel-dispatching module of ``dsa_precision`` (:func:`dispatch_sources`, found by
    reading the package's code, so a new module cannot slip by) is in :data:`REGISTRY`;
(b) every registered test is collected by pytest under its node id and is a replay test (its
    function, or a helper of its file that it calls, calls ``assert_replays_bit_exact``);
(c) on the CPU, the registered replays that can run here do run, enter the replay helper and
    execute the registered source file (traced with ``sys.monitoring``, :mod:`.trace`), and every
    registered source has at least one such CPU replay. GPU replays are collected and checked
    statically; they run on the H200 (``python -m pytest -m gpu tests/gpu``).

A module *dispatches kernels* when it

- imports a kernel library (:data:`KERNEL_LIBRARIES`), or names one for a dynamic import;
- launches a Triton kernel (``kernel[grid](...)``) or accumulates by index (``index_put_`` with
  ``accumulate=True``, ``index_add``, ``scatter_add``, ``scatter_reduce``: atomics on a GPU);
- calls, anywhere in its functions, a function of a dispatching module that (transitively)
  launches: the call graph is followed through imports, module attributes and same-module calls.
  Questions asked of a kernel module (``*_reason``, ``*_available``, ``_entry_point``,
  ``_device_scope``) launch nothing.

Commands (``cli/``, the demo's engine model among them) time or compare kernels, they do not feed
training (the engine oracles, ``conformance/``, are outside the package); ``testing/`` is the
replay helper itself. Type annotations name classes without calling them: they are not calls.
:data:`REGISTERED_BEYOND_THE_SCAN` lists hot-path modules registered although they only compose
torch operations.

    python -m tests.determinism.manifest      # the scan and the registry, side by side
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "dsa_precision"

KERNEL_LIBRARIES = ("triton", "cudnn", "deep_gemm", "flash_mla", "fast_hadamard_transform")
# Commands time or compare kernels (the demo's engine model is a reference); none feeds training.
# testing/ holds the replay helper.
EXCLUDED = ("dsa_precision/cli/", "dsa_precision/testing/")
# Functions of a kernel module that answer a question and launch nothing.
QUERY = re.compile(r"(_reason|_available|^entry_point|^device_scope)$")
ACCUMULATING = {"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce_"}
DYNAMIC_IMPORTS = {"importlib.import_module", "__import__", "import_module"}
REPLAY_HELPER = "assert_replays_bit_exact"

GPU = "tests/gpu/test_determinism.py"
MEGATRON_GPU = "tests/gpu/test_megatron.py"
CPU = "tests/determinism/test_cpu_replays.py"
INTERPRETER = "tests/interpreter/test_replays.py"

# source -> replay tests (pytest node ids "path::function"; every parametrization runs)
REGISTRY: dict[str, tuple[str, ...]] = {
    "dsa_precision/backends/cudnn.py": (
        f"{CPU}::test_cudnn_launches_replay_through_the_recording_fake",
        f"{GPU}::test_scoring_replays_bit_exact",
        f"{GPU}::test_topk_replays_bit_exact",
        f"{GPU}::test_fused_backward_replays_bit_exact_when_deterministic",
    ),
    "dsa_precision/backends/deepgemm.py": (
        f"{CPU}::test_deepgemm_launches_replay_through_a_recording_fake",
        f"{GPU}::test_deepgemm_replays_bit_exact",
        f"{GPU}::test_deepgemm_varlen_replays_bit_exact",
        f"{GPU}::test_deepgemm_select_replays_bit_exact",
    ),
    "dsa_precision/kernels/mask_tails.py": (
        f"{INTERPRETER}::test_mask_tails_replays_bit_exact",
        f"{GPU}::test_deepgemm_replays_bit_exact",
        f"{GPU}::test_deepgemm_varlen_replays_bit_exact",
    ),
    "dsa_precision/kernels/varlen_windows.py": (
        f"{INTERPRETER}::test_varlen_windows_replays_bit_exact",
        f"{GPU}::test_deepgemm_varlen_replays_bit_exact",
        f"{GPU}::test_chunked_select_varlen_replays_bit_exact",
    ),
    "dsa_precision/rows.py": (
        f"{INTERPRETER}::test_varlen_windows_replays_bit_exact",
        f"{GPU}::test_deepgemm_varlen_replays_bit_exact",
        f"{GPU}::test_chunked_select_varlen_replays_bit_exact",
    ),
    "dsa_precision/scoring.py": (
        f"{CPU}::test_torch_scoring_replays_bit_exact",
        f"{CPU}::test_cudnn_launches_replay_through_the_recording_fake",
        f"{GPU}::test_scoring_replays_bit_exact",
        f"{GPU}::test_varlen_scoring_replays_bit_exact",
        f"{GPU}::test_non_finite_inputs_replay_and_stay_non_finite",
    ),
    "dsa_precision/topk.py": (
        f"{CPU}::test_torch_topk_replays_bit_exact",
        f"{CPU}::test_cudnn_launches_replay_through_the_recording_fake",
        f"{GPU}::test_topk_replays_bit_exact",
    ),
    "dsa_precision/select.py": (
        f"{CPU}::test_chunked_select_replays_bit_exact",
        f"{GPU}::test_chunked_select_replays_bit_exact",
        f"{GPU}::test_chunked_select_varlen_replays_bit_exact",
        f"{GPU}::test_deepgemm_select_replays_bit_exact",
    ),
    "dsa_precision/quantize.py": (
        f"{CPU}::test_torch_scoring_replays_bit_exact",
        f"{CPU}::test_indexer_operands_replay_bit_exact",
        f"{GPU}::test_prepare_scoring_operands_replays_bit_exact",
    ),
    "dsa_precision/hadamard.py": (
        f"{CPU}::test_indexer_operands_replay_bit_exact",
        f"{GPU}::test_fp32_preprocessing_route_replays_and_keeps_dtypes",
    ),
    "dsa_precision/preprocess.py": (
        f"{CPU}::test_indexer_operands_replay_bit_exact",
        f"{GPU}::test_fp32_preprocessing_route_replays_and_keeps_dtypes",
    ),
    "dsa_precision/prepare.py": (
        f"{CPU}::test_indexer_operands_replay_bit_exact",
        f"{GPU}::test_prepare_scoring_operands_replays_bit_exact",
    ),
    "dsa_precision/kernels/preprocess_quantize.py": (
        f"{INTERPRETER}::test_fused_preprocess_quantize_replays_bit_exact",
        f"{GPU}::test_prepare_scoring_operands_replays_bit_exact",
    ),
    "dsa_precision/kernels/digest.py": (
        f"{INTERPRETER}::test_digest_picks_replays_bit_exact",
        f"{GPU}::test_tie_rows_and_digests_replay_bit_exact",
    ),
    "dsa_precision/kernels/tie_rows.py": (
        f"{INTERPRETER}::test_tie_rows_kernel_replays_bit_exact",
        f"{GPU}::test_tie_rows_and_digests_replay_bit_exact",
    ),
    "dsa_precision/capture/digest.py": (
        f"{CPU}::test_tie_rows_and_digests_replay_bit_exact",
        f"{GPU}::test_tie_rows_and_digests_replay_bit_exact",
    ),
    "dsa_precision/capture/ties.py": (
        f"{CPU}::test_tie_rows_and_digests_replay_bit_exact",
        f"{GPU}::test_tie_rows_and_digests_replay_bit_exact",
    ),
    "dsa_precision/kernels/topk_picks.py": (
        f"{INTERPRETER}::test_drop_invalid_picks_replays_bit_exact",
        f"{GPU}::test_topk_replays_bit_exact",
    ),
    "dsa_precision/megatron/indexer.py": (
        f"{CPU}::test_megatron_attention_replays_bit_exact",
        f"{MEGATRON_GPU}::test_attention_replays_bit_exact",
    ),
    "dsa_precision/megatron/attention.py": (
        f"{CPU}::test_megatron_attention_replays_bit_exact",
        f"{MEGATRON_GPU}::test_attention_replays_bit_exact",
    ),
    "dsa_precision/megatron/layout.py": (
        f"{CPU}::test_megatron_attention_replays_bit_exact",
        f"{MEGATRON_GPU}::test_attention_replays_bit_exact",
    ),
}

# On the hot path, launching only torch operations (elementwise casts, reductions): registered so
# that their bits are replayed too, although the scan does not require it.
REGISTERED_BEYOND_THE_SCAN = ("dsa_precision/quantize.py",)


def replay_tests() -> list[str]:
    """Every registered node id, once, in a stable order."""
    return sorted({node for nodes in REGISTRY.values() for node in nodes})


# ------------------------------------------------------------------------------------ the scan


@dataclass
class _Module:
    name: str  # dotted
    path: str  # relative to the root
    tree: ast.Module
    aliases: dict[str, list[tuple[str, ...]]] = field(default_factory=dict)
    functions: dict[str, list[ast.AST]] = field(default_factory=dict)
    seed: list[str] = field(default_factory=list)  # why the module itself dispatches


def _library(dotted: str) -> str | None:
    root = dotted.split(".")[0]
    last = dotted.rsplit(".", 1)[-1]
    for lib in KERNEL_LIBRARIES:
        if root == lib or last == lib:
            return lib
    return None


def _resolve_from(module: _Module, node: ast.ImportFrom) -> str:
    """The dotted module an ``ImportFrom`` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    parts = module.name.split(".")
    is_package = module.path.endswith("__init__.py")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _read(root: pathlib.Path) -> dict[str, _Module]:
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        name = rel[: -len(".py")].replace("/", ".").removesuffix(".__init__")
        modules[name] = _Module(name, rel, ast.parse(path.read_text(), filename=rel))
    return modules


def _index(module: _Module, modules: dict[str, _Module]) -> None:
    """Aliases (imports anywhere in the module), functions (by bare name; a class stands for
    its methods) and the module's own reasons to dispatch."""
    named: list[str] = []
    dynamic = False
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                lib = _library(a.name)
                if lib:
                    module.seed.append(f"imports {a.name}")
                    alias = ("lib", lib)
                else:
                    alias = ("mod", a.name if a.asname else a.name.split(".")[0])
                module.aliases.setdefault(a.asname or a.name.split(".")[0], []).append(alias)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_from(module, node)
            lib = _library(source)
            if lib:
                module.seed.append(f"imports from {source}")
            for a in node.names:
                if lib:
                    alias = ("lib", lib)
                elif f"{source}.{a.name}" in modules:
                    alias = ("mod", f"{source}.{a.name}")
                else:
                    alias = ("name", source, a.name)
                module.aliases.setdefault(a.asname or a.name, []).append(alias)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"[A-Za-z_][\w.]*", node.value) and _library(node.value):
                named.append(node.value)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in DYNAMIC_IMPORTS:
            dynamic = True
        elif isinstance(node, ast.ClassDef):
            module.functions.setdefault(node.name, []).append(node)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            module.functions.setdefault(node.name, []).append(node)
    if dynamic and named:  # importlib.import_module(name) over names of kernel libraries
        module.seed.append(f"imports {', '.join(sorted(set(named)))} dynamically")


def _launches(call: ast.Call, module: _Module) -> str | None:
    func = call.func
    if isinstance(func, ast.Subscript):
        return f"launches {ast.unparse(func)}"
    if isinstance(func, ast.Attribute):
        if func.attr in ACCUMULATING:
            return f"accumulates by index ({func.attr})"
        if func.attr == "index_put_" and any(
            k.arg == "accumulate" and not (isinstance(k.value, ast.Constant) and not k.value.value)
            for k in call.keywords
        ):
            return "accumulates by index (index_put_ accumulate=True)"
    root = func
    while isinstance(root, ast.Attribute):
        root = root.value
    if isinstance(root, ast.Name) and ("lib",) in [a[:1] for a in module.aliases.get(root.id, [])]:
        return f"calls {ast.unparse(func)}"
    return None


def _callees(call: ast.Call, module: _Module) -> list[tuple[str, str]]:
    """(module, function) pairs a call may reach, by name."""
    func = call.func
    if isinstance(func, ast.Name):
        found = [(a[1], a[2]) for a in module.aliases.get(func.id, []) if a[0] == "name"]
        return [*found, (module.name, func.id)]
    if isinstance(func, ast.Attribute):
        base = func.value
        if isinstance(base, ast.Name):
            mods = [a[1] for a in module.aliases.get(base.id, []) if a[0] == "mod"]
            if mods:
                return [] if QUERY.search(func.attr) else [(m, func.attr) for m in mods]
        return [(module.name, func.attr)]  # a method of this module's classes, if any
    return []


def _target(modules: dict[str, _Module], mod: str, name: str, depth: int = 0) -> tuple[str, str]:
    """Follow re-exports (``from .scoring import indexer_scores`` in ``__init__``)."""
    m = modules.get(mod)
    if m is None or name in m.functions or depth > 5:
        return mod, name
    for alias in m.aliases.get(name, []):
        if alias[0] == "name":
            return _target(modules, alias[1], alias[2], depth + 1)
    return mod, name


def _annotation_nodes(definition: ast.AST) -> set[int]:
    """The nodes of every type annotation inside ``definition`` (arguments, returns, annotated
    assignments): an annotation names a class, it calls nothing."""
    found: set[int] = set()
    for node in ast.walk(definition):
        hints = []
        if isinstance(node, ast.arg) and node.annotation is not None:
            hints.append(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
            hints.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            hints.append(node.annotation)
        for hint in hints:
            found.update(id(n) for n in ast.walk(hint))
    return found


def scan(root: pathlib.Path = ROOT) -> dict[str, list[str]]:
    """Every kernel-dispatching source file (relative path) -> why (the first reasons found)."""
    modules = _read(root)
    for m in modules.values():
        _index(m, modules)
    # Per function: its own launches, and the functions it calls.
    own: dict[tuple[str, str], str] = {}
    calls: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for m in modules.values():
        for name, defs in m.functions.items():
            key = (m.name, name)
            calls[key] = set()
            for d in defs:
                hints = _annotation_nodes(d)
                for node in ast.walk(d):
                    if id(node) in hints:
                        continue
                    reached = []
                    if isinstance(node, ast.Call):
                        why = _launches(node, m)
                        if why and key not in own:
                            own[key] = why
                        reached = _callees(node, m)
                    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                        # A function handed on as a value (``select = owned_topk``) may be called.
                        reached = [
                            (a[1], a[2]) for a in m.aliases.get(node.id, []) if a[0] == "name"
                        ]
                    for mod, fn in reached:
                        target = _target(modules, mod, fn)
                        if target in calls or target[0] in modules:
                            calls[key].add(target)
    # Every function of a module that imports a kernel library may hand it out (dsa(), _import()):
    # a call from elsewhere into such a module launches unless it is a question (QUERY).
    dispatching = dict(own)
    for m in modules.values():
        if m.seed:
            for name in m.functions:
                if not QUERY.search(name):
                    dispatching.setdefault((m.name, name), f"{m.name} {m.seed[0]}")
    changed = True
    while changed:
        changed = False
        for key, targets in calls.items():
            if key in dispatching:
                continue
            for t in sorted(targets):
                if t in dispatching and t != key and not QUERY.search(t[1]):
                    dispatching[key] = f"{key[1]} calls {t[0]}.{t[1]}"
                    changed = True
                    break
    found: dict[str, list[str]] = {}
    for m in modules.values():
        if m.path.startswith(EXCLUDED):
            continue
        reasons = list(m.seed) or [
            f"{name}: {dispatching[(m.name, name)]}"
            for name in m.functions
            if (m.name, name) in dispatching
        ]
        if reasons:
            found[m.path] = reasons[:2]
    return found


def dispatch_sources(root: pathlib.Path = ROOT) -> list[str]:
    """The package's kernel-dispatching source files (relative to the repository root)."""
    return sorted(scan(root))


if __name__ == "__main__":
    reasons = scan()
    for source in sorted(set(reasons) | set(REGISTRY)):
        why = "; ".join(reasons.get(source, ["registered beyond the scan"]))
        print(f"{source}  ({why})")
        for node in REGISTRY.get(source, ("UNREGISTERED",)):
            print(f"    {node}")


# ------------------------------------------------------------------------- the replay trace


def _pytest_command(nodes: list[str], out: pathlib.Path) -> list[str]:
    """pytest over the files of ``nodes``, running only ``nodes`` (the plugin deselects the rest,
    so a registered test that does not exist is reported, not a collection error)."""
    files = sorted({n.split("::")[0] for n in nodes})
    return [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
        "tests.determinism.trace", f"--replay-trace={out}", f"--replay-only={','.join(nodes)}",
        "-W", "ignore", *files,
    ]  # fmt: skip


_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def run_replays(nodes: list[str], workdir: pathlib.Path, timeout: float = 300) -> dict:
    """Collect and run ``nodes`` in CPU-only subprocesses under the trace plugin (interpreter
    tests under ``TRITON_INTERPRET=1``, the rest with no GPU visible), concurrently; the merged
    trace (:mod:`tests.determinism.trace`) plus each run's output tail."""
    # No GPU, one thread, and none of this process's torch.distributed rendezvous (the CPU
    # Megatron fixture sets MASTER_PORT for its own gloo group).
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    groups = {
        "interpreter": [n for n in nodes if n.startswith("tests/interpreter/")],
        "cpu": [n for n in nodes if not n.startswith("tests/interpreter/")],
    }
    runs = {}
    for name, group in groups.items():
        if not group:
            continue
        out = workdir / f"{name}.json"
        extra = {"TRITON_INTERPRET": "1"} if name == "interpreter" else {}
        runs[name] = (
            out,
            subprocess.Popen(
                _pytest_command(group, out), cwd=ROOT, env={**env, **extra}, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            ),
        )  # fmt: skip
    merged: dict = {"collected": [], "tests": {}, "output": {}}
    for name, (out, proc) in runs.items():
        log, _ = proc.communicate(timeout=timeout)
        merged["output"][name] = log[-3000:]
        if out.is_file():
            data = json.loads(out.read_text())
            merged["collected"] += data["collected"]
            merged["tests"].update(data["tests"])
    return merged


def _base(node_id: str) -> str:
    return node_id.split("[", 1)[0]


def coverage_problems(
    registry: dict[str, tuple[str, ...]], trace: dict, exempt: tuple[str, ...] = ()
) -> list[str]:
    """What the trace of the registered replays says is not covered (empty when all is well):
    a test not collected; a test that ran on the CPU without entering the replay helper or
    without executing a source it is registered for; a source (outside ``exempt``) that no
    CPU replay executed."""
    problems = []
    collected = {_base(n) for n in trace["collected"]}
    runs: dict[str, list[dict]] = {}
    for node, entry in trace["tests"].items():
        runs.setdefault(_base(node), []).append(entry)
    for source, nodes in sorted(registry.items()):
        covering = []
        for node in nodes:
            if node not in collected:
                problems.append(f"{source}: {node} is not collected by pytest")
                continue
            passed = [e for e in runs.get(node, []) if e.get("outcome") == "passed"]
            if any(e.get("outcome") == "failed" for e in runs.get(node, [])):
                problems.append(f"{source}: {node} failed")
            if not passed:
                continue  # skipped here (a GPU test): checked statically only
            files = set().union(*(e["files"] for e in passed))  # over its parametrizations
            if not all(e["replayed"] for e in passed):
                problems.append(f"{source}: {node} passed without {REPLAY_HELPER}")
            elif source not in files:
                problems.append(f"{source}: {node} ran without executing {source}")
            else:
                covering.append(node)
        if not covering and not source.startswith(exempt):
            problems.append(f"{source}: no replay that runs on the CPU executed it")
    return problems


# ------------------------------------------------------------------ what a replay test is


def _calls_helper(fn: ast.AST, functions: dict[str, ast.AST], seen: set[str]) -> str | None:
    """``"ok"`` when ``fn`` (or a function of its file it calls) calls the replay helper with at
    least two runs; otherwise why not (``None``: it never calls it)."""
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        if name == REPLAY_HELPER:
            for k in node.keywords:
                if k.arg == "replays" and not (
                    isinstance(k.value, ast.Constant) and isinstance(k.value.value, int)
                    and k.value.value >= 2
                ):  # fmt: skip
                    return f"calls {REPLAY_HELPER} with replays={ast.unparse(k.value)}"
            return "ok"
        if name in functions and name not in seen:
            seen.add(name)
            found = _calls_helper(functions[name], functions, seen)
            if found:
                return found
    return None


def replay_test_problems(nodes: list[str], root: pathlib.Path = ROOT) -> list[str]:
    """Registered node ids that are not replay tests: the file or the test function is missing,
    or the test never runs its code twice through :data:`REPLAY_HELPER`."""
    problems = []
    trees: dict[str, ast.Module] = {}
    for node in nodes:
        path, _, func = node.partition("::")
        func = _base(func)
        if not (root / path).is_file():
            problems.append(f"{node}: {path} does not exist")
            continue
        tree = trees.setdefault(path, ast.parse((root / path).read_text()))
        functions = {
            n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        if func not in functions or not func.startswith("test_"):
            problems.append(f"{node}: no test function {func} in {path}")
            continue
        verdict = _calls_helper(functions[func], functions, {func})
        if verdict != "ok":
            problems.append(f"{node}: {verdict or f'never calls {REPLAY_HELPER}'}")
    return problems
