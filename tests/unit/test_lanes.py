"""The shape of the test tree (tests/README.md): lanes hold tests, helpers and programs hold
none, and no test module is imported by another module."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
LANES = ("unit", "integration", "processes", "browser")
SUPPORT = ("helpers", "programs")


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_no_module_imports_a_test_module() -> None:
    """Helpers shared by tests live in tests/helpers/: a test module imported elsewhere would
    run its tests twice and tie two files together that read as independent."""
    offenders = []
    for path in _modules():
        for name in _imported_modules(path):
            parts = name.split(".")
            if parts[0] == "tests" and any(p.startswith("test_") or p == "conftest" for p in parts):
                offenders.append(f"{path.relative_to(TESTS)} imports {name}")
    assert not offenders, offenders


def test_every_file_sits_in_a_lane_or_a_support_folder() -> None:
    top = {"__init__.py", "conftest.py", "README.md"}
    stray = [
        str(p.relative_to(TESTS))
        for p in TESTS.iterdir()
        if p.is_file() and p.name not in top
    ] + [
        str(p.relative_to(TESTS))
        for p in TESTS.iterdir()
        if p.is_dir() and p.name not in (*LANES, *SUPPORT, "__pycache__")
    ]
    assert not stray, stray


def test_lanes_hold_only_test_modules_and_support_folders_hold_none() -> None:
    problems = []
    for lane in LANES:
        for path in (TESTS / lane).glob("*.py"):
            if path.name != "__init__.py" and not path.name.startswith("test_"):
                problems.append(f"{lane}/{path.name}: not a test module (helpers/ or programs/)")
    for folder in SUPPORT:
        for path in (TESTS / folder).glob("*.py"):
            tree = ast.parse(path.read_text())
            tests = [
                n.name
                for n in tree.body
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                and n.name.lower().startswith("test")
            ]
            if path.name.startswith("test_") or tests:
                problems.append(f"{folder}/{path.name}: holds tests {tests}")
    assert not problems, problems


def test_slow_and_browser_modules_say_so() -> None:
    """tests/conftest.py refuses an unmarked test in these folders at collection; the
    declaration is also in each module, where a reader looks for it."""
    missing = [
        str(path.relative_to(TESTS))
        for lane, mark in (("processes", "slow"), ("browser", "browser"))
        for path in (TESTS / lane).glob("test_*.py")
        if f"pytest.mark.{mark}" not in path.read_text()
    ]
    assert not missing, missing
