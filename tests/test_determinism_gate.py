"""The determinism coverage gate (see tests/determinism/manifest.py)."""

import ast

from .determinism import manifest


def test_every_dispatch_source_is_registered():
    missing = [s for s in manifest.dispatch_sources() if s not in manifest.REGISTRY]
    assert not missing, f"kernel-dispatch sources without a replay test: {missing}"
    gone = [s for s in manifest.REGISTRY if not (manifest.ROOT / s).is_file()]
    assert not gone, f"registered sources that do not exist: {gone}"


def test_every_registered_test_exists():
    for source, tests in manifest.REGISTRY.items():
        for node in tests:
            path, func = node.split("::")
            tree = ast.parse((manifest.ROOT / path).read_text())
            names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert func in names, f"{source}: registered test {node} does not exist"


def test_registered_sources_unchanged_since_their_tests_were_recorded():
    stale = []
    for source in manifest.REGISTRY:
        recorded = manifest.HASHES.get(source)
        current = (manifest.sha256([source]), manifest.sha256(manifest.test_files(source)))
        if recorded != current:
            stale.append(source)
    assert not stale, (
        f"dispatch sources changed since their replay tests were recorded: {stale}. Extend or "
        "touch the registered tests, then run `python -m tests.determinism.manifest --update`."
    )


def test_update_refuses_a_source_change_without_a_test_change(tmp_path, monkeypatch):
    src = tmp_path / "dsa_precision" / "k.py"
    test = tmp_path / "tests" / "t.py"
    src.parent.mkdir(parents=True)
    test.parent.mkdir(parents=True)
    (tmp_path / "tests/determinism").mkdir()
    (tmp_path / "tests/determinism/manifest.py").write_text(
        "# BEGIN HASHES\nHASHES = {}\n# END HASHES\n"
    )
    src.write_text("x = 1\n")
    test.write_text("def test_k(): pass\n")
    monkeypatch.setattr(manifest, "ROOT", tmp_path)
    monkeypatch.setattr(manifest, "REGISTRY", {"dsa_precision/k.py": ("tests/t.py::test_k",)})
    monkeypatch.setattr(manifest, "HASHES", {})
    assert manifest.update() == 0
    namespace = {}
    exec((tmp_path / "tests/determinism/manifest.py").read_text(), namespace)
    monkeypatch.setattr(manifest, "HASHES", namespace["HASHES"])
    src.write_text("x = 2\n")  # the kernel path changes, its test does not
    assert manifest.update() == 1
    test.write_text("def test_k(): assert True\n")  # the test is touched too
    assert manifest.update() == 0
