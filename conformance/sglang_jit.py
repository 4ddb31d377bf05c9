"""SGLang 0.5.23's JIT CUDA build, run by the oracles of its indexer kernels.

SGLang's kernels (``sglang/kernels``) are JIT CUDA: a Python wrapper calls SGLang's ``load_jit``,
which this module replaces by SGLang's own build code (``jit/utils/{common,arch}.py``,
``jit/utils/compile/{paths,cpp_args,spec,toolchain,ninja}.py``, unmodified, loaded by
:func:`sglang_stubs` with :func:`~.loader.load_module`) less its build cache: the same wrapper
translation unit, flags and ``build.ninja``, built by ninja (or the same commands) with the
host's nvcc into :func:`sglang_jit_dir` and loaded by apache-tvm-ffi (:class:`SglangJit`). The
stand-ins: ``sglang.srt.environ.envs`` (every switch off), ``sglang.srt.utils.common.is_cuda``,
``msgspec.Struct`` (a dataclass). Used by :mod:`.engine_kernels` (``sglang-fused``) and
:mod:`.sglang_unfused`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.machinery
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .loader import load_module, package

__all__ = [
    "SGLANG_COMMON_HEADERS",
    "SGLANG_JIT",
    "SGLANG_JIT_DIR_VAR",
    "SGLANG_JIT_PY",
    "SGLANG_KERNELS",
    "SGLANG_K_NORM_EPS",
    "SGLANG_PAGE",
    "SGLANG_SHARED_SHA256",
    "SglangEnvs",
    "SglangJit",
    "run_build_file",
    "sglang_jit_dir",
    "sglang_stubs",
    "sglang_toolchain_reason",
]

SGLANG_KERNELS = "sglang/kernels"
SGLANG_JIT = f"{SGLANG_KERNELS}/jit"
# SGLang's JIT utilities the oracles run (in this order: each imports only the ones before it).
SGLANG_JIT_PY = (
    "common",
    "arch",
    "compile/paths",
    "compile/cpp_args",
    "compile/spec",
    "compile/toolchain",
    "compile/ninja",
)
# The headers of SGLang's JIT include folder (jit/include/sgl_kernel) every indexer kernel of the
# oracles includes (what nvcc -M lists under SGLang's flags, inside the wheel; tvm-ffi's and
# CUDA's headers are the host's); each kernel set adds its own.
SGLANG_COMMON_HEADERS = (
    "bits.h",
    "math.cuh",
    "source_location.h",
    "tensor.h",
    "tile.cuh",
    "type.cuh",
    "utils.cuh",
    "utils.h",
    "vec.cuh",
    "warp.cuh",
)
# SHA-256 of the SGLang 0.5.23 files both SGLang oracles run, as its wheel ships them (sha256
# 8d257a31...): the JIT utilities (SGLANG_JIT_PY), the common headers (SGLANG_COMMON_HEADERS), and
# srt/layers/rotary_embedding/{utils,base}.py, in that order.
SGLANG_SHARED_SHA256: dict[str, str] = {
    "491cf8bec4102dcd9b4706c4d7202c6bd43f275be36c9f7a959cc89b156d62a3": "sglang 0.5.23",
    "e9427faad6479e47623315c38705ee209e239f9e6212712746678cb27000552b": "sglang 0.5.23",
    "bfa8a912174607c74237f1b5f45b0a87dc8da8b5f1f5be39868966787fae76e2": "sglang 0.5.23",
    "84be4f6ab4b3a435a424e2762cf2f48c25ccf57119e6971e83f4856d779757c3": "sglang 0.5.23",
    "f762d7d90adb2770988ab0d17b444496d9d611531ab136eb37b8c8707dd42b2f": "sglang 0.5.23",
    "987d4eccaa7947fa15f070cfbabb1165e43076f619f9c84d99a8e3f3f61ea483": "sglang 0.5.23",
    "082dff0b50a890f4987e1fb8caa0e0c6e77edfef766836ee4b17b5d3e514e218": "sglang 0.5.23",
    "5bab56d2578d151d3224994eeeae0abb939c26a1ac1e84205a1c942dab9cd605": "sglang 0.5.23",
    "73e182466976d821f8ad89017fd2492c50ea456d5e7007d4e869cb6730568477": "sglang 0.5.23",
    "300026cbeeabe03b10b0c46b70e2e85b19a743cbe9ff462faa1dff4268cf806e": "sglang 0.5.23",
    "c66eba28e0f7661711947309c12014d2e880025c7d91ff8a7ac544d4ece60ce2": "sglang 0.5.23",
    "692446727a0353f1eb0d7249f6564d2c79ee6c9066e2c61e2ab450014fb217b7": "sglang 0.5.23",
    "4c72b0892e8d003490bdab2633056172a674bc6a9689be552861564c7aaf8edc": "sglang 0.5.23",
    "18b0bb2e27dccc20d7509e8b6b6c16e2b57a5ce98be648865fb75059be8a13db": "sglang 0.5.23",
    "fe54010a29dd4d65110bf4afe60ff91b0f37f3b9704bb5bae4f1086347d7e32d": "sglang 0.5.23",
    "11224cc483b7fbc93e2bcb1c2092715d80f1fa645920f4c82ee0e1d45a4eb551": "sglang 0.5.23",
    "264e64c3f386a70de938ed831f05f7a5f3c4b3ed9cfea58e1fbad433a8f860db": "sglang 0.5.23",
    "828a50285218e40c3429d2f4e75b1d051e3a89d831a7ab005e8c2609278aeddc": "sglang 0.5.23",
    "2a2abfbef7be789d2e992478714a5040583e71ed71a1accd1fecd65cab5da297": "sglang 0.5.23",
}
# SGLang's LayerNorm default epsilon: the DSA indexer builds its k_norm without one.
SGLANG_K_NORM_EPS = 1e-6
# Where the oracle builds SGLang's JIT modules (default: <tempdir>/dsa-sglang-jit).
SGLANG_JIT_DIR_VAR = "DSA_SGLANG_JIT_DIR"
# SGLang's index-K cache page (DSATokenToKVPool.index_page_size on CUDA): the store kernel's
# template argument; each page holds 64 * 128 E4M3 bytes, then 64 float32 scales.
SGLANG_PAGE = 64


def sglang_jit_dir() -> Path:
    """The folder SGLang's JIT modules are built in (``DSA_SGLANG_JIT_DIR``, else a folder
    under the system's temporary directory): one subfolder per module and build."""
    value = os.environ.get(SGLANG_JIT_DIR_VAR)
    return Path(value) if value else Path(tempfile.gettempdir()) / "dsa-sglang-jit"


def _sglang_cuda_home() -> str:
    """The CUDA root as SGLang's toolchain resolves it (``compile/toolchain.py`` ``cuda_home``)."""
    configured = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if configured is not None:
        return configured
    nvcc = shutil.which("nvcc")
    return os.path.dirname(os.path.dirname(nvcc)) if nvcc is not None else "/usr/local/cuda"


def sglang_toolchain_reason(*, need_device: bool = True) -> str | None:
    """Why SGLang's JIT kernels cannot be built (or, with ``need_device``, run) here, or
    ``None``: apache-tvm-ffi (its headers, ``libtvm_ffi`` and ``load_module``), the nvcc and
    host C++ compiler SGLang's build invokes, a CUDA device."""
    if importlib.util.find_spec("tvm_ffi") is None:
        return "apache-tvm-ffi is not installed (the GPU bundle ships 0.1.15.post2)"
    nvcc = Path(_sglang_cuda_home()) / "bin" / "nvcc"
    if not nvcc.is_file():
        return (
            f"no nvcc at {nvcc} (SGLang's JIT build: CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda)"
        )
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no host C++ compiler {cxx!r} (SGLang links its modules with $CXX, default c++)"
    if need_device and not torch.cuda.is_available():
        return "SGLang's indexer kernels run on CUDA only"
    return None


class _MsgspecStruct:
    """``msgspec.Struct`` as SGLang's ``compile/spec.py`` uses it: a record of its annotated
    fields, frozen when the class says so (a dataclass; msgspec adds nothing the build reads)."""

    def __init_subclass__(cls, frozen: bool = False, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=frozen)(cls)


class SglangEnvs:
    """``sglang.srt.environ.envs`` for the JIT build: every switch it reads (only
    ``SGLANG_JIT_LOG_RESOURCE_USAGE`` on CUDA) at its default, off."""

    def __getattr__(self, name: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(get=lambda: False, is_set=lambda: False)


def sglang_stubs(root: Path) -> dict[str, types.ModuleType]:
    """The stand-in packages SGLang's JIT build code and kernel wrappers import, for the wheel's
    files under ``root`` (the folder holding ``sglang/``); the JIT utilities themselves are
    loaded into them by the caller."""
    jit = root / SGLANG_JIT
    stubs = {
        "msgspec": package("msgspec", Struct=_MsgspecStruct),
        "sglang": package("sglang"),
        "sglang.srt": package("sglang.srt"),
        "sglang.srt.environ": package("sglang.srt.environ", envs=SglangEnvs()),
        "sglang.srt.utils": package("sglang.srt.utils"),
        "sglang.srt.utils.common": package(
            "sglang.srt.utils.common",
            is_cuda=lambda: torch.version.cuda is not None,
            get_cuda_version=lambda: tuple(
                int(v) for v in (torch.version.cuda or "0.0").split(".")
            ),
        ),
        "sglang.kernels": package("sglang.kernels"),
        # The real folder: compile/paths.py finds include/ and csrc/ beside this package's origin.
        "sglang.kernels.jit": package("sglang.kernels.jit", jit),
        "sglang.kernels.jit.utils": package("sglang.kernels.jit.utils", jit / "utils"),
        "sglang.kernels.jit.utils.compile": package(
            "sglang.kernels.jit.utils.compile", jit / "utils/compile"
        ),
    }
    stubs["sglang.kernels.jit"].__spec__ = importlib.machinery.ModuleSpec(
        "sglang.kernels.jit", None, origin=os.fspath(jit / "__init__.py")
    )
    for name in ("ops", "ops.attention", "ops.attention.dsa", "ops.attention.dsv4"):
        full = f"sglang.kernels.{name}"
        stubs[full] = package(full, root / "sglang/kernels" / name.replace(".", "/"))
    return stubs


def _ninja_unescape(text: str, scope: Mapping[str, str]) -> str:
    """A ninja value with its ``$`` escapes and ``$name`` / ``${name}`` variables expanded."""

    def sub(match: re.Match) -> str:
        token = match.group(1)
        if token in ("$", " ", ":"):
            return token
        return scope.get(token.strip("{}"), "")

    return re.sub(r"\$(\$| |:|\{\w+\}|\w+)", sub, text)


def run_build_file(build_dir: Path, build_file: str) -> None:
    """Run the ``build.ninja`` SGLang generated (``compile/ninja.py``: variables, the rules
    ``compile_cxx`` / ``compile_cuda`` / ``link``, builds in dependency order) where no ninja
    is installed: each build's rule command, expanded as ninja expands it, in the file's order."""
    variables: dict[str, str] = {}
    rules: dict[str, str] = {}
    rule = None
    for line in build_file.splitlines():
        if not line.strip():
            continue
        if line.startswith("  ") and rule is not None:
            key, _, value = line.strip().partition(" = ")
            if key == "command":
                rules[rule] = value
            continue
        rule = None
        if line.startswith("rule "):
            rule = line.split()[1]
        elif line.startswith("build "):
            out, _, rest = line[len("build ") :].partition(": ")
            name, *inputs = re.split(r"(?<!\$) ", rest)  # "$ " is a space inside a path
            scope = {**variables, "out": _ninja_unescape(out, {}),
                     "in": " ".join(_ninja_unescape(i, {}) for i in inputs)}  # fmt: skip
            command = _ninja_unescape(rules[name], scope)
            done = subprocess.run(
                command, shell=True, cwd=build_dir, capture_output=True, text=True, check=False
            )
            if done.returncode != 0:
                raise RuntimeError(
                    f"SGLang JIT build step failed in {build_dir}: {command}\n{done.stdout}"
                    f"\n{done.stderr}"
                )
        elif " = " in line and not line.startswith("default "):
            key, _, value = line.partition(" = ")
            variables[key.strip()] = _ninja_unescape(value, variables)


class SglangJit:
    """SGLang's ``load_jit`` (``compile/loader.py``) on CUDA, with SGLang's own code for every
    step that reaches the compiler: the ``BuildSpec`` it composes (``DEFAULT_CFLAGS``, the
    target flags of ``arch.get_default_target_flags``, ``DEFAULT_INCLUDE``), the wrapper
    translation unit and the ``build.ninja`` (``spec.py``, ``ninja.generate``), built by
    ``ninja.build`` (or, with no ninja installed, the same commands) and loaded by
    ``tvm_ffi.load_module``. Only SGLang's build cache (``compile/cache.py``) is replaced: one
    folder per build under :func:`sglang_jit_dir`, keyed by the build file, the generated
    sources and the SHA-256 of the files."""

    def __init__(self, modules: Mapping[str, types.ModuleType], files_key: str) -> None:
        self.m = modules
        self.files_key = files_key
        self.built: list[Path] = []

    @classmethod
    def load(
        cls, path_of: Callable[[str], Path], stubs: dict[str, types.ModuleType], files_key: str
    ) -> SglangJit:
        """SGLang's JIT utilities (:data:`SGLANG_JIT_PY`, ``path_of(relative path)`` each),
        loaded unmodified into ``stubs`` as submodules of their package, in order, and the
        build over them (``files_key``: the SHA-256 of the engine files it builds from). The
        package exports what ``sglang/kernels/jit/utils/__init__.py`` does and every kernel file
        loaded here imports from it; ``load_jit`` is SGLang's loader less its cache
        (:meth:`load_jit`). A caller adds the exports only its files import."""
        modules: dict[str, types.ModuleType] = {}
        for rel in SGLANG_JIT_PY:
            name = "sglang.kernels.jit.utils." + rel.replace("/", ".")
            modules[rel] = stubs[name] = load_module(
                path_of(f"{SGLANG_JIT}/utils/{rel}.py"), name, stubs
            )
            parent, _, leaf = name.rpartition(".")
            setattr(stubs[parent], leaf, modules[rel])
        jit = cls(modules, files_key)
        stubs["sglang.kernels.jit.utils"].__dict__.update(
            cache_once=modules["common"].cache_once,
            is_arch_support_pdl=modules["arch"].is_arch_support_pdl,
            make_cpp_args=modules["compile/cpp_args"].make_cpp_args,
            load_jit=jit.load_jit,
        )
        return jit

    def build(
        self,
        arch: types.ModuleType,
        capability: tuple[int, int] | None,
        *instantiate: Callable[[], object],
    ) -> list[Path]:
        """Call each of SGLang's JIT module getters (building its module) under SGLang's own
        ``arch.override_jit_cuda_arch(*capability)`` (``(9, 0)``: ``sm_90a``, without a GPU) or,
        for ``None``, for the local GPU; the shared libraries built or found."""
        context = (
            arch.override_jit_cuda_arch(*capability)
            if capability is not None
            else contextlib.nullcontext()
        )
        start = len(self.built)
        with context:
            for make in instantiate:
                make()
        return self.built[start:]

    def load_jit(
        self,
        *args: str,
        cpp_files: list[str] | None = None,
        cuda_files: list[str] | None = None,
        cpp_wrappers: list[tuple[str, str]] | None = None,
        cuda_wrappers: list[tuple[str, str]] | None = None,
        extra_cflags: list[str] | None = None,
        extra_cuda_cflags: list[str] | None = None,
        extra_ldflags: list[str] | None = None,
        extra_include_paths: list[str] | None = None,
        extra_dependencies: list[str] | None = None,
        header_only: bool = True,
    ) -> Any:
        if extra_dependencies:
            raise NotImplementedError(f"SGLang JIT dependencies {extra_dependencies} (cutlass...)")
        paths, spec_mod = self.m["compile/paths"], self.m["compile/spec"]
        spec = spec_mod.BuildSpec(
            module_args=tuple(str(arg) for arg in args),
            cpp_files=spec_mod.resolve_sources(cpp_files),
            cuda_files=spec_mod.resolve_sources(cuda_files),
            cpp_wrappers=tuple(cpp_wrappers or ()),
            cuda_wrappers=tuple(cuda_wrappers or ()),
            cflags=tuple(paths.DEFAULT_CFLAGS + (extra_cflags or [])),
            cuda_cflags=tuple(
                self.m["arch"].get_default_target_flags() + (extra_cuda_cflags or [])
            ),
            ldflags=tuple(paths.DEFAULT_LDFLAGS + (extra_ldflags or [])),
            include_paths=tuple(list(paths.DEFAULT_INCLUDE) + (extra_include_paths or [])),
            header_only=header_only,
        )
        ninja = self.m["compile/ninja"]
        build_file = ninja.generate(spec)
        key = hashlib.sha256(self.files_key.encode())
        key.update(build_file.encode())
        for unit in spec.translation_units():
            key.update((unit.source or unit.filename).encode())
        final = sglang_jit_dir() / f"{spec.module_name}-{key.hexdigest()[:16]}"
        library = final / f"{spec.module_name}.so"
        if not library.is_file():
            final.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=final.parent))
            try:
                if shutil.which("ninja") is not None:
                    ninja.build(spec=spec, build_dir=staging, build_file=build_file)
                else:
                    for unit in spec.translation_units():  # what ninja.build writes first
                        if unit.source is not None:
                            (staging / unit.filename).write_text(unit.source)
                    (staging / "build.ninja").write_text(build_file)
                    run_build_file(staging, build_file)
                with contextlib.suppress(OSError):  # a concurrent build may have won
                    staging.rename(final)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        self.built.append(library)
        from tvm_ffi import load_module as tvm_load_module

        return tvm_load_module(os.fspath(library))
