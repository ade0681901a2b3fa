"""``./dev``'s set-up of ``.venv``: a first run says what each step does; a ready ``.venv``
says nothing; a changed lock or an unfinished set-up is picked up again.

The script runs for real (bash, in a copy of the repository's files) with a stand-in Python
on ``PYTHON``: its ``-m venv`` makes a ``.venv`` whose ``python`` records the pip commands it
gets and whose ``diloco`` echoes its arguments, so no package is installed and the test takes
a second. What real pip prints under ``--quiet`` (errors only) is pip's own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]

# ``-m venv DIR``: a .venv whose python logs its arguments (and fails when FAKE_PIP_FAILS is
# set), and whose diloco prints its own.
_FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = --version ]; then echo "Python 3.11.99"; exit 0; fi
if [ "$1 $2" = "-m venv" ]; then
  mkdir -p "$3/bin"
  printf '#!/usr/bin/env bash\\necho "$*" >> "%s"\\n[ -z "${FAKE_PIP_FAILS:-}" ]\\n' "$CALLS" > "$3/bin/python"
  printf '#!/usr/bin/env bash\\necho "diloco $*"\\n' > "$3/bin/diloco"
  chmod +x "$3/bin/python" "$3/bin/diloco"
  echo "venv $3" >> "$CALLS"
  exit 0
fi
exit 3
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("dev", "requirements-lock.txt", "pyproject.toml"):
        shutil.copy2(ROOT / name, repo / name)
    fake = tmp_path / "python"
    fake.write_text(_FAKE_PYTHON)
    fake.chmod(0o755)
    return repo


def _dev(repo: Path, *args: str, fail: bool = False) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": str(repo.parent / "python"), "CALLS": str(repo.parent / "calls")}
    env.pop("FAKE_PIP_FAILS", None)
    if fail:
        env["FAKE_PIP_FAILS"] = "1"
    return subprocess.run(
        ["bash", str(repo / "dev"), *args], capture_output=True, text=True, env=env, timeout=30
    )


def _calls(repo: Path) -> list[str]:
    path = repo.parent / "calls"
    lines = path.read_text().splitlines() if path.exists() else []
    path.unlink(missing_ok=True)
    return lines


def test_first_run_says_each_step_and_a_ready_venv_says_nothing(checkout: Path) -> None:
    first = _dev(checkout, "demo", "--workers", "2")
    assert first.returncode == 0, first.stderr
    assert first.stdout == "diloco demo --workers 2\n"
    said = first.stderr.splitlines()
    assert said[0].startswith("first run: setting up .venv") and "minutes" in said[0]
    steps = [line.strip()[:5] for line in said if line.strip().startswith("[")]
    assert steps == ["[1/3]", "[2/3]", "[3/3]"]
    assert "Python 3.11.99" in first.stderr  # the interpreter it uses is named
    assert said[-1].startswith(".venv ready in ") and said[-1].endswith(" s")
    calls = _calls(checkout)
    assert calls[0] == "venv .venv"
    assert [c for c in calls[1:] if "pip install" in c] == [
        "-m pip install --quiet --disable-pip-version-check -r requirements-lock.txt",
        "-m pip install --quiet --disable-pip-version-check --no-deps -e .",
    ]

    again = _dev(checkout, "demo")
    assert again.returncode == 0
    assert again.stderr == "" and again.stdout == "diloco demo\n"
    assert _calls(checkout) == []  # nothing installed again


def test_a_changed_lock_or_an_unfinished_set_up_is_taken_up_again(checkout: Path) -> None:
    failed = _dev(checkout, "diloco", "--help", fail=True)
    assert failed.returncode != 0 and failed.stdout == ""
    assert ".venv ready" not in failed.stderr
    _calls(checkout)

    # The .venv exists but its set-up did not finish: the next run finishes it, without
    # making the .venv again.
    resumed = _dev(checkout, "diloco", "--help")
    assert resumed.returncode == 0 and resumed.stdout == "diloco --help\n"
    assert resumed.stderr.startswith("updating .venv") and "[1/3]" not in resumed.stderr
    assert not any(c.startswith("venv ") for c in _calls(checkout))

    with (checkout / "requirements-lock.txt").open("a") as lock:
        lock.write("example-package==1.0\n")
    changed = _dev(checkout, "diloco", "--help")
    assert changed.stderr.startswith("updating .venv")
    assert any("-r requirements-lock.txt" in c for c in _calls(checkout))
    assert _dev(checkout, "diloco", "--help").stderr == ""
