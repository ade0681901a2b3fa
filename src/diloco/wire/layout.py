"""The safetensors layout of every tensor message, and its validation.

A body is ``u64 little-endian header length | JSON header | raw bytes``. The header maps each
tensor name to ``{"dtype", "shape", "data_offsets"}`` and may carry ``__metadata__`` (string
pairs). Any safetensors reader opens a body written here; bodies read here are checked field by
field because they come from the network.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("diloco's wire format writes host memory as little-endian bytes")

#: safetensors dtype codes for the dtypes the project sends.
DTYPE_CODES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
CODE_OF_DTYPE: dict[torch.dtype, str] = {v: k for k, v in DTYPE_CODES.items()}

#: Upper bound on a header; generous for models with tens of thousands of tensors.
MAX_HEADER_BYTES = 16 * 1024 * 1024
PREFIX = struct.Struct("<Q")


class WireError(ValueError):
    """A body that does not match the expected layout. ``code`` is machine-readable."""

    def __init__(self, code: str, detail: str, status: int = 400) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.status = status


@dataclass(frozen=True)
class TensorSpec:
    """Name, safetensors dtype code and shape of one tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=DTYPE_CODES[self.dtype]).element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPE_CODES[self.dtype]


@dataclass(frozen=True)
class Layout:
    """A parsed or built header: the tensors in payload order and their byte ranges."""

    specs: tuple[TensorSpec, ...]
    offsets: tuple[tuple[int, int], ...]
    metadata: Mapping[str, str]
    header: bytes  # the full prefix: 8-byte length plus the JSON header

    @property
    def payload_size(self) -> int:
        return self.offsets[-1][1] if self.offsets else 0

    @property
    def total_size(self) -> int:
        return len(self.header) + self.payload_size

    def names(self) -> list[str]:
        return [s.name for s in self.specs]


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    code = CODE_OF_DTYPE.get(tensor.dtype)
    if code is None:
        raise WireError("bad_dtype", f"tensor {name!r} has unsupported dtype {tensor.dtype}")
    return TensorSpec(name, code, tuple(int(d) for d in tensor.shape))


def build_layout(
    specs: Sequence[TensorSpec],
    metadata: Mapping[str, str] | None = None,
    *,
    ordered: bool = False,
) -> Layout:
    """Lay tensors out back to back and encode the header.

    Wider dtypes go first (stable within a width), as the reference writer does, so that every
    tensor starts aligned and a reader can view it in place. ``ordered`` keeps the given order
    instead: a codec's body carries each tensor's parts together, scales before codes, so a
    worker encodes one tensor at a time (a reader copies a tensor that lands unaligned).
    """
    if not ordered:
        specs = sorted(specs, key=lambda s: -s.itemsize)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offsets: list[tuple[int, int]] = []
    pos = 0
    for spec in specs:
        if spec.name == "__metadata__" or spec.name in header:
            raise WireError("bad_name", f"tensor name {spec.name!r} is reserved or repeated")
        end = pos + spec.nbytes
        header[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [pos, end],
        }
        offsets.append((pos, end))
        pos = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    # Pad with spaces to 8 bytes, as the reference writer does, so fp32/fp64 data lands aligned.
    raw += b" " * (-len(raw) % 8)
    return Layout(tuple(specs), tuple(offsets), dict(metadata or {}), PREFIX.pack(len(raw)) + raw)


def header_length(prefix: bytes, max_header: int = MAX_HEADER_BYTES) -> int:
    """Decode and bound the 8-byte length prefix."""
    if len(prefix) != PREFIX.size:
        raise WireError("truncated", "body ended inside the 8-byte header length")
    (n,) = PREFIX.unpack(prefix)
    if n < 2:
        raise WireError("bad_header", f"header length {n} is too small for a JSON object")
    if n > max_header:
        raise WireError(
            "header_too_large", f"header length {n} exceeds the limit of {max_header} bytes", 413
        )
    return n


def _as_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WireError("bad_header", f"{what} must be a non-negative integer, got {value!r}")
    return value


def parse_header(raw: bytes) -> Layout:
    """Parse a JSON header (without its length prefix) into a Layout, checking its structure.

    Checks: a JSON object; string metadata; known dtypes; integer shapes; offsets that match the
    shape's byte size and tile the payload from 0 with no gap or overlap.
    """
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, huge integers, deep nesting
        raise WireError("bad_header", f"header is not valid UTF-8 JSON: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise WireError("bad_header", "header must be a JSON object")
    meta = obj.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise WireError("bad_header", "__metadata__ must map strings to strings")
    entries: list[tuple[int, int, TensorSpec]] = []
    for name, entry in obj.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise WireError(
                "bad_header", f"entry {name!r} must have exactly dtype, shape and data_offsets"
            )
        dtype = entry["dtype"]
        if not isinstance(dtype, str) or dtype not in DTYPE_CODES:
            raise WireError("bad_dtype", f"tensor {name!r} has unsupported dtype {dtype!r}")
        shape, offs = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not isinstance(offs, list) or len(offs) != 2:
            raise WireError(
                "bad_header", f"tensor {name!r}: shape must be a list and data_offsets a pair"
            )
        spec = TensorSpec(name, dtype, tuple(_as_int(d, f"{name!r} shape") for d in shape))
        begin, end = (_as_int(o, f"{name!r} data_offsets") for o in offs)
        if end - begin != spec.nbytes:
            raise WireError(
                "bad_header",
                f"tensor {name!r}: data_offsets span {end - begin} bytes, shape needs {spec.nbytes}",
            )
        entries.append((begin, end, spec))
    entries.sort(key=lambda e: (e[0], e[1]))
    pos = 0
    for begin, _end, spec in entries:
        if begin != pos:
            raise WireError(
                "bad_header",
                f"tensor {spec.name!r} starts at {begin}, expected {pos} (gap or overlap)",
            )
        pos = _end
    header = PREFIX.pack(len(raw)) + raw
    return Layout(tuple(e[2] for e in entries), tuple((e[0], e[1]) for e in entries), meta, header)


def check_against(
    layout: Layout,
    table: Mapping[str, tuple[int, ...]],
    allowed_dtypes: Iterable[str],
    *,
    require_all: bool = True,
) -> None:
    """Check every tensor's name, shape and dtype against the server's parameter table.

    The error names the offending tensor and what was expected, so a user can see which model
    or option is mismatched.
    """
    allowed = set(allowed_dtypes)
    seen = set()
    for spec in layout.specs:
        expected = table.get(spec.name)
        if expected is None:
            raise WireError(
                "unknown_tensor", f"tensor {spec.name!r} is not a parameter of the global model"
            )
        if spec.shape != tuple(expected):
            raise WireError(
                "shape_mismatch",
                f"tensor {spec.name!r} has shape {list(spec.shape)}, expected {list(expected)}",
            )
        if spec.dtype not in allowed:
            raise WireError(
                "dtype_mismatch",
                f"tensor {spec.name!r} has dtype {spec.dtype}, expected one of {sorted(allowed)}",
            )
        seen.add(spec.name)
    if require_all and len(seen) != len(table):
        missing = [n for n in table if n not in seen]
        raise WireError(
            "missing_tensor",
            f"{len(missing)} parameter(s) missing from the body, first {missing[0]!r}",
        )
