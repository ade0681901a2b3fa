"""docs/migrating.md maps the reference's flags to ours: every flag it names as ours exists on
the command it names, so the page cannot drift from the parsers (issue 27)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from diloco.cli.main import build_parser

PAGE = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"
#: Flags the page names that are not diloco's, with why: they belong to the user's own script.
NOT_OURS = {"--num-shards", "--shard-index"}


def _options(command: str) -> set[str]:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            parser = action.choices[command]
            return {s for a in parser._actions for s in a.option_strings}
    raise AssertionError("no subcommands")


def _section(title: str) -> str:
    text = PAGE.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def _flags(text: str) -> set[str]:
    spans = re.findall(r"`([^`]*)`", text)
    return {f for span in spans for f in re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", span)}


def test_the_server_flags_the_page_names_exist() -> None:
    named = _flags(_section("Server command line")) - NOT_OURS
    assert named, "the section names no flag: the check would pass on anything"
    assert named - _options("server") == set()


def test_the_worker_flags_the_page_names_exist() -> None:
    named = _flags(_section("Worker command line")) - NOT_OURS
    # `diloco status --server` and `--json` are named there too.
    assert named - _options("worker") - _options("status") == set()
    assert {"-p", "-t", "-d"} <= named
