"""Checkpoint folders for the persistence tests: a save dir that nothing can load."""

from __future__ import annotations

from pathlib import Path


def unloadable_save_dir(tmp_path: Path) -> Path:
    save_dir = tmp_path / "ckpt"
    (save_dir / "round-000000003").mkdir(parents=True)  # no state.json
    bad = save_dir / "round-000000004"
    bad.mkdir()
    (bad / "state.json").write_text("{not json")
    (save_dir / "round-4-backup").mkdir()  # foreign
    return save_dir
