"""Optional dependencies: a missing one is an error that names the extra to install."""

from __future__ import annotations


def missing(extra: str, exc: ImportError) -> ImportError:
    """The error for ``diloco.integrations.<extra>`` imported without its extra installed."""
    return ImportError(
        f"diloco.integrations.{extra} needs {exc.name or extra}, which is not installed: "
        f"pip install 'diloco[{extra}]'"
    )
