"""Command-line flags read from the config dataclasses' fields.

Each setting is declared once, on its field: the default is the field's, the flag and its
one-line help sit in the field's ``metadata``, and the parsed value goes back into the config
by field name. A field with no ``help`` in its metadata has no flag.

Help comes from metadata, not from the field docstrings: those are gone at run time (reading
them means parsing the source, which an installed wheel need not ship), and they are written
for the Python API, naming fields where ``--help`` must name flags.

Metadata keys (anything else is an error, so a typo does not silently drop a flag):

- ``help``: the one-line help; its presence makes the flag.
- ``flag``: the long option when it is not ``--`` + the field name with dashes (``--init``).
- ``short``: a short option (``-n``).
- ``metavar``, ``choices``: as in argparse.
- ``env``: a variable whose value, when set and not empty, replaces the default
  (``DILOCO_TOKEN``); an empty value means unset, as everywhere ``DILOCO_*`` is read.
- ``switch``: the flag takes no value and sets the field to this (``--async``: ``mode="async"``).
  A ``bool`` field is a switch without it: ``--name`` when its default is False, ``--no-name``
  when it is True, setting the other value.
- ``group``: the title of the ``--help`` section the flag is listed in.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from typing import Any

KEYS = frozenset({"help", "flag", "short", "metavar", "choices", "env", "switch", "group"})


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one config field appears on the command line (read from its metadata)."""

    field: str
    """The field the flag sets; also the argparse ``dest``."""

    names: tuple[str, ...]
    """Option strings, the short one first."""

    help: str
    """One line for ``--help``."""

    kind: type
    """The field's type with ``None`` taken out: ``int``, ``float``, ``str`` or ``bool``."""

    default: Any
    """The field's default."""

    switch: Any = dataclasses.MISSING
    """For a flag without a value, the value it sets; MISSING for a flag that takes one."""

    metavar: str | None = None
    """The value's name in ``--help``; None: the long option's, upper-cased (``KEEP``)."""

    choices: tuple[str, ...] | None = None
    """The values allowed; None: any of ``kind``."""

    env: str | None = None
    """A variable whose value, when set and not empty, is the default."""

    group: str | None = None
    """The ``--help`` section; None: the command's own options."""


def _kind(hint: Any) -> type:
    """``int | None`` -> ``int``; a plain type as is."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"no flag for a union of {rest}")
        hint = rest[0]
    if hint not in (int, float, str, bool):
        raise TypeError(f"no flag for a field of type {hint!r}")
    return typing.cast(type, hint)


def flags(cls: type) -> list[Flag]:
    """The flags of a config dataclass, in field order; fields without ``help`` have none."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta: Mapping[str, Any] = f.metadata
        unknown = set(meta) - KEYS
        if unknown:
            raise TypeError(f"{cls.__name__}.{f.name}: unknown flag metadata {sorted(unknown)}")
        if "help" not in meta:
            continue
        if f.default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: a flag needs a default on the field")
        kind = _kind(hints[f.name])
        switch = meta.get("switch", dataclasses.MISSING)
        if kind is bool and switch is dataclasses.MISSING:
            switch = not f.default
        dashed = f.name.replace("_", "-")
        long = meta.get("flag") or (f"--no-{dashed}" if switch is False else f"--{dashed}")
        choices = meta.get("choices")
        out.append(
            Flag(
                field=f.name,
                names=(meta["short"], long) if "short" in meta else (long,),
                help=meta["help"],
                kind=kind,
                default=f.default,
                switch=switch,
                metavar=meta.get("metavar"),
                choices=tuple(choices) if choices is not None else None,
                env=meta.get("env"),
                group=meta.get("group"),
            )
        )
    return out


def add_flags(parser: argparse.ArgumentParser, cls: type, *, unset: bool = False) -> None:
    """Add a flag for each field of ``cls`` that has one.

    ``unset``: every flag defaults to None, for settings resolved later from other sources
    too (``diloco worker``: the ``DILOCO_*`` variables, then the dataclass); the help then
    names no default, since the dataclass's may not be the one that applies.
    """
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in flags(cls):
        target: Any = parser
        if flag.group is not None:
            if flag.group not in groups:
                groups[flag.group] = parser.add_argument_group(flag.group)
            target = groups[flag.group]
        default = None if unset else flag.default
        if flag.env is not None and not unset:
            default = os.environ.get(flag.env) or default
        help_text = flag.help.replace("%", "%%")
        if flag.env is not None:
            help_text += f" (default: ${flag.env})"
        elif not unset and flag.switch is dataclasses.MISSING and default is not None:
            help_text += f" (default: {default})"
        kwargs: dict[str, Any] = {"dest": flag.field, "default": default, "help": help_text}
        if flag.switch is not dataclasses.MISSING:
            kwargs.update(action="store_const", const=flag.switch)
        else:
            if flag.kind in (int, float):
                kwargs["type"] = flag.kind
            if flag.choices is not None:
                kwargs["choices"] = flag.choices
            if flag.metavar is not None:
                kwargs["metavar"] = flag.metavar
            elif flag.choices is None:
                # Named after the flag (``--keep KEEP``), not the field it sets.
                kwargs["metavar"] = flag.names[-1].lstrip("-").replace("-", "_").upper()
        target.add_argument(*flag.names, **kwargs)


def values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The parsed value of each field of ``cls`` that has a flag, by field name."""
    out = {}
    for flag in flags(cls):
        value = getattr(args, flag.field)
        # An empty token given on the command line means none, as an empty variable does.
        out[flag.field] = None if flag.env is not None and value == "" else value
    return out
