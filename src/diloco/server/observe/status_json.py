"""The JSON mapping of the status records (``status.py``, ``records.py``): a dataclass field is
a key, in field order; a tuple is a list; a field marked ``OMIT`` is left out while it is
``None``. Reading is lenient where versions differ (unknown keys are ignored) and strict where
a reader would otherwise show a blank (a missing field raises ``StatusFormatError``)."""

from __future__ import annotations

import types
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from diloco.server.observe.records import OMIT

T = TypeVar("T")


class StatusFormatError(ValueError):
    """A /status document lacks a field this version reads (a renamed key, an older server)."""


def to_json(value: Any) -> Any:
    """``value`` (a record, a tuple of them, or a plain value) as JSON-able data."""
    if is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: to_json(getattr(value, f.name))
            for f in fields(value)
            if not (f.metadata.get(OMIT) and getattr(value, f.name) is None)
        }
    if isinstance(value, tuple):
        return [to_json(v) for v in value]
    return value


def from_json(cls: type[T], data: object, where: str) -> T:
    """A record of type ``cls`` from ``data``; ``where`` names it in errors."""
    if not isinstance(data, dict):
        raise StatusFormatError(f"{where}: expected an object, got {type(data).__name__}")
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name in data:
            values[f.name] = _value(hints[f.name], data[f.name], f"{where}.{f.name}")
        elif f.metadata.get(OMIT):
            values[f.name] = None
        elif f.default is MISSING:
            raise StatusFormatError(f"{where}: no field {f.name!r} (a server of another version?)")
    return cls(**values)


def _value(hint: Any, value: object, where: str) -> Any:
    if get_origin(hint) in (Union, types.UnionType):
        if value is None:
            return None
        (hint,) = [a for a in get_args(hint) if a is not type(None)]
    if is_dataclass(hint):
        return from_json(hint, value, where)  # type: ignore[arg-type]
    if get_origin(hint) is tuple:
        if not isinstance(value, list):
            raise StatusFormatError(f"{where}: expected a list, got {type(value).__name__}")
        (item, _) = get_args(hint)
        return tuple(_value(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    return value
