"""The JSON mapping every message class shares, and how a body is checked against its class.

Writing (``Message.to_json``): a field is a key, in field order; a tuple is a list; a nested
message is an object; a field declared ``spec(omit=True)`` is left out while it equals its
default (keys that one mode or one case has and the other lacks).

Reading (``Message.from_json``) checks every value against its field's type, and against its
``Rule`` when it has one, and names the field in the error (``MessageError``, a 400 on the
server): a ``Request`` is read strictly (an unknown key is an error: a typo never passes for a
no-op), a ``Reply`` tolerantly (unknown keys are ignored, so a newer server that adds fields
does not break an older worker). Either way a missing key takes its field's default, and a
missing key without one is an error. JSON numbers: an integer field takes an integer only (not
a boolean, not 2.0), a number field any finite number (read as a float).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, Self, TypeVar, Union, get_args, get_origin, get_type_hints

from diloco.wire.layout import WireError

T = TypeVar("T")

_RULE = "rule"
_OMIT = "omit"


class MessageError(WireError):
    """A body that does not fit its message class. ``field`` names the key (dotted inside a
    nested object: ``info.num_fragments``; ``[i]`` for a list's item); ``code`` is
    ``bad_field`` unless the class reads a body whose errors have codes of their own (an
    upload's metadata: ``missing_metadata``, ``bad_metadata``)."""

    def __init__(self, field: str, detail: str, code: str = "bad_field") -> None:
        super().__init__(code, detail, 400)
        self.field = field


@dataclass(frozen=True)
class Rule:
    """What a value must be beyond its type: ``ok(value)`` for a value of the right type, said
    as ``says`` in an error ("an integer >= 0")."""

    says: str
    ok: Callable[[Any], bool]


def at_least(low: float, what: str = "an integer") -> Rule:
    return Rule(f"{what} >= {low:g}", lambda v: v >= low)


def text(limit: int = 256, *, empty: bool = False) -> Rule:
    """A string of at most ``limit`` characters (and not empty, unless ``empty``)."""
    says = f"a {'' if empty else 'non-empty '}string of at most {limit} characters"
    return Rule(says, lambda v: len(v) <= limit and (empty or bool(v)))


def one_of(choices: Iterable[str]) -> Rule:
    allowed = tuple(choices)
    return Rule(f"one of {', '.join(map(repr, allowed))}", lambda v: v in allowed)


def spec(
    *,
    default: Any = MISSING,
    factory: Callable[[], Any] | Any = MISSING,
    rule: Rule | None = None,
    omit: bool = False,
) -> Any:
    """A message field: its ``default`` (or ``factory``; none: the key is required), its
    ``rule``, and whether it is left out of the JSON while it equals its default (``omit``)."""
    meta = {_RULE: rule, _OMIT: omit}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


class Message:
    """A JSON body of the protocol: a frozen dataclass (every subclass is one) written and
    read by this module."""

    STRICT: ClassVar[bool] = False
    """Unknown keys are an error (requests) or ignored (replies)."""

    def to_json(self) -> dict[str, Any]:
        """The JSON-able dict of this message."""
        return _write(self)

    @classmethod
    def from_json(cls, data: object) -> Self:
        """Read a decoded JSON body; ``MessageError`` naming the first field that does not
        fit."""
        return _read(cls, data, "", cls.STRICT)

    def checked(self) -> Self:
        """Rules between fields, run after every field was read: raise ``MessageError``, or
        return the message (normalized where the class says so)."""
        return self


class Request(Message):
    """A body a worker (or an operator) sends: read strictly."""

    STRICT = True


class Reply(Message):
    """A body the server answers with: read tolerantly."""

    STRICT = False


# --- writing ------------------------------------------------------------------------------------


def _write(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f, _ in _fields(type(message)):
        value = getattr(message, f.name)
        if f.metadata.get(_OMIT) and value == _default(f):
            continue
        out[f.name] = _out(value)
    return out


def _out(value: Any) -> Any:
    if isinstance(value, Message):
        return _write(value)
    if isinstance(value, tuple | list):
        return [_out(v) for v in value]
    if isinstance(value, dict):
        return {k: _out(v) for k, v in value.items()}
    return value


def _default(f: Field[Any]) -> Any:
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


# --- reading ------------------------------------------------------------------------------------


class _Bad(Exception):
    """A value (or an item of it) is not of its field's type: the field says what it must be."""


_FIELDS: dict[type, list[tuple[Field[Any], Any]]] = {}


def _fields(cls: type) -> list[tuple[Field[Any], Any]]:
    """A message class's fields with their resolved types (kept: classes do not change)."""
    known = _FIELDS.get(cls)
    if known is None:
        hints = get_type_hints(cls)
        known = _FIELDS[cls] = [(f, hints[f.name]) for f in fields(cls)]
    return known


def _read(cls: type[T], data: object, prefix: str, strict: bool) -> T:
    if not isinstance(data, dict):
        where = prefix[:-1]
        what = repr(where) if where else "the body"
        raise MessageError(where, f"{what} must be a JSON object")
    known = _fields(cls)
    if strict:
        names = [f.name for f, _ in known]
        unknown = [k for k in data if k not in names]
        if unknown:
            raise MessageError(
                prefix + str(unknown[0]),
                f"unknown field {prefix + str(unknown[0])!r}; {cls.__name__} takes "
                f"{', '.join(names) or 'no field'}",
            )
    values: dict[str, Any] = {}
    for f, hint in known:
        name = prefix + f.name
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise MessageError(name, f"missing field {name!r}")
            continue
        rule: Rule | None = f.metadata.get(_RULE)
        try:
            value = _value(hint, data[f.name], name, strict)
            if rule is not None and value is not None and not rule.ok(value):
                raise _Bad
        except _Bad:
            says = rule.says if rule is not None else _phrase(hint)
            raise MessageError(name, f"{name!r} must be {says}") from None
        values[f.name] = value
    message = cls(**values)
    return message.checked() if isinstance(message, Message) else message


def _value(hint: Any, value: object, name: str, strict: bool) -> Any:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        args = get_args(hint)
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _value(hint, value, name, strict)
    if isinstance(hint, type) and is_dataclass(hint):
        if not isinstance(value, dict):
            raise _Bad
        return _read(hint, value, name + ".", strict)
    if origin is tuple:
        if not isinstance(value, list):
            raise _Bad
        args = get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_value(args[0], v, f"{name}[{i}]", strict) for i, v in enumerate(value))
        if len(value) != len(args):
            raise _Bad
        return tuple(
            _value(a, v, f"{name}[{i}]", strict)
            for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
    if origin is dict:
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise _Bad
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise _Bad
        return value
    if isinstance(value, bool) or hint not in (int, float, str):
        raise _Bad
    if hint is int and isinstance(value, int):
        return value
    if hint is float and isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    raise _Bad


_PHRASES = {bool: "a boolean", int: "an integer", float: "a finite number", str: "a string"}


def _phrase(hint: Any) -> str:
    """What a value of ``hint`` is, for an error."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in get_args(hint) if a is not type(None)]
        return f"{_phrase(inner)} or null"
    if origin is tuple:
        args = get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list, each {_phrase(args[0])}"
        return f"a list [{', '.join(_phrase(a) for a in args)}]"
    if origin is dict:
        return "an object of strings"
    if isinstance(hint, type) and is_dataclass(hint):
        return "a JSON object"
    return _PHRASES.get(hint, str(hint))
