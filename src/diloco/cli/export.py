"""``diloco export``: a checkpoint as a model folder that ``from_pretrained`` opens; its flags are
``ExportConfig``'s fields."""

from __future__ import annotations

import argparse

from diloco.cli import flags
from diloco.export import ExportConfig, export_like


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint as a model folder like the one the run began from",
        description="Copies the original folder's config and tokenizer files and writes "
        "model.safetensors with the checkpoint's parameters under the original names and dtypes.",
    )
    flags.add_flags(p, ExportConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = ExportConfig(**flags.values(ExportConfig, args))
    assert config.checkpoint and config.like and config.out  # ExportConfig checks them
    out = export_like(config.checkpoint, config.like, config.out)
    print(out)
    return 0
