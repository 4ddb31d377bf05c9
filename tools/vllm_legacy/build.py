"""Build vLLM 0.28.0's ``indexer_k_quant_and_cache`` (csrc/libtorch_stable/cache_kernels.cu,
unmodified) with ``binding.cpp`` into ``OUT/dsa_vllm_legacy.so`` (``torch.ops.dsa_vllm_legacy``).

    python3 build.py VLLM_SOURCE_ROOT OUT [--no-smoke] [--no-ninja]

The flags are vLLM's for that file (CMakeLists.txt ``_C_stable_libtorch``): torch's common nvcc
flags without the four ``__CUDA_NO_*`` defines (vLLM removes them for CUDA 12+),
``-DENABLE_FP8``, ``USE_CUDA``, ``TORCH_TARGET_VERSION`` 2.11, no fast math; sm_90a only.
Building and loading need no GPU; the smoke test (skipped by ``--no-smoke``) runs the op once.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

NAME = "dsa_vllm_legacy"
KERNEL = "csrc/libtorch_stable/cache_kernels.cu"
DEFINES = ["-DENABLE_FP8", "-DUSE_CUDA", "-DTORCH_TARGET_VERSION=0x020B000000000000ULL", "-DNDEBUG"]
UNDEFINES = [
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
]
GENCODE = ["-gencode", "arch=compute_90a,code=sm_90a"]


def _toolkit_extras(cuda_home: Path, out: Path) -> tuple[list[str], list[str]]:
    """Include folders and link flags beyond torch's: cuBLAS's headers (``torch_utils.h``
    includes ``cublas_v2.h``; when the toolkit has none, links in ``out`` to those of torch's
    nvidia-cublas wheel, and no other header of it) and the driver (vLLM links it,
    cmake/utils.cmake:655: ``swap_blocks_batch``, in the same file, resolves
    ``cuMemcpyBatchAsync`` through ``cuGetProcAddress``)."""
    includes = []
    if not (cuda_home / "include/cublas_v2.h").is_file():
        spec = importlib.util.find_spec("nvidia")
        roots = list(spec.submodule_search_locations or []) if spec else []
        found = [h for r in roots for h in sorted(Path(r).glob("*/include/cublas_v2.h"))]
        if found:
            folder = out / "cublas-include"
            folder.mkdir(exist_ok=True)
            for header in found[0].parent.glob("cublas*.h"):
                (folder / header.name).unlink(missing_ok=True)
                (folder / header.name).symlink_to(header)
            includes.append(str(folder))
    stubs = cuda_home / "lib64/stubs"
    driver = [f"-L{stubs}", "-lcuda"] if (stubs / "libcuda.so").is_file() else ["-l:libcuda.so.1"]
    return includes, driver


def build(vllm: Path, out: Path, *, ninja: bool = True) -> Path:
    """Compile, link and load the extension (loading needs no GPU); its path. Without ninja
    (``cpp_extension.load`` needs it) the same flags go through setuptools' ``build_ext``."""
    import torch
    from torch.utils import cpp_extension

    out.mkdir(parents=True, exist_ok=True)
    includes, driver = _toolkit_extras(Path(cpp_extension.CUDA_HOME or "/usr/local/cuda"), out)
    sources = [str(Path(__file__).with_name("binding.cpp")), str(vllm / KERNEL)]
    include_paths = [str(vllm / "csrc"), *includes]
    cflags, cuda_flags = ["-O3", *DEFINES], ["-O3", *DEFINES, *UNDEFINES, *GENCODE]
    library = out / f"{NAME}.so"
    if ninja and cpp_extension.is_ninja_available():
        cpp_extension.load(
            name=NAME, sources=sources, extra_include_paths=include_paths,
            extra_cflags=cflags, extra_cuda_cflags=cuda_flags, extra_ldflags=driver,
            build_directory=str(out), is_python_module=False, verbose=True,
        )  # fmt: skip
        return library
    from setuptools import setup

    extension = cpp_extension.CUDAExtension(
        NAME, sources, include_dirs=include_paths, extra_link_args=driver,
        extra_compile_args={"cxx": cflags, "nvcc": cuda_flags},
    )  # fmt: skip
    setup(
        name=NAME, ext_modules=[extension],
        cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=False)},
        script_args=["build_ext", "--build-lib", str(out), "--build-temp", str(out / "tmp")],
    )  # fmt: skip
    built = next(p for p in out.glob(f"{NAME}*.so") if p != library)
    built.replace(library)
    torch.ops.load_library(str(library))
    return library


def smoke(library: Path) -> None:
    """One call on a random BF16 key: the E4M3 bytes and scales, against the formula in torch."""
    import torch

    torch.ops.load_library(str(library))
    s, d, block = 70, 128, 64
    k = (torch.randn(s, d, device="cuda") * 3).to(torch.bfloat16)
    cache = torch.zeros(2, block, d + 4, dtype=torch.uint8, device="cuda")
    slots = torch.arange(s, device="cuda")
    torch.ops.dsa_vllm_legacy.indexer_k_quant_and_cache(k, cache, slots, 128, "ue8m0")
    flat = cache.view(2, block * (d + 4))
    k8 = flat[:, : block * d].reshape(-1, d)[:s]
    scale = flat[:, block * d :].contiguous().view(torch.float32).reshape(-1)[:s]
    a = (
        k.float().abs().amax(-1).clamp_min(torch.tensor(1e-4, dtype=torch.float32, device=k.device))
        / 448.0
    )
    want_scale = torch.exp2(torch.ceil(torch.log2(a)))
    want = (k.float() / want_scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    print(f"{library}: {int((k8 != want).sum())} of {k8.numel()} bytes and "
          f"{int((scale != want_scale).sum())} of {s} scales differ from the formula in torch")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("vllm", type=Path, help="the extracted vllm-0.28.0 folder")
    parser.add_argument("out", type=Path, help="build folder (the library goes there)")
    parser.add_argument("--no-smoke", action="store_true", help="skip the GPU smoke test")
    parser.add_argument("--no-ninja", action="store_true", help="setuptools, not ninja")
    args = parser.parse_args(argv)
    library = build(args.vllm.resolve(), args.out.resolve(), ninja=not args.no_ninja)
    if not args.no_smoke:
        smoke(library)
    return 0


if __name__ == "__main__":
    sys.exit(main())
