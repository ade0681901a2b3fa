"""Reading checkpoints: one folder, or the newest loadable one of a save dir.

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
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from diloco.persistence.folders import (
    FORMAT,
    NAME,
    PREFIX,
    TENSOR_FILES,
    TRUE_FILE,
    Checkpoint,
    Entry,
    NoLoadableCheckpoint,
    Torn,
    join_optimizer_state,
)

log = logging.getLogger(__name__)

# Torn folders are reported once per process, not at every save.
_REPORTED: set[tuple[str, str]] = set()


def _read_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads((path / "state.json").read_text())
    except OSError as exc:
        raise Torn(f"state.json: {exc.strerror or exc}") from None
    except ValueError:
        raise Torn("state.json is not valid JSON (torn write?)") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise Torn(f"state.json: unknown format {found!r}, expected {FORMAT!r}")
    for key in ("round", "generation"):
        value = state.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise Torn(f"state.json: {key} is {value!r}, not a count")
    if not isinstance(state.get("optimizer"), dict):
        raise Torn("state.json: no optimizer section")
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
                raise Torn(f"{path.name}: truncated ({size} bytes)")
            header = json.loads(fh.read(n))
            end = max(
                (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                default=0,
            )
    except Torn:
        raise
    except OSError as exc:
        raise Torn(f"{path.name}: {exc.strerror or exc}") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise Torn(f"{path.name}: unreadable safetensors header") from None
    if 8 + n + end != size:
        raise Torn(f"{path.name}: {size} bytes, its header describes {8 + n + end} (truncated?)")


def inspect_checkpoint(path: str | Path) -> Entry:
    """Place a checkpoint folder by its content; ``ValueError`` (saying why) when it is not a
    complete one. Reads ``state.json`` and the tensor files' headers only."""
    path = Path(path)
    if not path.is_dir():
        raise Torn("not a folder")
    state = _read_state(path)
    for name in TENSOR_FILES:
        _check_tensor_file(path / name)
    if (path / TRUE_FILE).exists():
        _check_tensor_file(path / TRUE_FILE)
    return Entry(path, state["round"], state.get("generation", 0))


def load_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: no such checkpoint folder")
    try:
        state = _read_state(path)
    except Torn as exc:
        # A folder without this project's state file may be another system's checkpoint (the
        # reference's are pickles, never loaded here): its model weights can still seed a run.
        raise ValueError(
            f"{path} is not a complete diloco checkpoint: {exc} (to start from a model's "
            "weights instead, give them to --init)"
        ) from None
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
        optimizer_state = join_optimizer_state(opt_tensors, state["optimizer"])
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
                raise Torn("foreign: not a round-NNNNNNNNN[.N] name this server writes")
            complete.append(inspect_checkpoint(path))
        except Torn as exc:
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


