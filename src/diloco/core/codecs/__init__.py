"""Codecs for pseudo-gradients and published updates: pure tensor maths (issue 18).

``fp32`` and ``bf16`` (plain), ``int8`` and ``int4`` (blockwise absmax, bf16 scales), ``lowrank``
(PowerSGD with warm start), ``topk`` (chunked top-k, few-bit values); ``ErrorFeedback`` for the
lossy ones on the worker. Every encoded tensor is a list of wire tensors (``Part``s) that travel
in one safetensors body; ``Encoded`` holds one as a value the server's running sum adds chunk by
chunk. See docs/design/codecs.md.
"""

from diloco.core.accumulate import accumulate_
from diloco.core.codecs.base import (
    CHUNK,
    SEP,
    Codec,
    CodecError,
    Part,
    Workspace,
    check_name,
    wire_names,
)
from diloco.core.codecs.by_name import (
    CODECS,
    FOUR_BIT,
    codec_by_name,
    codec_from_metadata,
    codec_metadata,
    codec_names,
    decode_named,
    encode_named,
    from_wire,
    to_wire,
)
from diloco.core.codecs.elementwise import Bf16Codec, BlockCodec, Fp32Codec
from diloco.core.codecs.encoded import Encoded
from diloco.core.codecs.error_feedback import ErrorFeedback
from diloco.core.codecs.fourbit import GROUP, Fp4Codec, Int4Codec
from diloco.core.codecs.lowrank import LowRankCodec
from diloco.core.codecs.quant import AbsmaxQuantizer, Int8Codec
from diloco.core.codecs.topk import TopKCodec

__all__ = [
    "CHUNK",
    "CODECS",
    "FOUR_BIT",
    "GROUP",
    "SEP",
    "AbsmaxQuantizer",
    "Bf16Codec",
    "BlockCodec",
    "Codec",
    "CodecError",
    "Encoded",
    "ErrorFeedback",
    "Fp32Codec",
    "Fp4Codec",
    "Int4Codec",
    "Int8Codec",
    "LowRankCodec",
    "Part",
    "TopKCodec",
    "Workspace",
    "accumulate_",
    "check_name",
    "codec_by_name",
    "codec_from_metadata",
    "codec_metadata",
    "codec_names",
    "decode_named",
    "encode_named",
    "from_wire",
    "to_wire",
    "wire_names",
]
