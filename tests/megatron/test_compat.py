"""``dsa_precision.megatron.compat`` lists exactly the Megatron surface the package uses.

The list is pinned against the package's own source: an AST walk of every module of
``dsa_precision`` that imports megatron collects the names it imports, the module functions it
calls (with each call's positional count and keywords), the methods of the Megatron classes it
subclasses that it overrides or calls, the instance attributes it reads on them and their
attributes, the ``PackedSeqParams`` and config fields it reads. Each set must equal compat's.
Then the check itself: a changed megatron-core gives one ``ImportError`` naming the version and
every change.
"""

import ast
import dataclasses
import importlib.util
import inspect
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from megatron.core.transformer.transformer_config import MLATransformerConfig

import dsa_precision
from dsa_precision.megatron import compat
from dsa_precision.megatron.config import PRECISION_FIELDS

from ..support.megatron import (
    make_attention,
    make_config,
)

PACKAGE = Path(dsa_precision.__file__).parent
# Variables whose Megatron type the AST cannot see: the spec backend (LocalDSASpecProvider's base
# is the one the package calls layer_norm on).
VARIABLE_TYPES = {"backend": "megatron.core.models.backends.LocalSpecProvider"}
CONFIG_NAMES = {f.name for f in dataclasses.fields(MLATransformerConfig)} - set(PRECISION_FIELDS)
BRIDGE = "megatron.bridge"


def _shape(call: ast.Call) -> tuple[int, tuple[str, ...]] | None:
    if any(isinstance(a, ast.Starred) for a in call.args) or any(
        k.arg is None for k in call.keywords
    ):
        return None  # forwarded *args / **kwargs: the override's signature is checked instead
    return len(call.args), tuple(sorted(k.arg for k in call.keywords))


class _Surface(ast.NodeVisitor):
    """What one module of the package uses of megatron."""

    def __init__(self, used: "Used") -> None:
        self.used = used
        self.names: dict[str, str] = {}  # local name -> dotted megatron path
        self.cls: tuple[str, type, set[str]] | None = None  # (path, base, names we define)

    # -- imports and module attributes

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.startswith("megatron") and alias.asname:
                self.names[alias.asname] = alias.name
                self.used.paths[alias.name]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and (node.module or "").startswith("megatron"):
            for alias in node.names:
                path = f"{node.module}.{alias.name}"
                self.names[alias.asname or alias.name] = path
                self.used.paths[path]

    def _path(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return self.names.get(node.id) or VARIABLE_TYPES.get(node.id)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            base = self.names.get(node.value.id) or VARIABLE_TYPES.get(node.value.id)
            if base is not None:
                return f"{base}.{node.attr}"
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        path = self._path(node)
        if path is not None:
            self.used.paths[path]
        value = node.value
        if isinstance(value, ast.Name) and value.id == "packed_seq_params":
            self.used.packed.add(node.attr)
        if isinstance(value, ast.Name) and value.id == "config" and node.attr in CONFIG_NAMES:
            self.used.config.add(node.attr)
        if self.cls is not None:
            self._self_attribute(node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        path = self._path(node.func)
        shape = _shape(node)
        if path is not None and shape is not None:
            self.used.paths[path].add(shape)
        if self.cls is not None and shape is not None:
            func = node.func  # self.A.B(...) on a Megatron instance attribute A
            if (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Attribute)
                and isinstance(func.value.value, ast.Name)
                and func.value.value.id == "self"
            ):
                self.used.calls_of[(self._short(), func.value.attr, func.attr)].add(shape)
        if (
            node.func.__class__ is ast.Name
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in CONFIG_NAMES
        ):
            self.used.config.add(node.args[1].value)
        self.generic_visit(node)

    # -- subclasses of Megatron classes

    def _short(self) -> str:
        return self.cls[0].rsplit(".", 1)[1]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = [self._path(b) for b in node.bases]
        bases = [b for b in bases if b is not None]
        if not bases:
            return self.generic_visit(node)
        (path,) = bases
        # Megatron-Bridge does not import without Transformer Engine: its base is not resolved,
        # and every method the subclass defines counts as an override (BRIDGE_METHODS).
        base = None if path.startswith(BRIDGE) else compat._resolve(path)
        ours = set()
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                ours.add(item.target.id)
            if isinstance(item, ast.FunctionDef):
                setter = any(
                    isinstance(d, ast.Attribute) and d.attr == "setter" for d in item.decorator_list
                )
                if setter:  # a property over an attribute Megatron's __init__ sets
                    self.used.instance[path.rsplit(".", 1)[1]].add(item.name)
                elif (
                    (base is None or hasattr(base, item.name)) and not item.name.startswith("__")
                ) or (item.name in ("__init__", "__post_init__")):
                    self.used.methods[path].add(item.name)
                ours.add(item.name)
        for sub in ast.walk(node):  # what the subclass assigns on self is its own
            targets = sub.targets if isinstance(sub, ast.Assign) else []
            targets = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    if target.value.id == "self":
                        ours.add(target.attr)
        outer, self.cls = self.cls, (path, base, ours)
        self.used.paths[path]
        self.generic_visit(node)
        self.cls = outer

    def _self_attribute(self, node: ast.Attribute) -> None:
        path, base, ours = self.cls
        value = node.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            if value.func.id == "super":
                self.used.methods[path].add(node.attr)
            return
        if not isinstance(value, ast.Name) or value.id != "self":
            if (
                isinstance(value, ast.Attribute)
                and isinstance(value.value, ast.Name)
                and value.value.id == "self"
            ):  # self.A.B
                if value.attr == "config":
                    if node.attr in CONFIG_NAMES:
                        self.used.config.add(node.attr)
                elif value.attr == "pg_collection":
                    self.used.process_groups.add(node.attr)
                elif value.attr not in ours and value.attr not in ("indexer", "__dict__"):
                    self.used.attributes_of[(self._short(), value.attr)].add(node.attr)
            return
        name = node.attr
        if name in ours or name.startswith("__") or hasattr(torch.nn.Module, name):
            return
        if callable(getattr(base, name, None)):
            self.used.methods[path].add(name)
        else:
            self.used.instance[self._short()].add(name)


@dataclasses.dataclass
class Used:
    paths: dict = dataclasses.field(default_factory=lambda: defaultdict(set))
    methods: dict = dataclasses.field(default_factory=lambda: defaultdict(set))
    instance: dict = dataclasses.field(default_factory=lambda: defaultdict(set))
    attributes_of: dict = dataclasses.field(default_factory=lambda: defaultdict(set))
    calls_of: dict = dataclasses.field(default_factory=lambda: defaultdict(set))
    process_groups: set = dataclasses.field(default_factory=set)
    packed: set = dataclasses.field(default_factory=set)
    config: set = dataclasses.field(default_factory=set)


@pytest.fixture(scope="module")
def used() -> Used:
    used = Used()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "compat.py":
            continue  # the list itself
        tree = ast.parse(path.read_text(), filename=str(path))
        if "megatron" in path.parts or any(
            isinstance(n, ast.ImportFrom | ast.Import) and "megatron" in ast.dump(n)
            for n in ast.walk(tree)
        ):
            _Surface(used).visit(tree)
    return used


def test_compat_lists_every_megatron_name_the_package_uses(used):
    assert {p for p in used.paths if not p.startswith(BRIDGE)} == set(compat._CALLS)
    assert {p for p in used.paths if p.startswith(BRIDGE)} == set(compat._BRIDGE_CALLS)


@pytest.mark.parametrize("path", sorted(compat._CALLS) + sorted(compat._BRIDGE_CALLS))
def test_compat_lists_each_call_shape(used, path):
    listed = compat._CALLS.get(path, compat._BRIDGE_CALLS.get(path))
    assert used.paths[path] == set(listed), path


def test_compat_lists_the_methods_overridden_or_called(used):
    assert {p: sorted(m) for p, m in used.methods.items()} == {
        p: sorted(m) for p, m in {**compat._METHODS, **compat._BRIDGE_METHODS}.items()
    }


def test_compat_lists_the_instance_attributes_read(used):
    assert {c: sorted(a) for c, a in used.instance.items()} == {
        c: sorted(a) for c, a in compat._INSTANCE_ATTRIBUTES.items()
    }
    assert {k: sorted(v) for k, v in used.attributes_of.items()} == {
        k: sorted(v) for k, v in compat._ATTRIBUTES_OF.items()
    }
    for (cls, attr), names in compat._ATTRIBUTES_OF.items():
        for name, calls in names.items():
            assert used.calls_of[(cls, attr, name)] == set(calls)
    assert used.process_groups == set(compat._PROCESS_GROUP_FIELDS)


def test_compat_lists_the_fields_read(used):
    assert used.packed == set(compat._PACKED_SEQ_FIELDS)
    assert used.config == set(compat._CONFIG_FIELDS)


# ------------------------------------------------------------------------------- the check


def test_surface_check_passes_on_the_installed_release():
    assert compat._surface_problems() == []


def test_surface_check_names_the_version_and_every_change(monkeypatch):
    import megatron.core
    from megatron.core.transformer.experimental_attention_variant import dsa, dsa_layout

    monkeypatch.setattr(megatron.core, "__version__", "0.21.0rc0")
    monkeypatch.delattr(dsa.DSAttention, "_get_index_share_topk_holder")
    monkeypatch.setattr(dsa_layout, "ensure_sbhd", lambda tensor: tensor)
    monkeypatch.delattr(dsa_layout, "get_packed_qk_cu_seqlens")
    with pytest.raises(ImportError) as err:
        compat._check_megatron_core()
    text = str(err.value)
    assert "megatron-core 0.21.0rc0" in text and "0.19.2" in text
    assert "DSAttention._get_index_share_topk_holder is missing" in text
    assert "dsa_layout.ensure_sbhd(tensor) no longer takes (<2 positional>)" in text
    assert "dsa_layout.get_packed_qk_cu_seqlens is missing" in text


def test_a_built_layer_without_an_attribute_names_it(monkeypatch):
    """Instance attributes exist only on a constructed layer: checked as each one is built."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    real = dsa.DSAIndexer.__init__

    def without_rotary(self, *args, **kwargs):
        real(self, *args, **kwargs)
        del self.rotary_pos_emb  # a release that renamed it

    monkeypatch.setattr(dsa.DSAIndexer, "__init__", without_rotary)
    with pytest.raises(
        ImportError, match=r"DSAIndexer.__init__ no longer sets self.rotary_pos_emb"
    ):
        make_attention(make_config())


def test_built_layers_pass_the_instance_check():
    attn = make_attention(make_config(dsa_indexer_scoring_precision="fp8"))
    compat._check_built(attn, "DSAttention")
    compat._check_built(attn.indexer, "DSAIndexer")
    sig = inspect.signature(attn.indexer.rotary_pos_emb.get_rotary_seq_len)
    assert len(sig.parameters) >= 5


def test_import_fails_loudly_without_the_surface(monkeypatch):
    """A megatron-core without the DSA modules: one ImportError naming what to install."""
    from megatron.core.transformer import experimental_attention_variant as package

    monkeypatch.delattr(package, "dsa")
    monkeypatch.setitem(sys.modules, package.__name__ + ".dsa", None)
    with pytest.raises(ImportError, match=r"(?s)dsa.DSAIndexer is missing.*megatron-core==0\.19"):
        compat._check_megatron_core()


# ------------------------------------------------------------------------- Megatron-Bridge


def test_the_bridge_module_says_what_it_needs_where_bridge_does_not_import(monkeypatch):
    """Without an importable Megatron-Bridge (here: none, or one that needs Transformer Engine),
    importing the Bridge integration is one ImportError naming the release and the README
    section; the rest of dsa_precision.megatron imports without it."""
    monkeypatch.setitem(sys.modules, "megatron.bridge", None)
    monkeypatch.delitem(sys.modules, "dsa_precision.megatron.bridge", raising=False)
    with pytest.raises(ImportError, match=r"Megatron-Bridge 0\.6\.2.*'With Megatron-Bridge'"):
        import dsa_precision.megatron.bridge  # noqa: F401
    import dsa_precision.megatron as dsap

    assert dsap.DSAPrecisionTransformerConfig is not None


def test_the_bridge_surface_names_a_missing_name(monkeypatch):
    """A Megatron-Bridge without a listed name: the check names it, the version and the fix (a
    name of megatron-core stands in for the Bridge's, which does not import without TE)."""
    monkeypatch.setattr(compat, "_BRIDGE_CALLS", {"megatron.core.models.backends.NoSuch": ()})
    real = compat.importlib.import_module
    monkeypatch.setattr(  # "megatron.bridge imports"
        compat.importlib,
        "import_module",
        lambda name: None if name == "megatron.bridge" else real(name),
    )
    monkeypatch.setattr(compat, "_megatron_bridge_version", lambda: "9.9")
    with pytest.raises(
        ImportError,
        match=r"(?s)installed 9\.9.*backends\.NoSuch is missing.*megatron-bridge==0\.6\.2",
    ):
        compat._check_megatron_bridge()


@pytest.mark.skipif(
    importlib.util.find_spec("megatron.bridge") is None
    or importlib.util.find_spec("transformer_engine") is not None,
    reason="needs Megatron-Bridge installed without Transformer Engine (make test's environment)",
)
def test_an_installed_bridge_without_transformer_engine_is_named(monkeypatch):
    """``make test`` installs Megatron-Bridge; without TE it does not import, and the Bridge
    module says which import failed instead of a traceback from inside the Bridge."""
    monkeypatch.delitem(sys.modules, "dsa_precision.megatron.bridge", raising=False)
    with pytest.raises(ImportError, match=r"does not import here \(No module named 'transformer_"):
        import dsa_precision.megatron.bridge  # noqa: F401
