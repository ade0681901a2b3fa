"""What pyproject.toml promises an installer, against the lock and the README: ranges that keep
the user's torch, a lock whose pins the ranges admit, and install instructions that work for a
package on no index (README, "Install")."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from diloco.integrations._deps import extra_packages, missing

ROOT = Path(__file__).parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements-lock.txt").read_text().splitlines():
        name, _, version = line.partition("==")
        pins[canonicalize_name(name)] = version
    return pins


def _torch() -> Requirement:
    (torch,) = [r for r in map(Requirement, PROJECT["dependencies"]) if r.name == "torch"]
    return torch


def test_torch_is_a_lower_bound_and_the_lock_keeps_its_exact_pin() -> None:
    torch = _torch()
    # One ``>=`` clause: any newer torch, CUDA builds (local versions) included, is kept.
    assert [s.operator for s in torch.specifier] == [">="]
    assert _lock()["torch"] == "2.13.0"
    assert torch.specifier.contains("2.13.0")


def test_every_range_admits_the_version_the_lock_pins() -> None:
    """The tests run on the lock's versions; a bound above one of them would describe a set of
    versions nobody tested."""
    pins = _lock()
    requirements = [Requirement(r) for r in PROJECT["dependencies"]]
    for extra in PROJECT["optional-dependencies"].values():
        requirements += [Requirement(r) for r in extra]
    for r in requirements:
        assert r.specifier.contains(pins[canonicalize_name(r.name)]), (r, pins[r.name])


def test_the_readme_states_the_torch_range_pyproject_declares() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    assert f"`{_torch()}`" in section
    for command in ("pip install -e '.[transformers]'", "pip wheel --no-deps . -w dist"):
        assert command in section


def test_no_text_tells_users_to_install_diloco_from_an_index() -> None:
    """``pip install 'diloco[...]'`` cannot work: the package is on no index."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    texts += sorted((ROOT / "src").rglob("*.py"))
    offenders = [p for p in texts if re.search(r"pip install ['\"]?diloco\b", p.read_text())]
    assert offenders == []


def _metadata_requires(name: str) -> list[str]:
    """``importlib.metadata.requires("diloco")`` as an installed diloco answers it: pyproject's
    lists, each optional one with its ``extra`` marker."""
    assert name == "diloco"
    lines = list(PROJECT["dependencies"])
    for extra, requirements in PROJECT["optional-dependencies"].items():
        lines += [f'{r}; extra == "{extra}"' for r in requirements]
    return lines


def test_a_missing_extra_names_the_checkout_install_and_the_extras_packages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(importlib.metadata, "requires", _metadata_requires)
    for extra in ("transformers", "lightning"):
        # One declaration (pyproject.toml): the packages come from diloco's metadata.
        assert extra_packages(extra) == PROJECT["optional-dependencies"][extra]
        message = str(missing(extra, ImportError("absent", name=extra)))
        assert f"diloco.integrations.{extra} needs {extra}" in message
        assert f"pip install -e '.[{extra}]'" in message
        assert " ".join(f"'{r}'" for r in extra_packages(extra)) in message
    assert extra_packages("no-such-extra") == []


def test_without_diloco_installed_the_error_still_names_the_checkout_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Source on PYTHONPATH alone: no metadata, so no package list, and no error about that."""

    def absent(name: str) -> list[str]:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "requires", absent)
    assert extra_packages("lightning") == []
    message = str(missing("lightning", ImportError("absent", name="lightning")))
    assert message.endswith("pip install -e '.[lightning]'")
