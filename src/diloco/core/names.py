"""Parameter names as they travel: the model's own, without the prefixes wrappers add.

Wrapping a model changes its parameter names, not its parameters: DDP and ``DataParallel`` put
``module.`` in front, ``torch.compile`` puts ``_orig_mod.``, FSDP (the original one) puts
``_fsdp_wrapped_module.`` before each wrapped submodule's names and activation checkpointing
``_checkpoint_wrapped_module.``. The server and the checkpoints know the names without them
(the *wire names*), so a DDP machine, a compiled one and a plain one share one run, and a
checkpoint loads into the bare model.

``_orig_mod``, ``_fsdp_wrapped_module`` and ``_checkpoint_wrapped_module`` are taken out wherever
they stand (FSDP and checkpointing wrap submodules deep in a model, ``torch.compile`` may compile
one). ``module`` is an ordinary attribute name as well, so it is taken out only where a wrapper
puts it: at the front of the name, or right after another wrapper's component
(``_orig_mod.module.``, DDP of a compiled model's inside).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")

#: Components that only wrappers make: removed wherever they stand.
WRAPPER_ONLY = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
#: DDP's and ``DataParallel``'s component: removed at the front or after another wrapper's.
DDP = "module"


def wire_name(name: str) -> str:
    """``name`` without the components wrappers add (``module._orig_mod.fc.weight`` ->
    ``fc.weight``). A name made only of wrapper components is kept as it is: it names nothing
    else."""
    kept: list[str] = []
    after_wrapper = True  # the front of the name counts as right after a wrapper
    for part in name.split("."):
        if part in WRAPPER_ONLY or (part == DDP and after_wrapper):
            after_wrapper = True
            continue
        kept.append(part)
        after_wrapper = False
    return ".".join(kept) if kept else name


def wire_names(named: Iterable[tuple[str, T]]) -> dict[str, T]:
    """``{wire name: item}`` of ``(name, item)`` pairs, in their order. Two names that become one
    are a ``ValueError`` naming both: their parameters could not be told apart on the wire."""
    out: dict[str, T] = {}
    source: dict[str, str] = {}
    for name, item in named:
        wire = wire_name(name)
        if wire in source:
            raise ValueError(
                f"parameters {source[wire]!r} and {name!r} both become {wire!r} once the "
                "wrapper prefixes (module., _orig_mod., _fsdp_wrapped_module., "
                "_checkpoint_wrapped_module.) are taken out; rename one of them"
            )
        source[wire] = name
        out[wire] = item
    return out
