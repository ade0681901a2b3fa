"""Safetensors-layout tensor messages, streamed in both directions."""

from diloco.wire.decode import (
    PayloadReader,
    aread_layout,
    aread_payload,
    decode,
    read_layout,
    read_payload,
    readinto_payload,
    tensor_views,
)
from diloco.wire.encode import byte_view, encode, iter_body
from diloco.wire.layout import (
    CODE_OF_DTYPE,
    DTYPE_CODES,
    Layout,
    TensorSpec,
    WireError,
    build_layout,
    check_against,
    parse_header,
    spec_of,
)

__all__ = [
    "CODE_OF_DTYPE",
    "DTYPE_CODES",
    "Layout",
    "TensorSpec",
    "WireError",
    "aread_layout",
    "PayloadReader",
    "aread_payload",
    "build_layout",
    "byte_view",
    "check_against",
    "decode",
    "encode",
    "iter_body",
    "parse_header",
    "read_layout",
    "read_payload",
    "readinto_payload",
    "spec_of",
    "tensor_views",
]
