"""Writing checkpoints as transactions.

Layout of one checkpoint, ``<save_dir>/round-000000012/`` (``round-000000012.N/`` when round 12
was saved again, N = 1, 2, ...):
- ``params.safetensors``: the global parameters by wire name, each tied tensor once (loads into
  a model, wrapped or tied, with ``diloco.load_into``);
- ``optimizer.safetensors``: the outer optimizer's tensor state, keyed ``<param index>/<key>``;
- ``true.safetensors``, only with a lossy download codec: the outer step's true copy of the
  parameters (``params.safetensors`` then holds the published ones, what the workers hold);
- ``state.json``: round, generation, optimizer param groups and scalars, counters. Written last.

Order and pruning go by content, never by folder name: (round, generation) from ``state.json``. A
folder named like a checkpoint counts only when complete (``state.json`` of this format, each
tensor file as long as its header says); a torn or foreign one is reported, skipped, never counted
toward ``keep`` and never deleted (it is the operator's to look at). Pruning keeps the checkpoint
just written and the newest ``keep - 1`` other rounds; a folder being removed is first renamed to
``.old-round-*``, so a kill mid-removal leaves no half-deleted folder under a checkpoint name.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from diloco.persistence.folders import (
    FORMAT,
    NAME,
    TENSOR_FILES,
    TMP_PREFIX,
    TRASH_PREFIX,
    TRUE_FILE,
    Entry,
    fsync_dir,
    fsync_file,
    split_optimizer_state,
)
from diloco.persistence.lazy_tensors import LazyTensors, write_lazy
from diloco.persistence.reading import inspect_checkpoint, scan

log = logging.getLogger(__name__)

# Saves come from the event loop's worker threads; picking a fresh name and pruning must not
# interleave between two of them.
_SAVE_LOCK = threading.Lock()


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
    params: dict[str, torch.Tensor] | LazyTensors,
    optimizer_state: dict[str, Any],
    extra: dict[str, Any],
    keep: int,
    *,
    true: dict[str, torch.Tensor] | None = None,
    optimizer_tensors: LazyTensors | None = None,
) -> Path:
    """Write one checkpoint as a transaction (see the module docstring) and prune to ``keep``.
    ``true``: a lossy downlink's true copy of ``params`` (``true.safetensors``).
    ``params`` may be ``LazyTensors`` (written one tensor at a time), and so may the optimizer's
    tensor state (``optimizer_tensors``, keyed ``<param index>/<key>``: it replaces the tensors
    of ``optimizer_state``, whose param groups and scalars are kept)."""
    root = Path(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    opt_tensors, opt_meta = split_optimizer_state(optimizer_state)
    with _SAVE_LOCK:
        final, generation = _fresh_name(root, round)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{round:09d}-", dir=root))
        try:
            _save(params, tmp / "params.safetensors")
            _save(
                opt_tensors if optimizer_tensors is None else optimizer_tensors,
                tmp / "optimizer.safetensors",
            )
            names = list(TENSOR_FILES)
            if true is not None:
                save_file({k: v.contiguous() for k, v in true.items()}, str(tmp / TRUE_FILE))
                names.append(TRUE_FILE)
            for name in names:
                fsync_file(tmp / name)
            state = {
                "format": FORMAT,
                "round": round,
                "generation": generation,
                "optimizer": opt_meta,
                "extra": extra,
            }
            (tmp / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
            fsync_file(tmp / "state.json")
            fsync_dir(tmp)
            os.rename(tmp, final)  # the commit: a fresh name, so nothing is replaced
            fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _prune(root, final, keep)
    return final


def _save(tensors: dict[str, torch.Tensor] | LazyTensors, path: Path) -> None:
    if isinstance(tensors, LazyTensors):
        write_lazy(tensors, path)
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


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
            fsync_dir(root)
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

