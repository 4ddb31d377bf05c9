"""The package's layout rules, read from its source: no import circle between its modules (and
conformance/'s); no private name of the package used outside it (the package's modules share
their plumbing, tests may reach it; the engine oracles of ``conformance/``, the tools and the
examples use public names), no private name in an export list; one name for the picks type;
every attribute of a package module a test reads (the GPU tests' too, which run only on the
device) present; and the library apart from its lab: no engine loader or test-only path in the
package, which imports neither ``conformance`` (but for the demo, lazily) nor ``tests``."""

import ast
import fnmatch
import pathlib
import re
import textwrap

import pytest

from .support.configs import ROOT

PACKAGE = ROOT / "dsa_precision"
# The engine oracles: beside the package, not installed (only tests, tools and examples use them).
CONFORMANCE = ROOT / "conformance"
# Names of earlier releases that now only point to their successors (``__getattr__`` messages).
RENAMED = ("ReplayInput", "EngineTopk", "CapturedTopk", "capture_topk", "save_topk", "load_topk")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
LAB_MODULES = {_module_name(p): p for p in sorted(CONFORMANCE.rglob("*.py"))}
# The modules whose private names no other module may use, and whose import graph has no circle.
KNOWN = {**MODULES, **LAB_MODULES}
# Roots of those modules' dotted names.
ROOTS = ("dsa_precision", "conformance")


def _resolve(module: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports(module: str, path: pathlib.Path) -> list[tuple[str, str, ast.AST]]:
    """``(imported module, imported name or "", node)`` of every import statement of the file,
    wherever it is (inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, "", node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, path, node)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((sub, "", node) if sub in KNOWN else (source, alias.name, node))
    return found


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in KNOWN}
    for module, path in KNOWN.items():
        for target, _, _ in _imports(module, path):
            if target in KNOWN and target != module:
                graph[module].add(target)
    return graph


def test_no_import_circle_between_the_modules_of_the_package():
    """The package's modules and conformance/'s, together."""
    graph = _package_graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            # A package's __init__ importing its own submodules is how a package is built.
            if nxt.startswith(node + ".") or node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(path: pathlib.Path, module: str) -> list[str]:
    """Private names of another package module that ``path`` imports or reads as an attribute."""
    problems = []
    aliases: dict[str, str] = {}  # local name -> package module it is bound to
    for target, name, node in _imports(module, path):
        if target.split(".")[0] not in ROOTS:
            continue
        parts = target.split(".")
        if any(_private(p) for p in parts) or _private(name):
            problems.append(f"line {node.lineno}: imports {target}{'.' + name if name else ''}")
        if not name:  # a module bound to a local name
            local = next(
                (a.asname or a.name for a in node.names if target.endswith(a.name.split(".")[-1])),
                None,
            )
            if local:
                aliases[local] = target
        elif f"{target}.{name}" in KNOWN:
            aliases[name] = f"{target}.{name}"
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and aliases[node.value.id] != module
            and _private(node.attr)
        ):
            problems.append(f"line {node.lineno}: reads {aliases[node.value.id]}.{node.attr}")
    return problems


@pytest.mark.parametrize("folder", ["conformance", "tools", "examples"])
def test_code_outside_the_package_uses_only_its_public_names(folder):
    """Private names (``_x``) are the package's plumbing: its modules share them between the
    floors of the dataflow (``select`` reads ``scoring._bshd_scores``), and tests may reach them;
    the engine oracles, the tools and the examples, like a user, use only public names."""
    problems = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        module = _module_name(path) if folder in ROOTS else path.stem
        found = _private_uses(path, module)
        if found:
            problems[str(path.relative_to(ROOT))] = found
    assert not problems, problems


def _outside_sources() -> list[pathlib.Path]:
    """The code beside the package: the engine oracles, tools and examples (their shell scripts
    too, whose embedded Python imports from the package)."""
    return [
        p for folder in ("conformance", "tools", "examples") for pattern in ("*.py", "*.sh")
        for p in sorted((ROOT / folder).rglob(pattern))
    ]  # fmt: skip


def test_shell_scripts_import_only_public_names():
    """``tools/gpu_session.sh`` runs Python that imports from the package: public names only."""
    problems = []
    for path in _outside_sources():
        if path.suffix != ".sh":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            found = re.search(r"from (dsa_precision[\w.]*) import ([\w, ]+)", line)
            if found and (
                any(_private(p) for p in found.group(1).split("."))
                or any(_private(n.strip()) for n in found.group(2).split(","))
            ):
                problems.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not problems, problems


def _export_lists(subpackages: bool) -> list[tuple[str, list[str]]]:
    """``(module, names of its __all__)`` of every package module that has one (with
    ``subpackages``: the ``__init__`` modules too)."""
    found = []
    for module, path in MODULES.items():
        if path.name == "__init__.py" and not subpackages:
            continue
        for node in ast.parse(path.read_text()).body:
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                and isinstance(node.value, ast.List | ast.Tuple)
            ):
                found.append(
                    (module, [e.value for e in node.value.elts if isinstance(e, ast.Constant)])
                )
    return found


def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    """Every name a module defines at its top level (functions, classes, assignments)."""
    found: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found[node.name] = node
        elif isinstance(node, ast.Assign):  # ``A = ...`` and ``A, B = ...``
            for target in node.targets:
                found.update((n.id, node) for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found[node.target.id] = node
    return found


def _annotation_names(node: ast.AST) -> set[str]:
    """The names the annotations of a public definition mention: a function's parameters and
    result, a class's fields and its public methods' signatures, a type alias's value, and the
    classes and constants its docstring names."""
    exprs: list[ast.AST] = []

    def signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        a = fn.args
        exprs.extend(x.annotation for x in [*a.posonlyargs, *a.args, *a.kwonlyargs] if x.annotation)
        exprs.extend(x.annotation for x in (a.vararg, a.kwarg) if x and x.annotation)
        if fn.returns:
            exprs.append(fn.returns)

    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        signature(node)
    elif isinstance(node, ast.ClassDef):
        for item in node.body:
            if isinstance(item, ast.AnnAssign):
                exprs.append(item.annotation)
            elif isinstance(item, ast.FunctionDef) and (
                not _private(item.name) or item.name == "__init__"
            ):
                signature(item)
    names = set()
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        # the classes and constants its docstring names (``:class:`PrecisionLayerSpec```)
        names |= set(
            re.findall(r":(?:class|data):`~?(?:[\w.]*\.)?(\w+)`", ast.get_docstring(node) or "")
        )
    if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
        # a type alias (``Format = Literal[...]``); a constant's value names nothing
        names |= {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
    for expr in exprs:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):  # a quoted annotation
            expr = ast.parse(expr.value, mode="eval")
        names |= {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}
    return names


def _public_api() -> set[tuple[str, str]]:
    """``(module, name)`` of the public API: the user API (``dsa_precision``,
    ``dsa_precision.capture``, ``dsa_precision.megatron``), the names the engine oracles, tools
    or examples read, and the types these mention in their signatures and fields (a user holds
    what the API returns and builds what it takes), followed through the modules they come from."""
    outside = "\n".join(p.read_text() for p in _outside_sources())
    trees = {m: ast.parse(p.read_text()) for m, p in MODULES.items()}
    defs = {m: _top_level(t) for m, t in trees.items()}
    sources: dict[str, dict[str, str]] = {}  # module -> local name -> module it imports it from
    for module, path in MODULES.items():
        sources[module] = {}
        for node in trees[module].body:
            if isinstance(node, ast.ImportFrom):
                source = _resolve(module, path, node)
                for alias in node.names:
                    sources[module][alias.asname or alias.name] = source

    def home(module: str, name: str) -> tuple[str, str] | None:
        seen = set()
        while module in MODULES and (module, name) not in seen:
            seen.add((module, name))
            if name in defs[module]:
                return module, name
            module = sources[module].get(name, "")
        return None

    todo = []
    for module, names in _export_lists(subpackages=True):
        user = module in ("dsa_precision", "dsa_precision.capture", "dsa_precision.megatron")
        for name in names:
            if user or re.search(rf"\b{re.escape(name)}\b", outside):
                todo.append(home(module, name))
    api: set[tuple[str, str]] = set()
    while todo:
        found = todo.pop()
        if found is None or found in api:
            continue
        api.add(found)
        module, name = found
        todo += [home(module, n) for n in _annotation_names(defs[module][name])]
    return api


@pytest.mark.parametrize(
    "source, expected",
    [
        ("def f(a: Rule, *, b: int | Format = 1) -> Report: ...", {"Rule", "int", "Format", "Report"}),
        ("def f(*args: Spec, **kw: Opts): ...", {"Spec", "Opts"}),
        ('def f(a: "Quoted[Inner]") -> None: ...', {"Quoted", "Inner"}),
        ("class C:\n    x: Field\n    def m(self, y: Arg) -> Out: ...\n    def _p(self, z: Hidden): ...",
         {"Field", "Arg", "Out"}),
        ('class C:\n    """Holds a :class:`~pkg.Spec` and :data:`SAME`."""', {"Spec", "SAME"}),
        ("Format = Literal['a', 'b']", {"Literal"}),
        ("VERSION = '0.19.2'", set()),
    ],
)  # fmt: skip
def test_the_public_api_follows_what_a_definition_names(source, expected):
    """What :func:`_public_api` follows from a public definition: its annotations (quoted ones
    too), a class's fields and public methods, a type alias's value, its docstring's classes and
    constants; a constant's string value names nothing, a private method's signature neither."""
    node = ast.parse(source).body[0]
    assert _annotation_names(node) == expected


def test_module_export_lists_name_only_the_public_api():
    """A module's ``__all__`` is its share of the public API (:func:`_public_api`); the rest is
    the package's plumbing, left out of it and private (tests may reach it)."""
    api = _public_api()
    problems = {}
    for module, names in _export_lists(subpackages=False):
        extra = [n for n in names if (module, n) not in api]
        if extra:
            problems[module] = extra
    assert not problems, problems


def test_every_name_of_a_package_module_is_exported_or_private():
    """PEP 8's rule: a module's top-level names are either listed in its ``__all__`` (public) or
    start with an underscore (plumbing, shared between the package's modules, reached by tests)."""
    exports = dict(_export_lists(subpackages=True))
    problems = {}
    for module, path in MODULES.items():
        names = exports.get(module, [])
        # an underscore: private, or a dunder (``__all__``, ``__version__``)
        loose = [n for n in _top_level(ast.parse(path.read_text())) if not n.startswith("_")]
        loose = [n for n in loose if n not in names]
        if loose:
            problems[module] = loose
    assert not problems, problems


def test_module_export_lists_hold_public_names_only():
    """A module's ``__all__`` is what it offers; plumbing stays out of it (and private)."""
    problems = {}
    for module, names in _export_lists(subpackages=True):
        private = [n for n in names if _private(n)]
        if private:
            problems[module] = private
    assert not problems, problems


def test_one_name_for_the_picks_type():
    """The picks of a micro-batch with their layout are ``TopkPicks`` everywhere; the names of
    earlier releases appear only in the pointers that say so."""
    users = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        for name in RENAMED:
            for line in text.splitlines():
                if name in line and "is gone" not in line and f'"{name}"' not in line:
                    users.setdefault(str(path.relative_to(ROOT)), []).append(line.strip())
    assert not users, users


@pytest.mark.parametrize(
    "module, name, new",
    [
        ("dsa_precision.capture", "ReplayInput", "TopkPicks"),
        ("dsa_precision.megatron", "EngineTopk", "TopkPicks"),
        ("dsa_precision.megatron", "CapturedTopk", "TopkPicks"),
        ("dsa_precision.megatron", "capture_topk", "record_topk"),
        ("dsa_precision.megatron", "save_topk", "save_picks"),
        ("dsa_precision.megatron", "load_topk", "load_picks"),
    ],
)
def test_old_names_say_the_new_one(module, name, new):
    if module == "dsa_precision.megatron":
        pytest.importorskip("megatron.core")
    mod = __import__(module, fromlist=["_"])
    with pytest.raises(AttributeError, match=new):
        getattr(mod, name)


def _module_aliases(tree: ast.AST) -> dict[str, str]:
    """``{local name: dsa_precision or conformance module}`` bound by the file's imports (inside
    functions too): ``import dsa_precision.x as y``, ``from dsa_precision import x [as y]`` where
    ``x`` is a module (the same for ``conformance``)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ROOTS and a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ROOTS:
            for a in node.names:
                if f"{node.module}.{a.name}" in KNOWN:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


TEST_FILES = sorted((ROOT / "tests").rglob("test_*.py"))


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: str(p.relative_to(ROOT / "tests")))
def test_every_package_attribute_a_test_reads_exists(path):
    """A GPU test runs only on the GPU host; the attributes it reads of the package's modules
    (``scoring._constant_offsets``, ``prepare._kernel_rope_tables``) are checked here, on every
    machine, so a renamed or moved name fails in CI rather than on the device."""
    import importlib

    tree = ast.parse(path.read_text())
    aliases = _module_aliases(tree)
    missing = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and isinstance(node.ctx, ast.Load)
        ):
            module = importlib.import_module(aliases[node.value.id])
            if not hasattr(module, node.attr):
                missing.append(f"line {node.lineno}: {aliases[node.value.id]}.{node.attr}")
    assert not missing, missing


# ---------------------------------------------------------------- the library apart from its lab

# The one package module that may import conformance (lazily: a pip install has none).
LAZY_CONFORMANCE = frozenset({"dsa_precision.cli.demo"})
# Module names that belong to the lab (conformance/, tests/support/), never to the package.
LAB_NAMES = (
    "engine_kernels", "sglang_*", "lmdeploy_*", "vllm_topk", "legacy_*", "loader", "oracles",
    "fused", "sparse_attention",
)  # fmt: skip
_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError"}


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    caught = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(c, ast.Name) and c.id in _IMPORT_ERRORS for c in caught)


def _placed_imports(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Every import statement with where it stands: ``(node, inside a function, inside the body
    of a ``try`` that catches ImportError)``."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool, bool]] = []

    def visit(node: ast.AST, in_function: bool, guarded: bool) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append((node, in_function, guarded))
            return
        in_function = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        if isinstance(node, ast.Try):
            catches = any(_catches_import_error(h) for h in node.handlers)
            for stmt in node.body:
                visit(stmt, in_function, guarded or catches)
            for other in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(other, in_function, guarded)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, in_function, guarded)

    visit(tree, False, False)
    return found


def _lab_import_problems(module: str, path: pathlib.Path) -> list[str]:
    """The imports of ``tests`` or ``conformance`` in a package module (anywhere in it), but for
    the lazy, ImportError-guarded import of ``conformance`` by :data:`LAZY_CONFORMANCE`."""
    problems = []
    for node, in_function, guarded in _placed_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            targets = [_resolve(module, path, node)]
        for target in targets:
            root = target.split(".")[0]
            if root == "tests":
                problems.append(f"line {node.lineno}: imports {target}")
            elif root == "conformance" and module not in LAZY_CONFORMANCE:
                problems.append(f"line {node.lineno}: imports {target} (not installed)")
            elif root == "conformance" and not (in_function and guarded):
                problems.append(
                    f"line {node.lineno}: imports {target} outside a function's "
                    "try / except ImportError (a pip install has no conformance/)"
                )
    return problems


def test_the_package_imports_neither_conformance_nor_tests():
    """The installed package stands alone: the engine oracles (``conformance/``) and the tests'
    support stay in the source checkout; only the demo imports ``conformance``, inside a function
    and guarded by ImportError, and says so when it is not there."""
    problems = {}
    for module, path in MODULES.items():
        found = _lab_import_problems(module, path)
        if found:
            problems[str(path.relative_to(ROOT))] = found
    assert not problems, problems


@pytest.mark.parametrize(
    "module, source, expected",
    [
        ("dsa_precision.x", "import conformance.loader", ["imports conformance.loader"]),
        (
            "dsa_precision.x",
            "def f():\n    from tests.support import helpers",
            ["imports tests.support"],
        ),
        ("dsa_precision.cli.demo", "from conformance.inference import f", ["outside a function"]),
        (
            "dsa_precision.cli.demo",
            "def f():\n    try:\n        import conformance\n    except ValueError:\n        pass",
            ["outside a function"],
        ),
        (
            "dsa_precision.cli.demo",
            "def f():\n    try:\n        from conformance import inference\n"
            "    except ImportError:\n        pass",
            [],
        ),
        (
            "dsa_precision.x",
            "def f():\n    try:\n        import conformance\n    except ImportError:\n        pass",
            ["(not installed)"],
        ),
    ],
)
def test_the_lab_import_check_sees_each_case(tmp_path, module, source, expected):
    path = tmp_path / "x.py"
    path.write_text(textwrap.dedent(source))
    problems = _lab_import_problems(module, path)
    assert len(problems) == len(expected), problems
    for problem, part in zip(problems, expected, strict=True):
        assert part in problem, problem


def test_the_package_holds_no_engine_loader_nor_test_only_path():
    """The engines' loaders live in ``conformance/`` and the fused attention test path in
    ``tests/support/``: no module or folder of the package is named like one of them."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for part in path.relative_to(PACKAGE).with_suffix("").parts:
            if any(fnmatch.fnmatchcase(part, pattern) for pattern in LAB_NAMES):
                found.append(str(path.relative_to(ROOT)))
    assert not found, found
