"""Checkpoints of the server state: safetensors for tensors, JSON for everything else. No pickle.

Layout of one checkpoint, ``<save_dir>/round-000000012/`` (``round-000000012.N/`` when round 12
was saved again, N = 1, 2, ...):
- ``params.safetensors``: the global parameters by wire name, each tied tensor once (loads into
  a model, wrapped or tied, with ``diloco.load_into``);
- ``optimizer.safetensors``: the outer optimizer's tensor state, keyed ``<param index>/<key>``;
- ``true.safetensors``, only with a lossy download codec: the outer step's true copy of the
  parameters (``params.safetensors`` then holds the published ones, what the workers hold);
- ``state.json``: round, generation, optimizer param groups and scalars, counters. Written last.

Checkpoints are transactions. A folder under a checkpoint name is complete and never written
again: it is built in a fresh ``.tmp-round-*`` folder, whose tensor files are fsynced before
``state.json`` is created (so a ``state.json`` that parses implies tensors on disk), the folder is
fsynced, then renamed to a name that does not exist yet, and the save dir is fsynced. Saving a
round again (a graceful stop right after a periodic save, ``/control/save_state``) takes the next
generation's name; the copy it supersedes is removed only once the new one is durable. So at every
instant a complete copy of the newest saved state sits under a checkpoint name. The alternatives
were weaker: ``rename(2)`` cannot replace a non-empty folder, ``renameat2(RENAME_EXCHANGE)`` is
Linux-only, reached only through ctypes and not offered by every file system; moving the old
folder aside before renaming the new one in leaves an instant with neither under its name; a
pointer file is one more file that can be torn or disagree with the folders. A rename to a fresh
name is atomic on every POSIX file system and needs nothing else.

Order and pruning go by content, never by folder name: (round, generation) from ``state.json``. A
folder named like a checkpoint counts only when complete (``state.json`` of this format, each
tensor file as long as its header says); a torn or foreign one is reported, skipped, never counted
toward ``keep`` and never deleted (it is the operator's to look at). Pruning keeps the checkpoint
just written and the newest ``keep - 1`` other rounds; a folder being removed is first renamed to
``.old-round-*``, so a kill mid-removal leaves no half-deleted folder under a checkpoint name.

When the server opens its save dir, leftover temporaries go: ``.old-round-*`` always, a
``.tmp-round-*`` unless it is complete and newer than every checkpoint, in which case it is
renamed into place. This module never leaves the only copy of a saved state in a temporary: a
temporary not yet renamed belongs to a save that had not returned (nothing was published from it,
and the previous checkpoint is still in place). Versions before this scheme removed ``round-R``
before renaming its re-save into place; the promotion keeps what such a kill left behind.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

FORMAT = "diloco-server-state/1"
NAME = re.compile(r"^round-(\d{9})(?:\.([1-9]\d*))?$")
PREFIX = "round-"
TMP_PREFIX = ".tmp-round-"
TRASH_PREFIX = ".old-round-"
TENSOR_FILES = ("params.safetensors", "optimizer.safetensors")
# Optional: a lossy downlink's true copy (server/params/update_bodies.py).
TRUE_FILE = "true.safetensors"

# Saves come from the event loop's worker threads; picking a fresh name and pruning must not
# interleave between two of them.
_SAVE_LOCK = threading.Lock()
# Torn folders are reported once per process, not at every save.
_REPORTED: set[tuple[str, str]] = set()


@dataclass
class Checkpoint:
    path: Path
    round: int
    params: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    extra: dict[str, Any]
    #: The true copy of a lossy downlink's run; None: equal to ``params``.
    true_params: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class Entry:
    """A complete checkpoint folder, placed by its content."""

    path: Path
    round: int
    generation: int

    @property
    def key(self) -> tuple[int, int, str]:
        return (self.round, self.generation, self.path.name)


class NoLoadableCheckpoint(ValueError):
    """The save dir holds checkpoint folders and none of them can be loaded."""

    def __init__(self, root: Path, problems: list[tuple[Path, str]]) -> None:
        self.problems = problems
        lines = "".join(f"\n  {p.name}: {why}" for p, why in problems)
        super().__init__(
            f"{root} holds checkpoint folders but none can be loaded:{lines}\n"
            "refusing to start from scratch beside them; fix or move them, resume with "
            "--from-checkpoint, or pass --fresh-start (ServerConfig.fresh_start) to begin anew "
            "(the folders are left as they are)"
        )


class _Torn(ValueError):
    """Why a folder is not a complete checkpoint (without its path)."""


def _jsonable(value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, where) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: non-finite value {value}")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"{where}: cannot store {type(value).__name__} in JSON")


def _split_optimizer_state(
    state_dict: dict[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, entry in state_dict["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors[f"{idx}/{key}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = _jsonable(
                    value, f"optimizer state {idx}/{key}"
                )
    groups = [
        {k: _jsonable(v, f"param group {k}") for k, v in g.items()}
        for g in state_dict["param_groups"]
    ]
    return tensors, {"param_groups": groups, "scalars": scalars}


def _join_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        idx, name = key.split("/", 1)
        state.setdefault(int(idx), {})[name] = value
    for idx, entries in meta["scalars"].items():
        for name, value in entries.items():
            # torch optimizers keep "step" as a tensor; give it back in that form.
            state.setdefault(int(idx), {})[name] = (
                torch.tensor(float(value)) if name == "step" else value
            )
    return {"state": state, "param_groups": meta["param_groups"]}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


# --- reading --------------------------------------------------------------------------------


def _read_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads((path / "state.json").read_text())
    except OSError as exc:
        raise _Torn(f"state.json: {exc.strerror or exc}") from None
    except ValueError:
        raise _Torn("state.json is not valid JSON (torn write?)") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise _Torn(f"state.json: unknown format {found!r}, expected {FORMAT!r}")
    for key in ("round", "generation"):
        value = state.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _Torn(f"state.json: {key} is {value!r}, not a count")
    if not isinstance(state.get("optimizer"), dict):
        raise _Torn("state.json: no optimizer section")
    return state


def _check_tensor_file(path: Path) -> None:
    """Cheap completeness check: the file is exactly as long as its header says (a torn or
    truncated write is not), without reading the tensors."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else size
            if n > size - 8:
                raise _Torn(f"{path.name}: truncated ({size} bytes)")
            header = json.loads(fh.read(n))
            end = max(
                (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                default=0,
            )
    except _Torn:
        raise
    except OSError as exc:
        raise _Torn(f"{path.name}: {exc.strerror or exc}") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise _Torn(f"{path.name}: unreadable safetensors header") from None
    if 8 + n + end != size:
        raise _Torn(f"{path.name}: {size} bytes, its header describes {8 + n + end} (truncated?)")


def inspect_checkpoint(path: str | Path) -> Entry:
    """Place a checkpoint folder by its content; ``ValueError`` (saying why) when it is not a
    complete one. Reads ``state.json`` and the tensor files' headers only."""
    path = Path(path)
    if not path.is_dir():
        raise _Torn("not a folder")
    state = _read_state(path)
    for name in TENSOR_FILES:
        _check_tensor_file(path / name)
    if (path / TRUE_FILE).exists():
        _check_tensor_file(path / TRUE_FILE)
    return Entry(path, state["round"], state.get("generation", 0))


def load_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    try:
        state = _read_state(path)
    except _Torn as exc:
        raise ValueError(f"{path} is not a complete checkpoint: {exc}") from None
    try:
        params = load_file(str(path / "params.safetensors"))
        opt_tensors = load_file(str(path / "optimizer.safetensors"))
        true = load_file(str(path / TRUE_FILE)) if (path / TRUE_FILE).exists() else None
    except Exception as exc:  # safetensors raises its own error types for torn files
        raise ValueError(f"{path}: unreadable tensors: {exc}") from None
    if true is not None and {n: t.shape for n, t in true.items()} != {
        n: t.shape for n, t in params.items()
    }:
        raise ValueError(f"{path}: {TRUE_FILE} does not hold the parameters of params.safetensors")
    try:
        optimizer_state = _join_optimizer_state(opt_tensors, state["optimizer"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path}: malformed optimizer state in state.json: {exc!r}") from None
    extra = state.get("extra", {})
    return Checkpoint(path, state["round"], params, optimizer_state, extra, true)


def _report(path: Path, why: str) -> None:
    if (str(path), why) not in _REPORTED:
        _REPORTED.add((str(path), why))
        log.warning("skipping %s: %s (left in place, not counted as a checkpoint)", path, why)


def scan(save_dir: str | Path) -> tuple[list[Entry], list[tuple[Path, str]]]:
    """Complete checkpoints in ``save_dir``, newest first by content, and the folders named like
    checkpoints that are not (torn, or foreign: a name this module never writes), each with why.
    Each of the latter is reported once (a warning)."""
    root = Path(save_dir)
    if not root.is_dir():
        return [], []
    complete: list[Entry] = []
    problems: list[tuple[Path, str]] = []
    for path in sorted(root.iterdir()):
        if not path.name.startswith(PREFIX):
            continue
        try:
            if not NAME.match(path.name):
                raise _Torn("foreign: not a round-NNNNNNNNN[.N] name this server writes")
            complete.append(inspect_checkpoint(path))
        except _Torn as exc:
            problems.append((path, str(exc)))
            _report(path, str(exc))
    complete.sort(key=lambda e: e.key, reverse=True)
    return complete, problems


def list_checkpoints(save_dir: str | Path) -> list[Path]:
    """Complete checkpoint folders, oldest first by content (torn ones are left out)."""
    return [e.path for e in reversed(scan(save_dir)[0])]


def _load_newest(save_dir: str | Path) -> tuple[Checkpoint | None, list[tuple[Path, str]]]:
    complete, problems = scan(save_dir)
    for entry in complete:
        try:
            return load_checkpoint(entry.path), problems
        except ValueError as exc:
            problems.append((entry.path, str(exc)))
            _report(entry.path, str(exc))
    return None, problems


def latest_checkpoint(save_dir: str | Path) -> Checkpoint | None:
    """The newest checkpoint that loads; torn ones are skipped with a warning."""
    return _load_newest(save_dir)[0]


def resume_checkpoint(save_dir: str | Path) -> Checkpoint | None:
    """What a server starting on ``save_dir`` resumes from: the newest checkpoint that loads, or
    None when the folder holds no checkpoint folder at all. Raises ``NoLoadableCheckpoint``
    (naming each folder and why) when it holds some and none loads: starting from scratch would
    silently throw a run away."""
    found, problems = _load_newest(save_dir)
    if found is None and problems:
        raise NoLoadableCheckpoint(Path(save_dir), problems)
    return found


# --- writing --------------------------------------------------------------------------------


def _fresh_name(root: Path, round: int) -> tuple[Path, int]:
    """The next generation's folder for ``round``: a name no entry has, torn ones included,
    since renaming onto an existing empty folder would silently replace it."""
    used = [
        int(m.group(2) or 0)
        for m in (NAME.match(p.name) for p in root.iterdir())
        if m and int(m.group(1)) == round
    ]
    generation = max(used) + 1 if used else 0
    suffix = f".{generation}" if generation else ""
    return root / f"round-{round:09d}{suffix}", generation


def _discard(path: Path) -> None:
    """Remove a checkpoint folder; renamed aside first, so a kill mid-way leaves a temporary
    (removed at the next start), never a torn folder under a checkpoint name."""
    trash = Path(tempfile.mkdtemp(prefix=f"{TRASH_PREFIX}{path.name}-", dir=path.parent))
    try:
        os.rename(path, trash / path.name)
    except OSError as exc:
        log.warning("could not remove old checkpoint %s: %s", path, exc)
    shutil.rmtree(trash, ignore_errors=True)


def _prune(root: Path, newest: Path, keep: int) -> None:
    """Keep ``newest`` (just written) and the newest ``keep - 1`` other rounds among complete
    checkpoints; a round's superseded generations go. Torn folders are never touched."""
    complete, _ = scan(root)
    if not any(e.path == newest for e in complete):
        log.error("checkpoint %s just written does not read back; pruning nothing", newest)
        return
    ordered = [e for e in complete if e.path == newest] + [e for e in complete if e.path != newest]
    rounds: set[int] = set()
    for entry in ordered:
        if entry.round not in rounds and len(rounds) < keep:
            rounds.add(entry.round)
        else:
            _discard(entry.path)


def save_checkpoint(
    save_dir: str | Path,
    round: int,
    params: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    extra: dict[str, Any],
    keep: int,
    *,
    true: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write one checkpoint as a transaction (see the module docstring) and prune to ``keep``.
    ``true``: a lossy downlink's true copy of ``params`` (``true.safetensors``)."""
    root = Path(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    opt_tensors, opt_meta = _split_optimizer_state(optimizer_state)
    with _SAVE_LOCK:
        final, generation = _fresh_name(root, round)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{round:09d}-", dir=root))
        try:
            save_file(
                {k: v.contiguous() for k, v in params.items()}, str(tmp / "params.safetensors")
            )
            save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
            names = list(TENSOR_FILES)
            if true is not None:
                save_file({k: v.contiguous() for k, v in true.items()}, str(tmp / TRUE_FILE))
                names.append(TRUE_FILE)
            for name in names:
                _fsync_file(tmp / name)
            state = {
                "format": FORMAT,
                "round": round,
                "generation": generation,
                "optimizer": opt_meta,
                "extra": extra,
            }
            (tmp / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
            _fsync_file(tmp / "state.json")
            _fsync_dir(tmp)
            os.rename(tmp, final)  # the commit: a fresh name, so nothing is replaced
            _fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _prune(root, final, keep)
    return final


def remove_stale_temporaries(save_dir: str | Path) -> None:
    """Clear what interrupted saves and prunes left (the server calls this as it opens its save
    dir). A complete temporary newer than every checkpoint is renamed into place instead: only
    an older version of this module could leave it as the sole copy of a state."""
    root = Path(save_dir)
    if not root.is_dir():
        return
    with _SAVE_LOCK:
        temps = [p for p in root.iterdir() if p.name.startswith((TMP_PREFIX, TRASH_PREFIX))]
        complete, _ = scan(root)
        newest = complete[0].key[:2] if complete else None
        candidates: list[Entry] = []
        for path in temps:
            if path.name.startswith(TMP_PREFIX):
                try:
                    candidates.append(inspect_checkpoint(path))
                except ValueError:
                    pass
        candidates.sort(key=lambda e: e.key, reverse=True)
        if candidates and (newest is None or candidates[0].key[:2] > newest):
            best = candidates[0]
            final, _ = _fresh_name(root, best.round)
            os.rename(best.path, final)
            _fsync_dir(root)
            temps.remove(best.path)
            log.warning(
                "%s held a complete checkpoint of round %d newer than any other; kept as %s",
                best.path.name,
                best.round,
                final,
            )
        for path in temps:
            log.info("removing stale temporary %s", path)
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def merge_states(
    optimizers: list[torch.optim.Optimizer],
) -> tuple[dict[str, Any], list[list[int]]]:
    """One state dict for the optimizers of all units (the server's fragments, or all-reduce mode's) (parameter indices offset, groups
    concatenated), and per unit [parameters, groups] to split it again."""
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    shape: list[list[int]] = []
    offset = 0
    for opt in optimizers:
        sd = opt.state_dict()
        count = sum(len(g["params"]) for g in sd["param_groups"])
        for idx, entry in sd["state"].items():
            state[int(idx) + offset] = entry
        for group in sd["param_groups"]:
            groups.append({**group, "params": [int(i) + offset for i in group["params"]]})
        shape.append([count, len(sd["param_groups"])])
        offset += count
    return {"state": state, "param_groups": groups}, shape


def split_states(merged: dict[str, Any], shape: list[list[int]] | None) -> list[dict[str, Any]]:
    """Inverse of ``merge_states``. No shape: a checkpoint of one optimizer."""
    if shape is None:
        return [merged]
    out = []
    p_off = g_off = 0
    for count, ngroups in shape:
        groups = [
            {**g, "params": [int(i) - p_off for i in g["params"]]}
            for g in merged["param_groups"][g_off : g_off + ngroups]
        ]
        state = {
            int(i) - p_off: v for i, v in merged["state"].items() if p_off <= int(i) < p_off + count
        }
        out.append({"state": state, "param_groups": groups})
        p_off += count
        g_off += ngroups
    return out
