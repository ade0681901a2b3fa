"""Import boundaries carry the architecture (docs/design.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "diloco"

ALLOWED = {
    "core": {"core"},
    "wire": {"core", "wire"},
    "edge": {"edge"},
    "server": {"core", "wire", "persistence", "edge", "server"},
    "worker": {"core", "wire", "persistence", "worker"},
    "integrations": {"core", "wire", "worker", "integrations"},
    "demo": {"core", "wire", "server", "worker", "swarm", "demo"},
    "swarm": {"core", "wire", "persistence", "edge", "worker", "swarm"},  # worker: its transport
}


def test_persistence_imports_nothing_of_diloco() -> None:
    """Checkpoint files are shared by the server and the worker (all-reduce mode's rank 0):
    the package stands alone."""
    for file in (SRC / "persistence").rglob("*.py"):
        assert _diloco_imports(file) <= {"persistence"}, file


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


#: The one place the server may use the worker: a relay is a worker of its upstream server and
#: talks to it with the worker's HTTP client, nothing else of the worker.
RELAY = SRC / "server" / "relay"


def test_package_import_boundaries() -> None:
    problems = []
    for package, allowed in ALLOWED.items():
        for file in sorted((SRC / package).rglob("*.py")):
            extra = {"worker"} if file.is_relative_to(RELAY) else set()
            for imported in _diloco_imports(file) - allowed - extra:
                problems.append(f"{file.relative_to(SRC)} imports diloco.{imported}")
    assert not problems, problems


def test_a_relay_uses_only_the_workers_transport() -> None:
    graph = _import_graph(type_checking=True)
    used = {
        target
        for module, targets in graph.items()
        if module.startswith("diloco.server.relay")
        for target in targets
        if target.startswith("diloco.worker")
    }
    assert used and all(t.startswith("diloco.worker.transport") for t in used), used


#: What each part of the server may import of the server (docs/design.md, "Import rules"),
#: by a name under ``diloco.server``: a sub-package, a top-level module, or one module of a
#: sub-package. The shared parts sit below the fronts and never import one; the fronts never
#: import each other; the web layer knows the front protocol (``front.py``), not what is behind
#: it; only ``server.py`` (``DiLoCoServer``) picks a front.
SERVER_ALLOWED = {
    "config": set(),
    "errors": set(),
    "params": {"config", "errors"},
    "members": {"config", "errors"},
    "observe": {"config", "errors", "members.registry", "members.rates", "params.store"},
    "rounds": {"config", "errors", "members", "params", "observe"},
    "intake": {"config", "errors", "members", "params", "observe", "rounds"},
    "front": {"config", "observe", "params.store"},
    "allreduce": {"config", "errors", "members", "observe"},
    "swarm": {
        *("config", "errors", "members", "observe", "params.wakeup"),
        # Stage sync reuses the all-reduce mode's quorums, never its front.
        *("allreduce.quorum_book", "allreduce.rendezvous", "allreduce.suspects"),
    },
    "paramserver": {
        *("config", "errors", "front", "members", "params", "observe", "rounds", "intake"),
    },
    # A relay is the parameter server's front with its own rounds and an upstream link.
    "relay": {
        *("config", "errors", "front", "members", "params", "observe", "rounds", "intake"),
        "paramserver",
    },
    "web": {"config", "errors", "front", "observe", "params.store"},
    "server": {"config", "front", "web", "allreduce", "paramserver", "relay", "swarm"},
    "": {"config", "server"},  # diloco.server itself: its exports
}


def _server_part(module: str) -> str:
    """``diloco.server.rounds.barrier`` -> ``rounds``; ``diloco.server`` -> ``""``."""
    return module.removeprefix("diloco.server").removeprefix(".").split(".")[0]


def _server_problems(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, imported in sorted(graph.items()):
        if module != "diloco.server" and not module.startswith("diloco.server."):
            continue
        part = _server_part(module)
        allowed = SERVER_ALLOWED[part] | {part}
        for target in sorted(imported):
            if not target.startswith("diloco.server."):
                continue
            name = target.removeprefix("diloco.server.")
            if not any(name == a or name.startswith(a + ".") for a in allowed):
                problems.append(f"{module} imports {target}")
    return problems


def test_server_parts_import_only_what_is_below_them() -> None:
    """Type-only imports included: a rule a ``TYPE_CHECKING`` import may break is no rule."""
    graph = _import_graph(type_checking=True)
    parts = {_server_part(m) for m in graph if m.startswith("diloco.server")}
    assert parts == set(SERVER_ALLOWED), "a part of the server without rules (or rules of none)"
    assert not _server_problems(graph)


@pytest.mark.parametrize(
    ("module", "target"),
    [
        ("diloco.server.allreduce.quorum_book", "diloco.server.rounds.barrier"),
        ("diloco.server.allreduce.allreduce_front", "diloco.server.intake.intake"),
        ("diloco.server.allreduce.allreduce_front", "diloco.server.params.store"),
        ("diloco.server.allreduce.allreduce_front", "diloco.server.paramserver.coordinator"),
        ("diloco.server.paramserver.coordinator", "diloco.server.allreduce.quorum_book"),
        ("diloco.server.rounds.outer_steps", "diloco.server.web.app"),
        ("diloco.server.rounds.synced_model", "diloco.server.paramserver.coordinator"),
        ("diloco.server.intake.intake", "diloco.server.front"),
        ("diloco.server.members.membership", "diloco.server.rounds.synced_model"),
        ("diloco.server.observe.status", "diloco.server.allreduce.allreduce_front"),
        ("diloco.server.web.app", "diloco.server.paramserver.coordinator"),
        ("diloco.server.web.control", "diloco.server.members.membership"),
        ("diloco.server.web.app", "diloco.server.params.update_bodies"),
    ],
)
def test_the_server_rules_catch_a_forbidden_import(module: str, target: str) -> None:
    """Each rule bites: the real graph with one forbidden edge added fails."""
    graph = _import_graph(type_checking=True)
    assert module in graph and target in graph
    assert _server_problems({**graph, module: graph[module] | {target}}) == [
        f"{module} imports {target}"
    ]


def test_only_the_factory_asks_which_mode_runs() -> None:
    """Each mode is one front: ``config.allreduce`` is read by ``make_front`` (server.py) and the
    config's own validation, nowhere else in the server."""
    readers = set()
    for file in (SRC / "server").rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "allreduce":
                readers.add(file.relative_to(SRC).as_posix())
            elif isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value == "allreduce" for c in node.comparators
            ):
                readers.add(file.relative_to(SRC).as_posix())
    assert readers == {"server/server.py", "server/config/checks.py"}


def test_server_folders_are_small_and_say_what_they_own() -> None:
    """A folder per concern, at most about 15 modules, its ``__init__`` saying what it owns."""
    for folder in [SRC / "server", *(p.parent for p in (SRC / "server").rglob("__init__.py"))]:
        modules = [f for f in folder.glob("*.py") if f.name != "__init__.py"]
        assert len(modules) <= 15, (folder, len(modules))
        init = folder / "__init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} says nothing"


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


#: The one ``torch.load``: a user's own state dict file given to ``--init``, through the
#: restricted loader (``weights_only=True``), which builds tensors and plain containers only.
TORCH_LOAD = SRC / "persistence" / "weights.py"


def _torch_loads(tree: ast.AST) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "load"
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "torch"
    ]


def test_no_pickle_anywhere() -> None:
    for file in SRC.rglob("*.py"):
        text = file.read_text()
        assert "import pickle" not in text, file
        if file != TORCH_LOAD:
            assert "torch.load(" not in text, file
            continue
        calls = _torch_loads(ast.parse(text))
        assert len(calls) == 1, file
        weights_only = [k for k in calls[0].keywords if k.arg == "weights_only"]
        assert [getattr(k.value, "value", None) for k in weights_only] == [True], file
        # torch.distributed's object collectives pickle (a worker group may span machines).
        for pickling in ("_object_list", "all_gather_object", "gather_object", "scatter_object"):
            assert pickling not in text, (file, pickling)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, *, type_checking: bool) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif type_checking or not _is_type_checking(node):
            todo.extend(ast.iter_child_nodes(node))
    return found


def _import_graph(*, type_checking: bool) -> dict[str, set[str]]:
    """Module -> the diloco modules it imports (``from pkg import module`` names the module).
    An edge into a package's ``__init__`` from inside that package is left out: the package
    runs first, so it never closes a loop."""
    files = {_module_name(f): f for f in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, file in files.items():
        edges: set[str] = set()
        for node in _imports(ast.parse(file.read_text()), type_checking=type_checking):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in files)
            elif node.module and node.level == 0:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    edges.add(sub if sub in files else node.module)
        graph[name] = {
            e for e in edges if e in files and e != name and not name.startswith(e + ".")
        }
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    return cycles


def test_no_import_cycles() -> None:
    """No module of diloco imports itself through others when the program runs."""
    assert not _cycles(_import_graph(type_checking=False))


@pytest.mark.parametrize(
    "package", ["diloco.core", "diloco.wire", "diloco.worker", "diloco.server"]
)
def test_no_import_cycles_even_for_types(package: str) -> None:
    """Nor for the type checker (``if TYPE_CHECKING`` imports), in the packages held to it:
    a loop that only types close still means two modules that cannot be read apart."""
    cycles = _cycles(_import_graph(type_checking=True))
    assert not [c for c in cycles if any(m.startswith(package) for m in c)]


# --- diloco.worker's sub-packages ---------------------------------------------------------------

WORKER_RULES: dict[str, set[str]] = {
    "transport": set(),
    "state": {"transport"},
    "server_mode": {"transport", "state", "session", "settings", "strategy"},
    "allreduce": {"transport", "state", "session", "settings", "strategy"},
    "groups": {"transport", "state", "session", "settings", "strategy"},
}
"""A part of ``diloco.worker`` -> the other parts it may import (type-checking imports too):
the HTTP client stands alone, the worker's state knows no strategy, and no strategy family
knows another (a worker group wraps whichever through ``SyncStrategy``)."""

WORKER_FAMILIES = {"server_mode", "allreduce", "groups"}
"""The strategy families: outside them, only the chooser and the lifecycle import one."""

WORKER_CHOOSERS = {"diloco.worker.choose", "diloco.worker.worker"}


def _worker_edges() -> list[tuple[str, str]]:
    """(module, diloco.worker module or package it imports), type-checking imports included,
    edges into a package's ``__init__`` too (``from diloco.worker import X`` runs the lifecycle)."""
    files = {_module_name(f): f for f in SRC.rglob("*.py")}
    edges = []
    for name, file in sorted(files.items()):
        for node in _imports(ast.parse(file.read_text()), type_checking=True):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif node.module and node.level == 0:
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                    for a in node.names
                ]
            else:
                continue
            edges += [(name, t) for t in targets if t.split(".")[:2] == ["diloco", "worker"]]
    return edges


def _worker_part(module: str) -> str | None:
    """``diloco.worker.state.encoder`` -> ``state``; ``diloco.worker`` -> ``__init__``; None
    outside the package."""
    parts = module.split(".")
    if parts[:2] != ["diloco", "worker"]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


def test_worker_subpackage_boundaries() -> None:
    """The worker's sub-packages by strategy family keep to ``WORKER_RULES``, and a strategy
    is picked only in ``worker/choose.py`` (and built into the lifecycle in ``worker.py``)."""
    problems = []
    for module, target in _worker_edges():
        part, goal = _worker_part(module), _worker_part(target)
        if goal == part:
            continue
        if part in WORKER_RULES and goal not in WORKER_RULES[part]:
            allowed = ", ".join(sorted(WORKER_RULES[part])) or "nothing else of diloco.worker"
            problems.append(f"{module} imports {target}: worker/{part}/ may import {allowed}")
        elif goal in WORKER_FAMILIES and part not in WORKER_FAMILIES:
            if module not in WORKER_CHOOSERS:
                problems.append(f"{module} imports the strategy family {target}")
    assert not problems, problems
