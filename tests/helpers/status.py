"""The typed status: a fresh status, and the check that a JSON value has exactly the fields of
its dataclass."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from diloco.server.config import ServerConfig
from diloco.server.paramserver.coordinator import Coordinator
from tests.helpers.clock import FakeClock


def assert_keys(cls: type, value: Any, where: str = "status") -> None:
    """``value`` (JSON) has exactly the fields of dataclass ``cls``, in order, at every level;
    a field omitted while ``None`` may be absent."""
    assert isinstance(value, dict), where
    names = [f.name for f in dataclasses.fields(cls)]
    optional = {f.name for f in dataclasses.fields(cls) if f.metadata.get("omit_when_none")}
    assert list(value) == [n for n in names if n in value], f"{where}: keys out of field order"
    assert set(value) <= set(names), f"{where}: keys without a field: {set(value) - set(names)}"
    assert set(names) - set(value) <= optional, f"{where}: missing {set(names) - set(value)}"
    hints = typing.get_type_hints(cls)
    for name, item in value.items():
        target = hints[name]
        if isinstance(target, types.UnionType):  # X | None
            (target,) = [a for a in typing.get_args(target) if a is not type(None)]
        if typing.get_origin(target) is tuple and isinstance(item, list):
            (element, _) = typing.get_args(target)
            if dataclasses.is_dataclass(element):
                for i, e in enumerate(item):
                    assert_keys(element, e, f"{where}.{name}[{i}]")  # type: ignore[arg-type]
        elif dataclasses.is_dataclass(target) and item is not None:
            assert_keys(target, item, f"{where}.{name}")  # type: ignore[arg-type]


def fresh() -> dict[str, Any]:
    """The status of a server that has no parameters and no workers yet."""
    return Coordinator(ServerConfig(port=0), None, clock=FakeClock()).status().to_json()
