"""Name rebinding inside Megatron-LM's test modules (shared by ``cpu_plugin`` and ``swap_plugin``).

Nothing here assigns to an attribute of a ``megatron`` module. A plugin registers
``original -> replacement`` pairs (by object identity) with :func:`register`; from then on every
module whose file lies under Megatron-LM's ``tests`` folder (test files, their helpers,
conftests) that is imported

* is executed with a private ``__builtins__`` whose ``__import__`` returns, for a
  ``from X import a, b`` statement whose names include a registered object (or a submodule that
  holds one), a read-through proxy of ``X`` that answers the replacement for those names. This
  covers the module-level imports and the imports inside test functions alike (a function keeps
  the ``__builtins__`` of the module it was defined in);
* has its global names rebound after it ran: a global that *is* a registered original becomes the
  replacement, and a global that is a module holding a registered original (``import a.b.c as m``)
  becomes a proxy of that module.

A proxy reads through to the real module (``proxy.attr`` is ``module.attr`` unless ``attr`` is
registered) and forwards ``setattr``/``delattr`` to it, so a test that monkeypatches a Megatron
module through its alias (``monkeypatch.setattr(dsa_module, "x", ...)``) patches the real module
as it does in the stock run; ``proxy.__dict__`` is the real module's, so pytest's ``monkeypatch``
(which reads the old value from ``target.__dict__``) restores the real attribute on undo instead
of deleting it. Setting a *registered* name through a proxy only changes the proxy (setting it
back to the real value restores the replacement). :func:`resolve` gives what test modules see for
an object now, so one plugin can wrap another's replacement.

A plugin may also register, with :func:`stub_import`, a stand-in for a module that is *not
installed* (``from transformer_engine.pytorch.fp8 import check_fp8_support``): such a statement in a
test module gets the stand-in only when the real import raises ``ModuleNotFoundError``.

Not covered: ``import a.b.c as m`` executed inside a function, and names reached through
``importlib``/``mock.patch("a.b.c.name")`` strings (those address the real modules, which is what
such patches are meant to do).
"""

from __future__ import annotations

import builtins
import importlib.abc
import os
import sys
import types
from typing import Any

__all__ = ["activate", "rebound", "register", "resolve", "stub_import", "tests_root"]

_MAP: dict[int, tuple[Any, Any]] = {}  # id(original) -> (original, replacement)
_PROXIES: dict[int, types.ModuleType] = {}
_REBOUND: dict[str, int] = {}  # "module.name" / "module: from X import a" -> times, for the report
_STUBS: dict[str, types.ModuleType] = {}  # module name -> stand-in (used only when not installed)
_STATE: dict[str, Any] = {"root": None, "finder": None}
_real_import = builtins.__import__


def tests_root() -> str | None:
    """The ``tests`` directory whose modules are rebound (set by :func:`activate`)."""
    return _STATE["root"]


def rebound() -> dict[str, int]:
    """What was rebound so far, with how often (imports inside functions repeat), for the report."""
    return dict(_REBOUND)


def register(original: Any, replacement: Any) -> None:
    """Make ``replacement`` what Megatron's test modules see where they name ``original``."""
    _MAP[id(original)] = (original, replacement)
    _PROXIES.clear()  # a cached proxy may predate this pair


def resolve(original: Any) -> Any:
    """What test modules see for ``original`` now (its replacement, or itself): a plugin that
    wraps an object another plugin already replaced wraps that replacement."""
    replacement = _replacement(original)
    return original if replacement is _MISSING else replacement


def stub_import(name: str, module: types.ModuleType) -> None:
    """Answer ``from <name> import ...`` in test modules with ``module`` when ``<name>`` cannot be
    imported (``ModuleNotFoundError``); an installed module is always used as it is."""
    _STUBS[name] = module


def _replacement(value: Any) -> Any:
    entry = _MAP.get(id(value))
    return entry[1] if entry is not None and entry[0] is value else _MISSING


_MISSING = object()
_SCOPE = "megatron"  # every registered original lives in a megatron module


def _is_module(value: Any) -> bool:
    return issubclass(type(value), types.ModuleType)  # type(): no __class__ lookup (deprecations)


def _holds_registered(module: types.ModuleType, _seen: set[int] | None = None) -> bool:
    """Whether ``module`` or one of its (loaded) submodules has a registered object as attribute."""
    seen = _seen if _seen is not None else set()
    if id(module) in seen or not module.__name__.startswith(_SCOPE):
        return False
    seen.add(id(module))
    prefix = module.__name__ + "."
    for value in list(vars(module).values()):
        if _replacement(value) is not _MISSING:
            return True
        if (
            _is_module(value)
            and value.__name__.startswith(prefix)
            and _holds_registered(value, seen)
        ):
            return True
    return False


class _ModuleProxy(types.ModuleType):
    """Read-through view of a module with the registered names replaced.

    ``proxy.__dict__`` is the real module's namespace: ``monkeypatch.setattr(proxy, name, v)``
    (pytest >= 9 reads the old value from ``target.__dict__``) then records the real old value and
    its undo restores it on the real module, instead of deleting the real attribute."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__(real.__name__, real.__doc__)
        own = object.__getattribute__(self, "__dict__")
        own["_proxy_real"] = real
        own["_proxy_overlay"] = {}

    def __getattribute__(self, name: str) -> Any:
        own = object.__getattribute__(self, "__dict__")
        if name == "__dict__":
            return vars(own["_proxy_real"])
        if name in ("__class__", "_proxy_real", "_proxy_overlay"):
            return object.__getattribute__(self, name)
        if name in own["_proxy_overlay"]:
            return own["_proxy_overlay"][name]
        value = getattr(own["_proxy_real"], name)
        return _view(value)

    def __setattr__(self, name: str, value: Any) -> None:
        own = object.__getattribute__(self, "__dict__")
        real = own["_proxy_real"]
        current = getattr(real, name, None)
        if _replacement(current) is not _MISSING:
            # A registered name: set on this view only; setting it back to the real value (a
            # monkeypatch undo) restores the replacement.
            if value is current:
                own["_proxy_overlay"].pop(name, None)
            else:
                own["_proxy_overlay"][name] = value
        elif name in own["_proxy_overlay"]:
            own["_proxy_overlay"][name] = value
        else:
            setattr(real, name, value)

    def __delattr__(self, name: str) -> None:
        own = object.__getattribute__(self, "__dict__")
        if name in own["_proxy_overlay"]:
            del own["_proxy_overlay"][name]
        else:
            delattr(own["_proxy_real"], name)

    def __dir__(self) -> list[str]:
        return dir(object.__getattribute__(self, "_proxy_real"))

    def __repr__(self) -> str:
        return f"<swap proxy of {object.__getattribute__(self, '_proxy_real')!r}>"


def _proxy(module: types.ModuleType) -> types.ModuleType:
    proxy = _PROXIES.get(id(module))
    if proxy is None:
        proxy = _PROXIES[id(module)] = _ModuleProxy(module)
    return proxy


def _view(value: Any) -> Any:
    """What a test module sees for ``value``."""
    replacement = _replacement(value)
    if replacement is not _MISSING:
        return replacement
    if _is_module(value) and not isinstance(value, _ModuleProxy) and _holds_registered(value):
        return _proxy(value)
    return value


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    try:
        module = _real_import(name, globals, locals, fromlist, level)
    except ModuleNotFoundError:
        if level or not fromlist or name not in _STUBS:
            raise
        importer = (globals or {}).get("__name__", "?")
        key = f"{importer}: from {name} import {', '.join(fromlist)} (stub)"
        _REBOUND[key] = _REBOUND.get(key, 0) + 1
        return _STUBS[name]
    if not fromlist or not _is_module(module) or not _MAP:
        return module
    names = [n for n in fromlist if n != "*"]
    if any(_view(getattr(module, n, None)) is not getattr(module, n, None) for n in names):
        importer = (globals or {}).get("__name__", "?")
        key = f"{importer}: from {module.__name__} import {', '.join(names)}"
        _REBOUND[key] = _REBOUND.get(key, 0) + 1
        return _proxy(module)
    return module


def _rebind_globals(module: types.ModuleType) -> None:
    for name, value in list(vars(module).items()):
        if name.startswith("__"):
            continue
        view = _view(value)
        if view is not value:
            setattr(module, name, view)  # the test module's own namespace
            key = f"{module.__name__}.{name}"
            _REBOUND[key] = _REBOUND.get(key, 0) + 1


class _Loader(importlib.abc.Loader):
    """Wraps the loader of a Megatron test module (pytest's assertion rewriter, usually)."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        shim = dict(vars(builtins))
        shim["__import__"] = _import
        vars(module)["__builtins__"] = shim
        self._inner.exec_module(module)
        _rebind_globals(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds every module with the other finders; wraps the loader of those under the root.

    (pytest imports a test file of a folder without ``__init__.py`` under its bare name, so the
    file's location decides, not the module name.)"""

    def find_spec(self, fullname, path, target=None):
        root = _STATE["root"]
        if root is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            origin = spec.origin or ""
            if (
                spec.loader is not None
                and origin.endswith(".py")
                and os.path.abspath(origin).startswith(root + os.sep)
            ):
                spec.loader = _Loader(spec.loader)
            return spec
        return None


def activate(tests_dir: str) -> None:
    """Rebind inside the modules under ``tests_dir`` imported from now on, and in those of them
    already imported (their globals only: their functions keep the real ``__import__``)."""
    root = os.path.abspath(tests_dir)
    _STATE["root"] = root
    if _STATE["finder"] is None:
        _STATE["finder"] = _Finder()
        sys.meta_path.insert(0, _STATE["finder"])
    for module in list(sys.modules.values()):
        if not _is_module(module):
            continue
        origin = vars(module).get("__file__") or ""
        if os.path.abspath(origin).startswith(root + os.sep):
            _rebind_globals(module)
