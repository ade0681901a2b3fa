"""Optional dependencies: a missing one is an error that says how to install it.

diloco is on no package index, so asking pip for ``diloco[extra]`` by name cannot work; the error
names the two installs that do: the extra from a checkout, and the extra's packages themselves.
"""

from __future__ import annotations

import importlib.metadata
import re


def extra_packages(extra: str) -> list[str]:
    """The requirements (``name>=version``) that ``pyproject.toml`` lists for ``extra``, read from
    the installed package's metadata so they are declared once; empty when diloco's metadata is
    not installed (its source on ``PYTHONPATH`` alone)."""
    try:
        requires = importlib.metadata.requires("diloco") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    marker = re.compile(r"""^\s*extra\s*==\s*["']""" + re.escape(extra) + r"""["']\s*$""")
    found = []
    for line in requires:
        requirement, _, condition = line.partition(";")
        if marker.match(condition):
            found.append(requirement.strip())
    return found


def missing(extra: str, exc: ImportError) -> ImportError:
    """The error for ``diloco.integrations.<extra>`` imported without its extra installed."""
    packages = " ".join(f"'{p}'" for p in extra_packages(extra))
    alternative = f", or its packages alone: pip install {packages}" if packages else ""
    return ImportError(
        f"diloco.integrations.{extra} needs {exc.name or extra}, which is not installed. "
        f"Install the extra from the diloco checkout: pip install -e '.[{extra}]'{alternative}"
    )
