"""The vLLM 0.28 key-kernel oracle (conformance.legacy_kernel) and its pack script
(tools/vllm_legacy_kernel.sh) without a GPU: the pinned file list, what pack accepts and refuses,
where the oracle says it cannot run, and the key it feeds the kernel. The kernel itself runs in
tests/gpu/test_preprocess_quantize.py."""

import dataclasses
import shutil
import subprocess
import tarfile

import pytest
import torch

from conformance import engine_kernels as ek
from conformance import legacy_kernel as lk
from dsa_precision import ENGINE_PROFILES
from dsa_precision.cli.synthetic import synthetic_indexer_inputs
from dsa_precision.preprocess import IndexerPreprocess

from ..support.configs import ROOT

SCRIPT = ROOT / "tools/vllm_legacy_kernel.sh"
SUMS = ROOT / "tools/vllm_legacy/SHA256SUMS"


def _sums(path):
    rows = [line.split("  ", 1) for line in path.read_text().splitlines()]
    return {name: digest for digest, name in rows}


def test_the_oracle_and_the_pack_script_pin_the_same_files():
    assert _sums(SUMS) == lk.SOURCE_SHA256
    assert "csrc/libtorch_stable/cache_kernels.cu" in lk.SOURCE_SHA256


def _tarball(path, files):
    src = path.parent / "src"
    for name, text in files.items():
        (src / "vllm-0.28.0" / name).parent.mkdir(parents=True, exist_ok=True)
        (src / "vllm-0.28.0" / name).write_text(text)
    with tarfile.open(path, "w:gz") as tar:
        tar.add(src / "vllm-0.28.0", arcname="vllm-0.28.0")
    return path


def _pack(script, tarball, out):
    return subprocess.run(
        ["bash", str(script), "pack", str(tarball), str(out)], capture_output=True, text=True
    )


def test_pack_refuses_a_tarball_without_the_files(tmp_path):
    tarball = _tarball(tmp_path / "a" / "fake.tar.gz", {"LICENSE": "x"})
    run = _pack(SCRIPT, tarball, tmp_path / "out")
    assert run.returncode == 3, run.stderr
    assert "files are missing" in run.stderr and "cache_kernels.cu" in run.stderr
    assert not (tmp_path / "out").exists()


def test_pack_refuses_files_that_are_not_vllm_028s(tmp_path):
    tarball = _tarball(tmp_path / "a" / "fake.tar.gz", {n: "not vLLM\n" for n in lk.SOURCE_SHA256})
    run = _pack(SCRIPT, tarball, tmp_path / "out")
    assert run.returncode == 4, run.stderr
    assert "csrc/libtorch_stable/cache_kernels.cu: FAILED" in run.stderr
    assert not (tmp_path / "out").exists()


def test_pack_writes_exactly_the_pinned_files_and_the_build_files(tmp_path):
    """The script run against its own copy of the list, pinning a fake tarball's files: it
    extracts only those, keeps the build files beside them and records the tarball."""
    tools = tmp_path / "tools"
    (tools / "vllm_legacy").mkdir(parents=True)
    shutil.copy(SCRIPT, tools)
    for name in ("binding.cpp", "build.py"):
        shutil.copy(SUMS.with_name(name), tools / "vllm_legacy")
    files = {"LICENSE": "license\n", "csrc/a.cu": "kernel\n", "csrc/b/c.h": "header\n"}
    tarball = _tarball(tmp_path / "a" / "fake.tar.gz", {**files, "csrc/other.cu": "not used\n"})
    digests = subprocess.run(
        ["sha256sum", *files], cwd=tmp_path / "a/src/vllm-0.28.0", capture_output=True, text=True
    )
    (tools / "vllm_legacy/SHA256SUMS").write_text(digests.stdout)
    out = tmp_path / "out"
    run = _pack(tools / "vllm_legacy_kernel.sh", tarball, out)
    assert run.returncode == 0, run.stderr
    got = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    build = {"SHA256SUMS", "VERSION", "binding.cpp", "build.py", "build.sh"}
    assert got == {f"vllm-0.28.0/{n}" for n in files} | build | {"vllm_legacy_kernel.sh"}
    assert "not PyPI's tarball; the files match" in (out / "VERSION").read_text()
    assert 'vllm_legacy_kernel.sh" build' in (out / "build.sh").read_text()


def test_the_oracle_says_why_it_cannot_run(tmp_path, monkeypatch):
    monkeypatch.delenv(lk.ENV_VAR, raising=False)
    assert lk.ENV_VAR in lk.missing_reason()
    assert "dsa_vllm_legacy.so" in lk.missing_reason(tmp_path)
    with pytest.raises(RuntimeError, match="cannot run"):
        lk.load_kernel(tmp_path)


def test_the_library_names_the_release_by_its_recorded_hashes(tmp_path):
    shutil.copy(SUMS, tmp_path / "SHA256SUMS")
    assert lk.library_source(tmp_path) == (
        "vllm 0.28.0 csrc/libtorch_stable/cache_kernels.cu (sha256 3b32cb972fc9)"
    )
    (tmp_path / "SHA256SUMS").write_text(SUMS.read_text().replace("3b32cb9", "0000000"))
    assert lk.library_source(tmp_path).startswith("unknown release")


@pytest.mark.parametrize("interleaved", [True, False])
def test_the_kernels_input_is_the_key_the_profile_quantizes(interleaved):
    """The BF16 key handed to the kernel, quantized by vLLM's formula (written out here), gives
    the package's vllm-legacy k bytes and scales: same values, same (engine) lane order."""
    inputs = synthetic_indexer_inputs(96, seed=4)
    profile = ENGINE_PROFILES["vllm-legacy"]
    key = lk.package_key(inputs, profile, interleaved=interleaved)
    assert key.dtype == torch.bfloat16 and key.shape == (96, 128)
    amax = key.float().abs().amax(-1)
    scale = torch.exp2(torch.ceil(torch.log2(amax.clamp_min(torch.tensor(1e-4)) / 448.0)))
    k8 = (key.float() / scale[:, None]).to(torch.float8_e4m3fn)
    ours = ek.package_operands(inputs, profile, interleaved=interleaved, impl="torch")
    assert torch.equal(ours.k.view(torch.uint8), k8.view(torch.uint8))
    assert torch.equal(ours.k_descale, scale)


def test_only_a_bf16_key_is_handed_to_the_kernel():
    inputs = synthetic_indexer_inputs(8, seed=4)
    with pytest.raises(ValueError, match="'vllm' does not round its key to BF16"):
        lk.package_key(inputs, ENGINE_PROFILES["vllm"], interleaved=False)


def _preprocess(inputs, engine, *, interleaved: bool) -> IndexerPreprocess:
    """A layer's own preprocessing of ``inputs`` under ``engine`` with rope_fp32 (no Hadamard)."""
    return IndexerPreprocess(
        inputs.head_dim, inputs.rope_dim, k_norm=inputs.k_norm, rope_interleaved=interleaved,
        rotate_activation=False, rope_fp32=True, engine=engine,
    )  # fmt: skip


@pytest.mark.parametrize("interleaved", [False, True])
def test_package_key_refuses_a_preprocess_of_another_layout(interleaved):
    """A layer's own preprocessing handed in must be the profile's, with rope_fp32 and the RoPE
    layout the key's lanes are put back in: otherwise the pairs would go back wrongly."""
    inputs = synthetic_indexer_inputs(8, n_heads=2)
    pre = _preprocess(inputs, ENGINE_PROFILES["vllm-legacy"], interleaved=not interleaved)
    with pytest.raises(ValueError, match=f"rope_interleaved={interleaved}"):
        lk.package_key(inputs, interleaved=interleaved, pre=pre)


def test_package_key_names_the_rule_a_preprocess_differs_in():
    """A layer preprocessed under another LayerNorm rule than the key's profile (the rule the
    engine's compile kept, say) is refused with the field and its value named."""
    inputs = synthetic_indexer_inputs(8, n_heads=2)
    legacy = ENGINE_PROFILES["vllm-legacy"]
    kept = dataclasses.replace(legacy, name="vllm-legacy-xblock8", layernorm="fp32-inductor-x8")
    pre = _preprocess(inputs, kept, interleaved=False)
    with pytest.raises(ValueError, match=r"layernorm='fp32-inductor-x8'\), not 'vllm-legacy'"):
        lk.package_key(inputs, legacy, interleaved=False, pre=pre)
