"""Import boundaries carry the architecture (docs/design.md)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "diloco"

ALLOWED = {
    "core": {"core"},
    "wire": {"core", "wire"},
    "server": {"core", "wire", "server"},
    "worker": {"core", "wire", "worker"},
    "integrations": {"core", "wire", "worker", "integrations"},
    "demo": {"core", "wire", "server", "worker", "demo"},
}


def _diloco_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "diloco":
                found.add(parts[1] if len(parts) > 1 else "")
    return found


def test_package_import_boundaries() -> None:
    problems = []
    for package, allowed in ALLOWED.items():
        for file in sorted((SRC / package).rglob("*.py")):
            for imported in _diloco_imports(file) - allowed:
                problems.append(f"{file.relative_to(SRC)} imports diloco.{imported}")
    assert not problems, problems


def test_nothing_imports_the_cli() -> None:
    offenders = [
        str(f.relative_to(SRC))
        for f in SRC.rglob("*.py")
        if "cli" not in f.relative_to(SRC).parts[:1]
        and f.name != "__main__.py"
        and "cli" in _diloco_imports(f)
    ]
    assert not offenders


def test_core_imports_only_torch() -> None:
    for file in (SRC / "core").rglob("*.py"):
        tree = ast.parse(file.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module.split(".")[0]]
            else:
                continue
            # Pure maths: torch and side-effect-free standard modules; no I/O, threads or clocks.
            pure = {"torch", "diloco", "__future__", "collections", "math", "typing", "dataclasses"}
            assert set(mods) <= pure, (file, mods)


def test_no_pickle_anywhere() -> None:
    for file in SRC.rglob("*.py"):
        text = file.read_text()
        assert "import pickle" not in text and "torch.load(" not in text, file
