"""What an upload's body holds: raw pseudo-gradients (fp32 or bf16 per tensor, the protocol before
codecs) or one codec's parts per tensor (issue 18; docs/design.md, "Codecs", server side).

The body's ``__metadata__`` names its codec (``codec``, ``codec_<option>``; none or ``raw``: raw
tensors). Its header is checked against the unit's table before any payload byte is read: for a
codec, each tensor of the unit must arrive as exactly the parts ``codec.parts(shape)`` lists (wire
name = name + suffix, dtype, shape), in any payload order. Once the body has landed its values
are checked (finite; a codec's scales and factors, ``Codec.check_part``), and it becomes the
entries the unit's running sum adds: the received tensors themselves, or ``Encoded`` values that
decode a chunk at a time inside the add (``Codec.add_into``), so no upload is decoded whole.

A codec whose only part is the tensor itself in a floating dtype (``fp32``, ``bf16``) carries
plain values: such a body is handled exactly as a raw one (the round's first upload may be
written into the sum as it arrives). Every other codec's body goes through an upload slot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from diloco.core.accumulate import Entry, WeightedSum
from diloco.core.codecs import Codec, CodecError, Encoded
from diloco.server.errors import ApiError, bad_request
from diloco.server.members.codec_choice import RAW, RAW_NAMES, codec_refused, parse_codec
from diloco.wire import Layout, WireError, check_against

UPLOAD_DTYPES = ("F32", "BF16")
"""dtypes of a raw upload's tensors."""


@dataclass(frozen=True)
class UploadBody:
    """How one upload's payload is to be read: checked from its header by ``read``."""

    codec: Codec | None
    """None: raw tensors, each F32 or BF16."""
    name: str
    """The codec's name; for a raw body its dtypes' (``fp32``, ``bf16``, ``fp32+bf16``)."""
    plain: bool
    """The body's tensors are the values themselves, named like the unit's tensors."""

    @classmethod
    def read(
        cls,
        layout: Layout,
        table: Mapping[str, tuple[int, ...]],
        allowed: Sequence[str],
    ) -> UploadBody:
        """Check ``layout`` (a header, no payload yet) against the unit's ``table`` and the
        codecs this server ``allowed``. ``WireError``/``ApiError`` 400 for a mismatch (naming
        the tensor and what was expected), 422 ``codec_refused``."""
        meta = layout.metadata
        # "raw": what every client before the codecs wrote (or no codec key at all).
        raw = meta.get("codec", RAW) == RAW
        if raw and not any(k.startswith("codec_") for k in meta):
            check_against(layout, table, UPLOAD_DTYPES)
            names = sorted({RAW_NAMES[s.dtype] for s in layout.specs})
            for name in names:
                if name not in allowed:
                    raise codec_refused(name, allowed)
            return cls(None, "+".join(names), True)
        codec = parse_codec(meta)
        if codec.name not in allowed:
            raise codec_refused(codec.name, allowed)
        return cls(codec, codec.name, _check_parts(layout, table, codec))

    def entries(
        self, views: Mapping[str, torch.Tensor], table: Mapping[str, tuple[int, ...]]
    ) -> list[Entry]:
        """What the running sum adds, one entry per tensor of ``table`` in its order, from the
        landed body's tensor views (no copy)."""
        if self.plain:
            return [views[name] for name in table]
        assert self.codec is not None
        codec = self.codec
        return [
            Encoded.of(codec, [views[name + p.suffix] for p in codec.parts(shape)], shape)
            for name, shape in table.items()
        ]

    def check(self, names: Sequence[str], entries: Sequence[Entry]) -> None:
        """Blocking: raise ``ApiError`` unless every value may count: 422 ``non_finite`` for NaN
        or an infinity (or a scale that decodes past fp32), 400 ``bad_scale`` for a negative
        scale. Reads only what can be bad (all of a plain body; a codec's scales and factors)."""
        for name, entry in zip(names, entries, strict=True):
            if isinstance(entry, torch.Tensor):
                if _non_finite(entry):
                    raise ApiError(
                        422, "non_finite", f"pseudo-gradient {name!r} has NaN or infinite values"
                    )
                continue
            assert isinstance(entry, Encoded)
            for k, part in enumerate(entry.parts):
                try:
                    entry.codec.check_part(entry.shape, k, part)
                except CodecError as exc:
                    status = 422 if exc.code == "non_finite" else 400
                    raise ApiError(status, exc.code, f"parameter {name!r}: {exc.detail}") from None

    def add(
        self,
        wsum: WeightedSum,
        layout: Layout,
        names: Sequence[str],
        entries: Sequence[Entry],
        weight: float,
        report: Callable[[int], None],
    ) -> Callable[[], None]:
        """The add of the landed body to ``wsum`` (blocking, to run on the tensor lock), in the
        order of the payload's bytes, calling ``report(n)`` whenever the payload's first ``n``
        bytes will not be read again, so the receive buffer refills behind the add."""
        offsets = {
            spec.name: (begin, spec.itemsize)
            for spec, (begin, _) in zip(layout.specs, layout.offsets, strict=True)
        }
        if self.plain:
            # Raw values are added a chunk at a time: report within each tensor.
            index = {name: i for i, name in enumerate(names)}
            order = [index[spec.name] for spec in layout.specs]
            begins = [offsets[name] for name in names]

            def on_chunk(i: int, end: int) -> None:
                begin, itemsize = begins[i]
                report(begin + end * itemsize)

            return lambda: wsum.add(entries, weight, order=order, on_piece=on_chunk)
        # An encoded tensor is read whole by its add (its scales, then its codes), and its parts
        # may lie anywhere in the payload: take the tensors in the order of their first part, so
        # that after each one the bytes below the next one's first part are free.
        firsts = []
        for name, entry in zip(names, entries, strict=True):
            assert isinstance(entry, Encoded)
            suffixes = [p.suffix for p in entry.codec.parts(entry.shape)]
            firsts.append(min(offsets[name + s][0] for s in suffixes))
        order = sorted(range(len(names)), key=firsts.__getitem__)
        free_after = {i: layout.payload_size for i in order}
        for here, after in zip(order, order[1:], strict=False):
            free_after[here] = firsts[after]
        return lambda: wsum.add(
            entries, weight, order=order, on_piece=lambda i, _end: report(free_after[i])
        )


def _check_parts(layout: Layout, table: Mapping[str, tuple[int, ...]], codec: Codec) -> bool:
    """Raise 400 unless ``layout`` holds exactly ``codec``'s parts of every tensor of ``table``
    (names, dtypes, shapes); return whether the codec carries plain values for every tensor."""
    specs = {spec.name: spec for spec in layout.specs}
    expected: dict[str, str] = {}  # wire name -> the tensor whose part it is
    plain = True
    for name, shape in table.items():
        parts = codec.parts(shape)
        for part in parts:
            wire = name + part.suffix
            if wire in expected:  # a tensor named like another's part ("w@scale")
                raise bad_request(
                    "bad_name", f"tensor {wire!r} is ambiguous under codec {codec.name}"
                )
            expected[wire] = name
        (first, *rest) = parts
        plain = plain and not rest and first.suffix == "" and first.dtype.is_floating_point
        plain = plain and tuple(first.shape) == tuple(shape)
    for spec in layout.specs:
        if spec.name not in expected:
            raise WireError(
                "unknown_tensor",
                f"tensor {spec.name!r} is neither a parameter of the global model nor a part of "
                f"one under codec {codec.name}",
            )
    missing = [wire for wire in expected if wire not in specs]
    if missing:
        raise WireError(
            "missing_tensor",
            f"{len(missing)} tensor(s) missing from the {codec.name} body, first {missing[0]!r} "
            f"(a part of parameter {expected[missing[0]]!r})",
        )
    for name, shape in table.items():
        got = [specs[name + p.suffix] for p in codec.parts(shape)]
        try:
            codec.check_layout(shape, [(s.torch_dtype, s.shape) for s in got])
        except CodecError as exc:  # bad_dtype, bad_shape (bad_parts cannot happen: names match)
            raise bad_request(exc.code, f"parameter {name!r}: {exc.detail}") from None
    return plain


def _non_finite(t: torch.Tensor) -> bool:
    # NaN propagates into the minimum and maximum and an infinity is one of them, so aminmax sees
    # both without a boolean tensor as large as the upload (about 20x faster than isfinite).
    if not t.is_floating_point() or not t.numel():
        return False
    low, high = torch.aminmax(t)
    return not (bool(torch.isfinite(low)) and bool(torch.isfinite(high)))


def first_non_finite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """Name of the first tensor holding NaN or an infinity."""
    return next((name for name, t in tensors.items() if _non_finite(t)), None)
