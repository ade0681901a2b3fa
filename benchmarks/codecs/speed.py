"""Speed of the codecs (src/diloco/core/codecs) on one core, beside the plain fp32 -> bf16 cast.

The issue's target (issue 18): encode and decode of a 100M-parameter pseudo-gradient on one core,
side by side with the plain conversion of the same tensors in the same run: int8 and 4-bit each
at most 3x that conversion's time.

The model is the sync-round benchmark's (``harness.model.choose_shape``: 24 bias-free
2048 x 2048 layers for 100M), its pseudo-gradient Gaussian (the codecs' speed does not depend on
the values). Every operation runs over all tensors; the operations take turns, ``--repeats``
times, and each row is the median (so a drift in the machine's speed hits every row alike).

- cast: ``bf16.copy_(fp32)`` into a preallocated tensor (the reference: the worker's scratch
  conversion today), and ``fp32.to(bf16)``, which also allocates (page faults included).
- encode: into preallocated parts (``encode_piece(t, out)``), as a worker that reuses its buffers;
  low rank: ``encode(t, name)``, whose outputs are tiny.
- +feedback: ``ErrorFeedback.encode_piece``: compensate, encode, subtract the decoded value from
  the residual (a worker's whole step; the residual is preallocated).
- add_into: accumulate into a preallocated fp32 sum with weight 0.5 (the server's decode).
- downlink (``core/codecs/downlink.py``): ``encode_update`` (the server's side of a published
  update: ``true - published`` encoded and added to ``published``), ``apply_update`` (a replica's
  side) and the CRC-32 ``checksum`` of the parameters' bytes, beside SHA-256 of the same bytes.

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.codecs.speed                 # 100M parameters, 5 repeats
    .venv/bin/python -m benchmarks.codecs.speed --params 10e6   # quicker
    .venv/bin/python -m benchmarks.codecs.speed --smoke         # 100k parameters, once
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from benchmarks.harness import smoke
from benchmarks.harness.model import choose_shape
from benchmarks.harness.report import machine_info, print_table
from diloco.core.codecs import (
    Bf16Codec,
    BlockCodec,
    Codec,
    ErrorFeedback,
    Fp4Codec,
    Int4Codec,
    Int8Codec,
    LowRankCodec,
)
from diloco.core.codecs.downlink import apply_update, encode_update
from diloco.wire.checksum import checksum


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def build_ops(tensors: list[torch.Tensor], rank: int) -> dict[str, Callable[[], object]]:
    names = [f"layer{i}.weight" for i in range(len(tensors))]
    bf16 = [torch.empty_like(t, dtype=torch.bfloat16) for t in tensors]
    acc = [torch.zeros_like(t) for t in tensors]
    ops: dict[str, Callable[[], object]] = {
        "fp32 -> bf16 cast (preallocated)": lambda: [
            o.copy_(t) for o, t in zip(bf16, tensors, strict=True)
        ],
        "fp32 -> bf16 cast (.to, allocating)": lambda: [t.to(torch.bfloat16) for t in tensors],
        "bf16 add_into (today's server)": lambda: [
            Bf16Codec().add_into(a, [b], 0.5) for a, b in zip(acc, bf16, strict=True)
        ],
    }
    codecs: list[Codec] = [Int8Codec(), Int4Codec(), Fp4Codec(), LowRankCodec(rank=rank)]
    for codec in codecs:
        label = codec.name if not isinstance(codec, LowRankCodec) else f"lowrank r={rank}"
        parts: list[list[torch.Tensor]]
        if isinstance(codec, BlockCodec):
            outs = [codec.empty_parts(t.numel(), t.device) for t in tensors]
            ops[f"{label} encode"] = _encode_pieces(codec, tensors, outs)
            feedback = ErrorFeedback()
            for name, t in zip(names, tensors, strict=True):
                feedback.residuals[name] = torch.zeros_like(t)
            ops[f"{label} encode +feedback"] = partial(
                _encode_with_feedback, codec, feedback, names, tensors, outs
            )
            parts = outs
        else:
            parts = [codec.encode(t, n) for n, t in zip(names, tensors, strict=True)]
            ops[f"{label} encode"] = partial(_encode_all, codec, names, tensors)
        ops[f"{label} add_into"] = partial(_add_all, codec, acc, parts)
    views = [memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B") for t in tensors]  # type: ignore[arg-type]
    ops["checksum (CRC-32)"] = lambda: checksum(views)
    ops["sha256 (for comparison)"] = lambda: [hashlib.sha256(v).digest() for v in views]
    published = [t * 0.999 for t in tensors]  # a replica a step behind
    for block_codec in (Int8Codec(), Int4Codec()):
        outs = [block_codec.empty_parts(t.numel(), t.device) for t in tensors]
        ops[f"{block_codec.name} downlink encode_update"] = partial(
            _encode_updates, block_codec, tensors, published, outs
        )
        ops[f"{block_codec.name} downlink apply_update"] = partial(
            _apply_updates, block_codec, published, outs
        )
    return ops


def _encode_with_feedback(
    codec: BlockCodec,
    feedback: ErrorFeedback,
    names: list[str],
    tensors: list[torch.Tensor],
    outs: list[list[torch.Tensor]],
) -> object:
    return [
        feedback.encode_piece(codec, n, t.shape, 0, t.view(-1), out)
        for n, t, out in zip(names, tensors, outs, strict=True)
    ]


def _encode_all(codec: Codec, names: list[str], tensors: list[torch.Tensor]) -> object:
    return [codec.encode(t, n) for n, t in zip(names, tensors, strict=True)]


def _add_all(codec: Codec, acc: list[torch.Tensor], parts: list[list[torch.Tensor]]) -> None:
    for a, ps in zip(acc, parts, strict=True):
        codec.add_into(a, ps, 0.5)


def _encode_updates(
    codec: BlockCodec,
    tensors: list[torch.Tensor],
    published: list[torch.Tensor],
    outs: list[list[torch.Tensor]],
) -> object:
    return [
        encode_update(codec, t, p, out) for t, p, out in zip(tensors, published, outs, strict=True)
    ]


def _apply_updates(
    codec: BlockCodec, published: list[torch.Tensor], outs: list[list[torch.Tensor]]
) -> object:
    return [apply_update(codec, p, out) for p, out in zip(published, outs, strict=True)]


def _encode_pieces(
    codec: BlockCodec, tensors: list[torch.Tensor], outs: list[list[torch.Tensor]]
) -> Callable[[], object]:
    return lambda: [codec.encode_piece(t.view(-1), o) for t, o in zip(tensors, outs, strict=True)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6, help="model size (default 100e6)")
    ap.add_argument("--max-dim", type=int, default=2048, help="widest square layer (default 2048)")
    ap.add_argument("--repeats", type=int, default=5, help="timed turns per operation (default 5)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--rank", type=int, default=4, help="low-rank codec's rank (default 4)")
    smoke.add_flag(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.params, args.repeats = 1e5, 1
    torch.set_num_threads(args.threads)
    shape = choose_shape(args.params, args.max_dim)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape.dim, shape.dim, generator=gen) * 1e-3 for _ in range(shape.layers)]
    ops = build_ops(tensors, args.rank)
    for fn in ops.values():  # warm-up: first touches, allocator
        fn()
    times: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(args.repeats):
        for key, fn in ops.items():
            times[key].append(timed(fn))
    median = {k: statistics.median(v) for k, v in times.items()}
    ref = median["fp32 -> bf16 cast (preallocated)"]
    alloc = median["fp32 -> bf16 cast (.to, allocating)"]
    info = machine_info()
    print(f"{datetime.date.today()}  {' '.join(sys.argv)}")
    print(
        f"{shape.layers} x {shape.dim}x{shape.dim} = {shape.numel / 1e6:.1f}M parameters, "
        f"{args.threads} torch thread(s), median of {args.repeats}; torch {torch.__version__}; "
        f"{info['cpu']} ({info['nproc']} cores)\n"
    )
    rows = [
        [
            key,
            f"{median[key] * 1e3:.1f}",
            f"{min(times[key]) * 1e3:.1f}",
            f"{median[key] / ref:.2f}x",
            f"{median[key] / alloc:.2f}x",
        ]
        for key in ops
    ]
    print_table(["operation", "median ms", "min ms", "vs cast", "vs .to(bf16)"], rows)
    if args.smoke:
        smoke.require(len(median) == len(ops), "every operation was timed")
        smoke.require(all(0 < t < 60 for t in median.values()), f"sane times: {median}")
        smoke.passed("codecs.speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
