"""Run Megatron-LM's own DSA unit tests stock and with the dsa-precision drop-ins; compare.

    python tests/megatron_lm/run.py --megatron-lm PATH [--mode stock|swapped|both]
        [--fields none] [--fields rope_fp32] [--out DIR] [--jobs N]

``PATH`` is a Megatron-LM checkout (or an export of one: only its ``tests/`` tree is used) of the
release matching the installed megatron-core, e.g.::

    git --git-dir=MIRROR archive core_r0.19.0 tests pyproject.toml | tar -x -C .megatron-lm

(``--from-git MIRROR --commit REV`` does this when ``PATH`` has no ``tests/``). Megatron's code
itself comes from the installed megatron-core, never from ``PATH``.

Each selected file runs in its own ``pytest`` process (working directory ``PATH``, Megatron's
pytest configuration with its ``addopts`` cleared), with ``-p cpu_plugin`` in every mode and
``-p swap_plugin`` in the swapped modes (see those modules): one swapped mode per ``--fields``
set (default both ``none``, the four fields at their defaults, and ``rope_fp32``, which
``swap_plugin`` switches on in every config the tests build). Outcomes come from
``--junitxml``. The table gives passed/failed/skipped/errors per file and mode; then, per swapped
mode, every test whose outcome differs from the stock run with the first line of its failure
message, split into the differences expected by design (:data:`EXPECTED`, each with its reason:
``rope_fp32`` changes numerics and code paths on purpose) and the unexpected ones, and the
expected differences that did not occur; then, per mode, how many tests that ran (passed or
failed) built or used (from their class set-up) a ``DSAIndexer`` / ``DSAttention`` of each class
(``cpu_plugin``'s instrumentation; ``PrecisionDSA*`` in the swapped modes). Logs, JUnit files,
the plugins' JSON reports and ``summary.json`` are written under ``--out`` (one folder per mode).
``--jobs N`` runs N pytest processes at a time, each with its own ``MASTER_PORT`` (Megatron's
``Utils`` rendezvous on it on a GPU host); the outcomes do not depend on it.

Exit code: 0 when every difference is expected, 1 when the harness broke (a pytest process timed
out, crashed or wrote no JUnit file), 2 when a test's outcome differs unexpectedly.

``dsa_precision`` is the installed one (the editable checkout) unless ``--package-root DIR``
(a tree containing ``dsa_precision/``) or ``--package-rev REV`` (``git archive REV`` of this
repository, or ``worktree``: a copy of the working tree taken at start, so edits made during the
run do not mix in) puts another first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DEFAULT_COMMIT = (
    "f8837c04ef6cbef6cdefb8de001aad63178aebbf"  # core_r0.19.0 tip (0.19.1 + cherry-picks)
)
OUTCOMES = ("passed", "failed", "skipped", "error")
# Field sets of the swapped modes (``swap_plugin``'s ``$DSA_SWAP_FIELDS``): "none" = defaults.
FIELD_SETS = ("none", "rope_fp32")


@dataclass(frozen=True)
class Selection:
    path: str  # relative to the checkout
    why: str
    nodes: tuple[str, ...] = ()  # "::Class" / "::Class::test" suffixes; empty = whole file
    keyword: str | None = None  # pytest -k expression

    def targets(self) -> list[str]:
        return [self.path + node for node in self.nodes] or [self.path]


EAV = "tests/unit_tests/transformer/experimental_attention_variant/"
SELECTIONS = (
    Selection(EAV + "test_attention_variant_dsa.py", "DSAIndexer/DSAttention/loss/masking"),
    Selection(EAV + "test_absorbed_mla.py", "AbsorbedMLASelfAttention with DSA core attention"),
    Selection(EAV + "test_dsa_backend_tp_sp_parity.py", "DSA backends under TP/SP/CP"),
    Selection(EAV + "test_dsa_native_parity.py", "fused/cuDNN DSA vs the native path"),
    Selection(EAV + "test_dsa_tilelang_kernels.py", "TileLang DSA kernels"),
    Selection(
        "tests/unit_tests/models/test_experimental_attention_variant_module_specs.py",
        "the DSA/experimental-attention spec builders (whole file)",
    ),
    Selection(
        "tests/unit_tests/models/test_dsa_gpt_mamba_equivalence.py",
        "GPTModel+DSA vs HybridModel+DSA",
    ),
    Selection(
        "tests/unit_tests/models/test_hybrid_model.py",
        "HybridModel DSA layer (TestHybridDSAQKLayernorm, TestDSAQKNormResolution, "
        "test_enabled_leaves_dsa_layer_alone)",
        keyword="dsa",
    ),
    Selection(
        "tests/unit_tests/ssm/test_hybrid_block.py",
        "HybridStack 'D' layers build DSAttention",
        keyword="dsa",
    ),
    Selection(
        "tests/unit_tests/post_training/test_modelopt_module_spec.py",
        "ModelOpt hybrid spec wires DSAttention/DSAIndexer",
        nodes=(
            "::test_get_hybrid_stack_modelopt_spec_use_default_te_spec",
            "::test_get_hybrid_stack_modelopt_spec_local_feature_specs",
        ),
    ),
)


@dataclass(frozen=True)
class Expected:
    """A test whose outcome differs by design when the drop-ins run with the field set ``fields``:
    ``node`` (a pytest node id without parameters) with parameters matching ``params`` (``None``:
    a test without parameters), going from ``stock`` to ``swapped``, with the failing side's
    message (the swapped one, or the stock one for a stock failure that the drop-ins pass)
    matching ``message``; ``cuda``: only where the tests run with CUDA (``None``: anywhere);
    ``te``: only where Transformer Engine is installed (``None``: either way).
    Anything else that differs, this test with another outcome or message included, is
    unexpected."""

    fields: str
    node: str
    params: str | None
    stock: str
    swapped: str
    message: str
    reason: str
    cuda: bool | None = None
    te: bool | None = None

    def applies(self, fields: str, cuda: bool, te: bool = False) -> bool:
        return (
            fields == self.fields
            and (self.cuda is None or self.cuda == cuda)
            and (self.te is None or self.te == te)
        )

    def matches(
        self,
        fields: str,
        test_id: str,
        stock: tuple,
        swapped: tuple,
        cuda: bool = False,
        te: bool = False,
    ) -> bool:
        if not self.applies(fields, cuda, te) or (stock[0], swapped[0]) != (
            self.stock,
            self.swapped,
        ):
            return False
        node = junit_id(self.node)
        if self.params is None:
            named = test_id == node
        else:
            named = (
                test_id.startswith(node + "[")
                and test_id.endswith("]")
                and re.fullmatch(self.params, test_id[len(node) + 1 : -1]) is not None
            )
        failing = swapped[1] if self.swapped != "passed" else stock[1]
        return named and re.search(self.message, failing) is not None


_BF16_FLOAT = r"^RuntimeError: expected scalar type BFloat16 but found Float"
_BF16_FLOAT_REASON = (
    "on a GPU without Transformer Engine stock Megatron fails this test with 'expected scalar "
    "type BFloat16 but found Float' (its BF16 indexer preprocessing on the local linear layers "
    "that stand in for TE); with rope_fp32 the indexer's preprocessing is the package's float32 "
    "path, which does not run into it, so the test passes"
)

_ROTATE_REASON = (
    "the test counts the calls of Megatron's dsa.rotate_activation (patched by its module path), "
    "a BF16-only Hadamard; with rope_fp32 the indexer applies the Hadamard in FP32 "
    "(dsa_precision.hadamard.rotate_activation), so Megatron's function is called 0 times, not 2. "
    "The rotation still follows the config field per forward: "
    "tests/megatron/test_indexer.py::test_indexer_follows_megatrons_preprocessing_fields_per_call"
)

EXPECTED = (
    # Where stock passes it: on the CPU, and on a GPU with Transformer Engine (without TE, a GPU
    # run of stock fails it first: _BF16_FLOAT).
    *(
        Expected(
            fields="rope_fp32",
            node=EAV + "test_attention_variant_dsa.py::TestDSAIndexer::"
            "test_dsa_indexer_rotate_activation_follows_config",
            params=r"True-\d+",
            stock="passed",
            swapped="failed",
            message=r"^AssertionError: assert 0 == 2$",
            reason=_ROTATE_REASON,
            cuda=cuda,
            te=te,
        )
        for cuda, te in ((False, None), (True, True))
    ),
    *(
        Expected(
            fields="rope_fp32",
            node=EAV + "test_attention_variant_dsa.py::" + node,
            params=params,
            stock="failed",
            swapped="passed",
            message=_BF16_FLOAT,
            reason=_BF16_FLOAT_REASON,
            cuda=True,
            te=False,  # with TE stock passes these too
        )
        for node, params in (
            ("TestDSAIndexer::test_dsa_indexer_forward", r"\d+"),
            ("TestDSAIndexer::test_dsa_indexer_forward_with_scores", r"\d+"),
            ("TestDSAIndexer::test_dsa_indexer_forward_with_scores_packed_thd", r"\d+"),
            ("TestDSAIndexer::test_dsa_indexer_rotate_activation_follows_config", r"False-\d+"),
            ("TestDSAIndexer::test_dsa_indexer_with_mask", r"\d+"),
            ("TestDSAttention::test_dsa_backward", None),
            ("TestDSAttention::test_dsa_forward", None),
            ("TestDSAttention::test_dsa_topk_selection", None),
        )
    ),
)


def normalise_fields(fields: str) -> str:
    """``"none"`` / ``""`` -> ``"none"``; else the sorted comma-separated field names."""
    names = sorted({n.strip() for n in fields.split(",") if n.strip() and n.strip() != "none"})
    return ",".join(names) or "none"


def swapped_mode(fields: str) -> str:
    """The mode (and output folder) name of the swapped run with ``fields``."""
    fields = normalise_fields(fields)
    return "swapped" if fields == "none" else "swapped+" + fields.replace(",", "+")


def compare(
    stock: dict[str, tuple[str, str]],
    swapped: dict[str, tuple[str, str]],
    fields: str,
    cuda: bool = False,
    te: bool = False,
) -> list[dict]:
    """Every test whose outcome differs, with ``expected``: the reason (:data:`EXPECTED`) or
    ``None``."""
    fields = normalise_fields(fields)
    differing = []
    for test_id in sorted(set(stock) | set(swapped)):
        a = stock.get(test_id, ("absent", ""))
        b = swapped.get(test_id, ("absent", ""))
        if a[0] == b[0]:
            continue
        reasons = [e.reason for e in EXPECTED if e.matches(fields, test_id, a, b, cuda, te)]
        differing.append(
            {"test": test_id, "stock": a, "swapped": b, "expected": reasons[0] if reasons else None}
        )
    return differing


def not_observed(
    differing: list[dict], fields: str, ran: set[str], cuda: bool = False, te: bool = False
) -> list[Expected]:
    """The :data:`EXPECTED` entries of ``fields`` (on this device) for files that ran that no
    difference matched."""
    fields = normalise_fields(fields)
    seen = {item["expected"] for item in differing}
    return [
        e
        for e in EXPECTED
        if e.applies(fields, cuda, te) and e.node.split("::")[0] in ran and e.reason not in seen
    ]


@dataclass
class FileRun:
    selection: Selection
    mode: str
    returncode: int | None = None
    seconds: float = 0.0
    problem: str | None = None  # harness-level: timeout / crash / no JUnit file
    tests: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (outcome, message)
    # id -> {"built": [class names], "held": [...]}: DSA modules a test constructed / used from its
    # class set-up (cpu_plugin's instrumentation)
    dsa_modules: dict[str, dict[str, list[str]]] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(OUTCOMES, 0)
        for outcome, _ in self.tests.values():
            counts[outcome] += 1
        return counts


def _first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


def junit_id(nodeid: str) -> str:
    """The ``classname::name`` id ``parse_junit`` gives the test with pytest node id ``nodeid``."""
    names = nodeid.split("::")
    names[0] = names[0].replace("/", ".").removesuffix(".py")
    return ".".join(names[:-1]) + "::" + names[-1]


def dsa_usage(run: FileRun, ran: bool = True) -> dict[str, list[str]]:
    """Class name -> ids of the tests (that ran: passed or failed) that built or held an instance."""
    usage: dict[str, list[str]] = {}
    for test_id, entry in sorted(run.dsa_modules.items()):
        outcome = run.tests.get(test_id, ("absent", ""))[0]
        if ran and outcome not in ("passed", "failed"):
            continue
        for name in sorted(set(entry.get("built", [])) | set(entry.get("held", []))):
            usage.setdefault(name, []).append(test_id)
    return usage


def parse_junit(path: Path) -> dict[str, tuple[str, str]]:
    tests: dict[str, tuple[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        test_id = f"{classname}::{name}" if classname else name
        children = {child.tag: child for child in case}
        outcome, message = "passed", ""
        for tag, label in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            if tag in children:
                child = children[tag]
                outcome = label
                message = _first_line(child.get("message")) or _first_line(child.text)
                break
        tests[test_id] = (outcome, message)
    return tests


def run_file(selection: Selection, mode: str, args, out: Path, env: dict[str, str]) -> FileRun:
    stem = selection.path.removeprefix("tests/unit_tests/").replace("/", "__").removesuffix(".py")
    junit = out / mode / f"{stem}.xml"
    log = out / mode / f"{stem}.log"
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", *selection.targets()]
    if selection.keyword:
        cmd += ["-k", selection.keyword]
    # --rootdir: node ids relative to the checkout (the plugins select tests by them), also when
    # the export sits inside another project whose pytest configuration would claim it.
    root = Path(args.megatron_lm).resolve()
    cmd += ["--rootdir", str(root), "-o", "addopts=", "-rA", "-q", "-p", "no:cacheprovider"]
    cmd += ["-p", "cpu_plugin"]
    if mode != "stock":
        cmd += ["-p", "swap_plugin"]
    cmd += [f"--junitxml={junit}", *args.pytest_arg]
    cpu_report = out / mode / f"{stem}.cpu.json"
    cpu_report.unlink(missing_ok=True)
    run_env = dict(
        env,
        DSA_SWAP_REPORT=str(out / mode / f"{stem}.swap.json"),
        DSA_CPU_REPORT=str(cpu_report),
    )
    if args.jobs > 1:  # Megatron's Utils rendezvous on $MASTER_PORT (GPU): one per process
        run_env["MASTER_PORT"] = str(_free_port())
    result = FileRun(selection, mode)
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as fh:
        fh.write("$ " + " ".join(cmd) + "\n\n")
        fh.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=args.megatron_lm,
            env=run_env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            result.returncode = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            result.problem = f"timed out after {args.timeout}s"
    result.seconds = time.monotonic() - start
    if junit.exists():
        result.tests = parse_junit(junit)
    if cpu_report.exists():
        used = json.loads(cpu_report.read_text()).get("dsa_modules", {})
        result.dsa_modules = {junit_id(nodeid): entry for nodeid, entry in used.items()}
    elif result.problem is None:
        result.problem = f"no JUnit file (pytest exit {result.returncode}); see {log}"
    # 2 = collection errors (recorded in the JUnit file), 4 = usage error, 3 = internal error.
    if result.problem is None and (
        result.returncode == 3 or (result.returncode not in (0, 1, 5) and not result.tests)
    ):
        result.problem = f"pytest exit {result.returncode} with no test recorded; see {log}"
    return result


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _export_rev(rev: str, dest: Path) -> Path:
    """``git archive REV dsa_precision`` (or a copy of the working tree for ``worktree``)."""
    target = dest / f"dsa_precision@{rev.replace('/', '_')}"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    if rev == "worktree":
        shutil.copytree(
            REPO / "dsa_precision",
            target / "dsa_precision",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        return target
    with tempfile.TemporaryFile() as tmp:
        subprocess.run(
            ["git", "-C", str(REPO), "archive", rev, "dsa_precision"], stdout=tmp, check=True
        )
        tmp.seek(0)
        with tarfile.open(fileobj=tmp) as tar:
            tar.extractall(target, filter="data")
    return target


def _ensure_checkout(args) -> None:
    tests = Path(args.megatron_lm) / "tests"
    if tests.is_dir():
        return
    if not args.from_git:
        sys.exit(f"{tests} does not exist (give --from-git MIRROR to extract it)")
    Path(args.megatron_lm).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as tmp:
        cmd = [
            "git",
            f"--git-dir={args.from_git}",
            "archive",
            args.commit,
            "tests",
            "pyproject.toml",
        ]
        subprocess.run(cmd, stdout=tmp, check=True)
        tmp.seek(0)
        with tarfile.open(fileobj=tmp) as tar:
            tar.extractall(args.megatron_lm, filter="data")
    (Path(args.megatron_lm) / "COMMIT").write_text(args.commit + "\n")


def _tree_digest(root: str | None) -> str | None:
    """sha256 over the ``dsa_precision/**/*.py`` files under ``root`` (which tree was tested)."""
    if root is None:
        return None
    digest = hashlib.sha256()
    for path in sorted((Path(root) / "dsa_precision").rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _cell(run: FileRun | None) -> str:
    if run is None:
        return "-"
    c = run.counts()
    text = f"{c['passed']}/{c['failed']}/{c['skipped']}/{c['error']}"
    return text + (" !" if run.problem else "")


def _probe_versions(env: dict[str, str]) -> dict[str, str]:
    code = (
        "import json, importlib.util, dsa_precision, megatron.core as m; "
        "import torch; print(json.dumps({'megatron_core': m.__version__, "
        "'dsa_precision': dsa_precision.__file__, 'cuda': torch.cuda.is_available(), "
        "'transformer_engine': importlib.util.find_spec('transformer_engine') is not None}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=env["MEGATRON_LM_ROOT"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": _first_line(proc.stderr.strip().splitlines()[-1] if proc.stderr else "")}


def _print_differences(mode: str, differing: list[dict], missing: list[Expected]) -> None:
    expected = [d for d in differing if d["expected"]]
    unexpected = [d for d in differing if not d["expected"]]
    print(
        f"\n{mode}: {len(differing)} test(s) with different outcomes (stock -> {mode}), "
        f"{len(expected)} expected, {len(unexpected)} unexpected"
    )
    for title, items in (("unexpected", unexpected), ("expected by design", expected)):
        if not items:
            continue
        print(f"  {title}:")
        for item in items:
            (sa, sm), (wa, wm) = item["stock"], item["swapped"]
            print(f"  - {item['test']}: {sa} -> {wa}")
            message = wm if wa in ("failed", "error") else sm
            if message:
                print(f"      {message}")
    for reason in dict.fromkeys(d["expected"] for d in expected):
        print(f"  why (expected): {reason}")
    for entry in missing:
        print(
            f"  expected but not seen: {entry.node}"
            f"{'' if entry.params is None else f'[{entry.params}]'} {entry.stock} -> "
            f"{entry.swapped} ({entry.fields})"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megatron-lm", required=True, help="Megatron-LM checkout (tests/ used)")
    parser.add_argument("--mode", choices=("stock", "swapped", "both"), default="both")
    parser.add_argument("--out", default=None, help="output folder (default PATH/_dsa_runs)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per file and mode")
    parser.add_argument("--jobs", type=int, default=1, help="pytest processes at a time")
    parser.add_argument("--only", action="append", default=[], help="substring of file paths")
    parser.add_argument("--package-root", default=None, help="tree with dsa_precision/ to test")
    parser.add_argument(
        "--package-rev",
        default=None,
        help="git revision of this repo to test, or 'worktree' (a snapshot copy)",
    )
    parser.add_argument("--from-git", default=None, help="Megatron-LM git dir to extract tests")
    parser.add_argument("--commit", default=DEFAULT_COMMIT, help="Megatron-LM commit to extract")
    parser.add_argument(
        "--fields",
        action="append",
        default=None,
        help="a swapped mode with these dsa-precision fields switched on in every config: "
        f"'none' (defaults) or a comma list of {list(FIELD_SETS[1:])}; repeatable "
        f"(default: {' and '.join(FIELD_SETS)})",
    )
    parser.add_argument("--pytest-arg", action="append", default=[], help="extra pytest argument")
    args = parser.parse_args(argv)
    field_sets = list(dict.fromkeys(normalise_fields(f) for f in args.fields or FIELD_SETS))
    unknown = {n for f in field_sets for n in f.split(",")} - set(FIELD_SETS)
    if unknown:
        parser.error(f"--fields: unknown {sorted(unknown)}; use 'none' or {list(FIELD_SETS[1:])}")
    if args.jobs < 1:
        parser.error(f"--jobs={args.jobs}: give 1 or more")
    args.megatron_lm = str(Path(args.megatron_lm).resolve())
    _ensure_checkout(args)
    out = Path(args.out or Path(args.megatron_lm) / "_dsa_runs").resolve()
    swapped = {swapped_mode(f): f for f in field_sets} if args.mode != "stock" else {}
    modes = (["stock"] if args.mode != "swapped" else []) + list(swapped)
    for mode in modes:
        (out / mode).mkdir(parents=True, exist_ok=True)

    package_root = args.package_root
    if args.package_rev:
        package_root = str(_export_rev(args.package_rev, out))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    path = [str(HERE), args.megatron_lm]
    if package_root:
        path.insert(0, str(Path(package_root).resolve()))
    env["PYTHONPATH"] = os.pathsep.join([*path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["MEGATRON_LM_ROOT"] = args.megatron_lm
    env["DSA_SWAP_FIELDS"] = ""
    mode_env = {
        mode: dict(env, DSA_SWAP_FIELDS="" if f == "none" else f) for mode, f in swapped.items()
    }
    mode_env["stock"] = env
    commit_file = Path(args.megatron_lm) / "COMMIT"
    commit = commit_file.read_text().strip() if commit_file.exists() else "unknown"
    versions = _probe_versions(env)
    cuda = bool(versions.get("cuda"))  # which EXPECTED entries apply
    te = bool(versions.get("transformer_engine"))
    print(f"Megatron-LM tests: {args.megatron_lm} (commit {commit})")
    print(f"megatron-core / dsa_precision: {versions}")
    if package_root:
        print(f"dsa_precision tree sha256: {_tree_digest(package_root)}")
    print(f"modes: {', '.join(modes)}; output: {out}\n")

    selections = [s for s in SELECTIONS if not args.only or any(o in s.path for o in args.only)]
    jobs = [(selection, mode) for selection in selections for mode in modes]
    runs: dict[tuple[str, str], FileRun] = {}

    def one(job: tuple[Selection, str]) -> FileRun:
        selection, mode = job
        return run_file(selection, mode, args, out, mode_env[mode])

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for run in pool.map(one, jobs):
            runs[(run.selection.path, run.mode)] = run
            status = run.problem or f"exit {run.returncode}"
            print(
                f"  [{run.mode:7}] {run.selection.path} {_cell(run)} ({run.seconds:.0f}s, {status})"
            )
            sys.stdout.flush()

    differing: dict[str, list[dict]] = {}
    missing: dict[str, list[Expected]] = {}
    if "stock" in modes:
        ran = {s.path for s in selections}
        for mode, fields in swapped.items():
            differing[mode] = [
                item
                for selection in selections
                for item in compare(
                    runs[(selection.path, "stock")].tests,
                    runs[(selection.path, mode)].tests,
                    fields,
                    cuda,
                    te,
                )
            ]
            missing[mode] = not_observed(differing[mode], fields, ran, cuda, te)
            _print_differences(mode, differing[mode], missing[mode])

    print("\ntests that ran (passed or failed) and built or used DSA modules, per class:")
    usage_summary: dict[str, dict[str, int]] = {}
    for mode in modes:
        merged: dict[str, set[str]] = {}
        for selection in selections:
            for name, ids in dsa_usage(runs[(selection.path, mode)]).items():
                merged.setdefault(name, set()).update(ids)
        usage_summary[mode] = {name: len(ids) for name, ids in sorted(merged.items())}
        cells = ", ".join(f"{name} {count}" for name, count in usage_summary[mode].items())
        print(f"  [{mode:7}] {cells or 'none'}")

    problems = [
        f"{mode} {path}: {run.problem}" for (path, mode), run in runs.items() if run.problem
    ]
    print()
    for mode in swapped:
        reports = sorted((out / mode).glob("*.swap.json"))
        if reports:
            report = json.loads(reports[0].read_text())
            print(
                f"swap_plugin [{mode}]: fields {report.get('fields') or 'none'}, "
                f"probe {report.get('probe', {})}"
            )
    print("\npassed/failed/skipped/errors per file (! = harness problem, see summary.json)")
    width = max(len(s.path.removeprefix("tests/unit_tests/")) for s in selections)
    columns = max(13, *(len(m) for m in modes))
    print(f"{'file':{width}}" + "".join(f"  {m:>{columns}}" for m in modes))
    totals = {mode: dict.fromkeys(OUTCOMES, 0) for mode in modes}
    for selection in selections:
        cells = []
        for mode in modes:
            run = runs[(selection.path, mode)]
            cells.append(_cell(run))
            for key, value in run.counts().items():
                totals[mode][key] += value
        name = selection.path.removeprefix("tests/unit_tests/")
        print(f"{name:{width}}" + "".join(f"  {c:>{columns}}" for c in cells))
    total_cells = ["/".join(str(totals[m][k]) for k in OUTCOMES) for m in modes]
    print(f"{'TOTAL':{width}}" + "".join(f"  {c:>{columns}}" for c in total_cells))

    unexpected = {
        mode: [d for d in items if not d["expected"]] for mode, items in differing.items()
    }
    summary = {
        "megatron_lm": args.megatron_lm,
        "commit": commit,
        "versions": versions,
        "package_root": package_root,
        "package_sha256": _tree_digest(package_root),
        "modes": modes,
        "fields": {mode: fields for mode, fields in swapped.items()},
        "files": {
            f"{path} [{mode}]": {
                "counts": run.counts(),
                "returncode": run.returncode,
                "seconds": round(run.seconds, 1),
                "problem": run.problem,
                "tests": {k: list(v) for k, v in run.tests.items()},
                "dsa_modules": run.dsa_modules,
            }
            for (path, mode), run in runs.items()
        },
        "totals": totals,
        "differing": differing,
        "expected_not_seen": {
            mode: [dataclasses.asdict(e) for e in items] for mode, items in missing.items()
        },
        "dsa_module_usage": usage_summary,
        "problems": problems,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if problems:
        print("\nharness problems:\n  " + "\n  ".join(problems))
        return 1
    print()
    for mode, items in differing.items():
        explained = sum(1 for d in items if d["expected"])
        print(
            f"{mode}: {len(items) - explained} unexpected difference(s), {explained} expected "
            f"by design, {len(missing[mode])} expected but not seen"
        )
    if any(unexpected.values()):
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
