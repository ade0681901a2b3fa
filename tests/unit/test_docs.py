"""The docs name only what exists: every repository path a markdown file names, every relative
link (and its ``#section``), every docs section a comment or docstring cites, and
``docs/design.md`` stays short enough to read (docs/design.md, "Map of packages"), and its
"Modules over ~450 lines" names exactly the library and benchmark modules that long.

A path is recognised by its first component: ``src/diloco/``, the repository's own folders
(``benchmarks/``, ``tests/``, ``examples/``, ``docs/``), a sub-package of ``diloco`` written
relative to ``src/diloco/`` (``server/rounds/barrier.py``) and a test lane written relative to
``tests/`` (``unit/test_layout.py``); a module named alone in a code span (``front.py``) must
be some file's name. Such a path counts as existing when it resolves against
the repository root, ``src/diloco/``, ``tests/`` or the markdown file's own folder. A
``path.py::name`` must also define ``name``.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
DESIGN_MAX_LINES = 520

#: Markdown files whose paths and links must exist. The benchmark log is history: it names
#: files as they were when each entry was written, so only its links are checked.
HISTORY = {ROOT / "docs" / "benchmarks-log.md"}

PACKAGES = ("core", "wire", "server", "worker", "cli", "demo", "integrations", "persistence")
LANES = ("unit", "integration", "processes", "browser", "helpers", "programs")
FIRST = ("src/diloco", "benchmarks", "tests", "examples", "docs", *PACKAGES, *LANES)

# A path: one of the known first components, then path characters. Not preceded by a path
# character (``client/server`` is prose, ``diloco/server`` is not a path of this repository)
# nor by ``/`` (a URL's path, ``/dashboard/app.js``).
PATH = re.compile(
    r"(?<![\w./@-])((?:" + "|".join(re.escape(f) for f in FIRST) + r")/(?:[\w./*-]|\{[\w.,*-]*\})*)"
    r"(?:::(\w+))?"
)
# Where a documented command writes (``--json benchmarks/results/x.json``): it may not exist yet.
OUTPUT = re.compile(r"--(?:out|json|txt|save-dir|out-dir)[ =]$")
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)|!\[[^\]\n]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "tests" / "README.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.exists()]


def _bases(md: Path) -> list[Path]:
    return [ROOT, ROOT / "src" / "diloco", ROOT / "tests", md.parent]


def _expand(pattern: str) -> list[str]:
    """``a.{json,txt}`` -> ``a.json``, ``a.txt`` (each group of braces in turn)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [p for alt in m.group(1).split(",") for p in _expand(head + alt + tail)]


def _exists(path: str, md: Path) -> Path | None:
    """Where ``path`` (a glob when it holds ``*`` or braces: something must match) resolves."""
    clean = path.rstrip(".")  # a sentence's full stop
    for base in _bases(md):
        for pattern in _expand(clean):
            if "*" in pattern:
                match = next(iter(sorted(base.glob(pattern))), None)
                if match is not None:
                    return match
            elif (base / pattern).exists():
                return base / pattern
    return None


def _defines(file: Path, name: str) -> bool:
    text = file.read_text()
    return (
        re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b", text, re.M) is not None
    )


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"`", "", text)
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in ("L", "N"))
    return kept.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in md.read_text().splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not in_fence:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def _names(heading: str, cited: str) -> bool:
    """A citation names a heading by its text, or by the text before its colon or
    parenthesis ("Durable rounds" for "Durable rounds: saving every round (date)")."""
    return heading == cited or re.match(re.escape(cited) + r"\s*[:(,]", heading) is not None


def headings(md: Path) -> set[str]:
    """The headings' texts (code spans unquoted), for citations by name."""
    found = set()
    for line in md.read_text().splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if m:
            found.add(m.group(1).replace("`", ""))
    return found


# A module named alone in a code span (`` `persistence.py` ``): some file must carry that name.
BARE = re.compile(r"`(\w+\.py)`")


def _module_names() -> set[str]:
    return {
        f.name for d in ("src", "tests", "benchmarks", "examples") for f in (ROOT / d).rglob("*.py")
    }


def stale_paths(text: str, md: Path) -> list[str]:
    """Paths named in ``text`` (of the markdown file ``md``) that do not exist."""
    problems = []
    names = _module_names()
    for number, line in enumerate(text.splitlines(), 1):
        for m in BARE.finditer(line):
            if m.group(1) not in names:
                problems.append(f"{md.relative_to(ROOT)}:{number}: no module named {m.group(1)!r}")
        for m in PATH.finditer(line):
            path, name = m.group(1), m.group(2)
            before = line[max(0, m.start() - 16) : m.start()]
            if "://" in before or OUTPUT.search(before):
                continue
            target = _exists(path, md)
            if target is None:
                problems.append(f"{md.relative_to(ROOT)}:{number}: no such path {path!r}")
            elif name and target.is_file() and not _defines(target, name):
                problems.append(f"{md.relative_to(ROOT)}:{number}: {path} defines no {name!r}")
    return problems


def broken_links(text: str, md: Path) -> list[str]:
    """Relative links in ``text`` (of ``md``) to a missing file or section."""
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        for m in LINK.finditer(line):
            target = m.group(1) or m.group(2)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (md.parent / file).resolve() if file else md
            where = f"{md.relative_to(ROOT)}:{number}"
            if not dest.exists():
                problems.append(f"{where}: link to a missing file {target!r}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: {dest.relative_to(ROOT)} has no section #{anchor}")
    return problems


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_names_only_paths_that_exist(md: Path) -> None:
    if md in HISTORY:
        pytest.skip("a log names files as they were")
    problems = stale_paths(md.read_text(), md)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_their_sections_exist(md: Path) -> None:
    problems = broken_links(md.read_text(), md)
    assert not problems, "\n".join(problems)


# A docs file cited in code: ``docs/design/groups.md``, then optionally ``#anchor`` or a quoted
# section name (``docs/design.md, "Protocol"``, ``docs/design/codecs.md ("Downlink")``).
CITATION = re.compile(
    r"(docs/[\w/.-]+?\.md)(?:#([\w-]+)|,?\s*\(?\s*[\"']([A-Z][^\"'\n]{1,60})[\"'])?"
)


def _flattened(text: str) -> str:
    """Comments and docstrings wrap: lines joined, comment markers and indents dropped."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)


def stale_citations(text: str, label: str) -> list[str]:
    """Docs files and sections cited in the code ``text`` that do not exist."""
    problems = []
    for m in CITATION.finditer(_flattened(text)):
        doc, anchor, section = m.groups()
        where = f"{label}: {m.group(0)!r}"
        target = ROOT / doc
        if not target.exists():
            problems.append(f"{where}: no such file")
        elif anchor and anchor not in anchors(target):
            problems.append(f"{where}: no section #{anchor}")
        elif section and not any(_names(h, section) for h in headings(target)):
            problems.append(f"{where}: no section named {section!r}")
    return problems


def code_files() -> list[Path]:
    files = []
    for folder in ("src", "tests", "benchmarks", "examples"):
        files += sorted((ROOT / folder).rglob("*.py"))
    files += sorted((ROOT / "src").rglob("*.js"))
    return [f for f in files if "__pycache__" not in f.parts and f != Path(__file__).resolve()]


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_cites_sections_that_exist(md: Path) -> None:
    """``docs/design/codecs.md``, "Worker side" in prose names a heading of that file."""
    if md in HISTORY:
        pytest.skip("a log cites sections as they were")
    problems = stale_citations(md.read_text(), str(md.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


def test_code_cites_docs_sections_that_exist() -> None:
    problems = [
        p for f in code_files() for p in stale_citations(f.read_text(), str(f.relative_to(ROOT)))
    ]
    assert not problems, "\n".join(problems)


def test_design_doc_stays_short() -> None:
    lines = len(DESIGN.read_text().splitlines())
    assert lines <= DESIGN_MAX_LINES, (
        f"docs/design.md has {lines} lines (at most {DESIGN_MAX_LINES}): move detail of one mode "
        "or concern into docs/design/"
    )


#: docs/design.md, "Modules over ~450 lines": the library and benchmark modules longer than this
#: are each named there with the reason they stay whole.
LONG_MODULE = 450


def explained_long_modules(design: str) -> set[str]:
    """The modules the section names with a size, ``worker/worker.py`` (511 lines): a library
    module relative to ``src/diloco``, a benchmark's from the repository root."""
    section = design.split("### Modules over ~450 lines", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`([\w/]+\.py)`\s*\(\d+ lines\)", section))


def test_long_modules_are_the_ones_design_md_explains() -> None:
    """A module over ~450 lines is split or explained; one the section explains is still long
    (a split that left the paragraph behind is caught)."""
    lib = ROOT / "src" / "diloco"
    files = [*lib.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    long = {
        (f.relative_to(lib) if f.is_relative_to(lib) else f.relative_to(ROOT)).as_posix()
        for f in files
        if len(f.read_text().splitlines()) > LONG_MODULE
    }
    explained = explained_long_modules(DESIGN.read_text())
    assert long == explained, (
        f"over {LONG_MODULE} lines: {sorted(long)}; explained: {sorted(explained)}"
    )


def test_the_long_module_check_reads_its_section() -> None:
    design = (
        "## A\n`a/b.py` (900 lines)\n### Modules over ~450 lines\n\nIn `src/diloco`: "
        "`worker/x.py` (511 lines), and `w/y.py`\n(513 lines); `tests/t.py` (every case).\n"
        "## Protocol\n`c/d.py` (600 lines)\n"
    )
    assert explained_long_modules(design) == {"worker/x.py", "w/y.py"}


def test_the_checks_bite() -> None:
    """Each check finds what it is for, and leaves alone what it must not flag."""
    md = ROOT / "docs" / "probe.md"  # never written: the checks read the text given
    text = (
        "see `server/rounds/nowhere.py` and [x](design/missing.md), "
        "`tests/unit/test_docs.py::test_no_such_test` but `tests/unit/test_docs.py::slug`, "
        "a client/server split, http://h:1/tests/x.py, /dashboard/app.js, `worker/transport/`, "
        "`unit/test_layout.py`, [y](design.md#protocol) and [z](design.md#no-such-section), "
        "`front.py` and `gone.py`.\n"
    )
    assert [p.split("(")[0].split(": ", 1)[1] for p in stale_paths(text, md)] == [
        "no module named 'gone.py'",
        "no such path 'server/rounds/nowhere.py'",
        "tests/unit/test_docs.py defines no 'test_no_such_test'",
    ]
    assert [p.split(": ", 1)[1] for p in broken_links(text, md)] == [
        "link to a missing file 'design/missing.md'",
        "docs/design.md has no section #no-such-section",
    ]
    assert slug("Codecs, worker side") == "codecs-worker-side"
    assert slug("`GET /status` and /metrics") == "get-status-and-metrics"
    code = '"""See docs/design.md, "No such\n    section", and docs/design.md, "Protocol"."""\n'
    code += "# docs/nowhere.md and docs/design.md#protocol\n"
    assert [p.split(": ", 2)[2] for p in stale_citations(code, "probe.py")] == [
        "no section named 'No such section'",
        "no such file",
    ]
