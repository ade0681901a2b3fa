"""Which code a run measures: this checkout, another copy of ``src/``, or a snapshot of it.

``use_src`` puts another ``src/`` (say a ``git archive`` of a commit) first on the path that
spawned children inherit, and records which code that is. ``snapshot_source`` copies this
checkout's ``src/diloco`` aside for children started with ``PYTHONPATH`` on the copy, so that
edits to the working tree during a long run cannot reach them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: scripts and children run from here (``python -m benchmarks...``)."""


def use_src(src: str | None) -> dict[str, Any]:
    """Put ``src`` first on the path the spawned children inherit (the parent never imports
    diloco), and say which code the run measures: for a snapshot, the commit named in a
    ``COMMIT`` file beside it (``git archive`` writes none; write it with ``git rev-parse HEAD``),
    for the checkout, its HEAD and the files of src/ that differ from it."""
    if src:
        where = os.path.abspath(src)
        sys.path.insert(0, where)
        info: dict[str, Any] = {"src": where}
        marker = os.path.join(os.path.dirname(where), "COMMIT")
        if os.path.exists(marker):
            with open(marker) as f:
                info["commit"] = f.read().strip()
        return info
    info = {"src": str(ROOT / "src")}
    try:
        git = ["git", "-C", str(ROOT)]
        info["commit"] = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        changed = subprocess.run(
            [*git, "status", "--porcelain", "src"], capture_output=True, text=True
        ).stdout.split("\n")
        info["working_tree_changes_in_src"] = [x for x in changed if x.strip()]
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def snapshot_source(dest: Path, tries: int = 10) -> dict[str, Any]:
    """Copy ``src/diloco`` to ``dest/diloco`` and check that it imports: children started with
    ``PYTHONPATH=dest`` run from this copy. Tried again a few times while the tree is mid-edit."""
    src = ROOT / "src" / "diloco"
    check = "import diloco, diloco.demo.data; from diloco import DiLoCoServer, DiLoCoWorker"
    error = ""
    for _ in range(tries):
        shutil.rmtree(dest / "diloco", ignore_errors=True)
        shutil.copytree(src, dest / "diloco", ignore=shutil.ignore_patterns("__pycache__"))
        env = {**os.environ, "PYTHONPATH": str(dest)}
        ok = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True)
        if ok.returncode == 0:
            digest = hashlib.sha256()
            for f in sorted((dest / "diloco").rglob("*.py")):
                digest.update(str(f.relative_to(dest)).encode() + f.read_bytes())
            head = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=src, capture_output=True, text=True
            ).stdout.strip()
            return {"source_sha256": digest.hexdigest()[:16], "git_head": head}
        error = ok.stderr.decode()[-2000:]
        time.sleep(5)  # someone is editing the tree: try again
    raise RuntimeError(f"the source does not import: {error}")
