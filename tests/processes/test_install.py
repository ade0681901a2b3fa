"""The package installs beside the torch an environment already holds (README, "Install").

The wheel is built from a copy of the source, offline, and installed with pip resolving its
dependencies (no ``--no-deps``) into a fresh environment that sees this environment's torch and
the other dependencies, but not diloco itself. pip runs with every index and link turned off and
no configuration file, so had it wanted any torch other than the one there, the install would
fail instead of fetching one. "Untouched" is then checked from outside pip: the same version
imported from the same file, not rewritten, and nothing new in the environment but diloco.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]

# What the fresh environment's python reports of the torch it imports.
_PROBE = (
    "import json, os, torch; path = os.path.realpath(torch.__file__); "
    "print(json.dumps([torch.__version__, path, os.stat(path).st_mtime_ns]))"
)


def _offline_env() -> dict[str, str]:
    """The environment for the fresh interpreter and its pip: no project source on the path, no
    user site, no pip configuration (``os.devnull`` makes pip read no file), no index, no links."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(name, None)
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PYTHONNOUSERSITE="1")
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip wheel --no-build-isolation`` on a copy (a build writes ``build/`` and egg-info
    beside its source): the setuptools it needs comes from requirements-lock.txt, not a download."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    dist = tmp_path / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    out = subprocess.run(
        cmd + ["-w", str(dist), str(source)],
        capture_output=True, text=True, env=_offline_env(), timeout=120,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (wheel,) = dist.glob("diloco-*.whl")
    return wheel


def _environment_with_torch(tmp_path: Path) -> tuple[Path, Path]:
    """A fresh venv whose path ends with a view of this environment's site-packages without
    diloco (its dist-info and editable hooks): torch, pip and the other dependencies are there
    as in a user's environment, diloco is not. Returns (its python, its own site-packages)."""
    site = Path(torch.__file__).resolve().parents[1]
    view = tmp_path / "existing-packages"
    view.mkdir()
    for entry in site.iterdir():
        if entry.name.startswith(("diloco", "__editable__")) or entry.suffix == ".pth":
            continue
        (view / entry.name).symlink_to(entry)
    venv = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, env=_offline_env(),
    ).stdout.strip()
    own = Path(purelib)
    (own / "existing_packages.pth").write_text(f"{view}\n")
    return python, own


def _torch_seen_by(python: Path, cwd: Path) -> list[object]:
    out = subprocess.run(
        [str(python), "-c", _PROBE],
        capture_output=True, text=True, check=True, env=_offline_env(), cwd=cwd,
    )
    return list(json.loads(out.stdout))


@pytest.mark.timeout(180)
def test_the_wheel_installs_beside_the_torch_already_there(tmp_path: Path, wheel: Path) -> None:
    python, own = _environment_with_torch(tmp_path)
    before_torch = _torch_seen_by(python, tmp_path)
    before_entries = set(os.listdir(own))

    out = subprocess.run(
        [str(python), "-m", "pip", "install", str(wheel)],
        capture_output=True, text=True, env=_offline_env(), cwd=tmp_path, timeout=120,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # pip resolved torch and found it satisfied (with --no-deps it would not have looked).
    assert "Requirement already satisfied: torch" in out.stdout, out.stdout

    assert _torch_seen_by(python, tmp_path) == before_torch
    version = wheel.name.split("-")[1]
    assert set(os.listdir(own)) - before_entries == {"diloco", f"diloco-{version}.dist-info"}

    # The installed copy, not the source tree, is what runs; the dashboard's files came with it.
    check = (
        "import diloco, importlib.resources as r; "
        "print(diloco.__file__); "
        "print(' '.join(p.name for p in r.files('diloco.server.web.dashboard').iterdir()))"
    )
    ran = subprocess.run(
        [str(python), "-c", check],
        capture_output=True, text=True, env=_offline_env(), cwd=tmp_path, check=True,
    )
    where, files = ran.stdout.splitlines()
    assert Path(where).parent == own / "diloco"
    assert {"index.html", "app.js", "style.css"} <= set(files.split())
    cli = subprocess.run(
        [str(python.parent / "diloco"), "--help"],
        capture_output=True, text=True, env=_offline_env(), cwd=tmp_path, timeout=60,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "server" in cli.stdout and "worker" in cli.stdout


def test_the_wheel_admits_torch_releases_beyond_this_one(wheel: Path) -> None:
    """The environment above holds the torch the lock pins, which an exact pin would also
    accept; the wheel's own requirement must admit the next releases too (a newer torch, a CUDA
    build with a local version) and this one."""
    with zipfile.ZipFile(wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        lines = zf.read(meta).decode().splitlines()
    (torch_req,) = [
        Requirement(line.split(":", 1)[1]) for line in lines
        if line.startswith("Requires-Dist:") and Requirement(line.split(":", 1)[1]).name == "torch"
    ]
    here = Version(torch.__version__)
    major, minor = here.release[:2]
    for release in (
        here.base_version, f"{major}.{minor + 1}.0", f"{major + 1}.0.0", f"{here.base_version}+cu128"
    ):
        assert torch_req.specifier.contains(release, prereleases=False), (torch_req, release)
