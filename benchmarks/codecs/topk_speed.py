"""Speed of the sparse top-k codec (issue 30 item 1) beside int4 and bf16, in one run.

One flat fp32 tensor of ``--params`` elements (a Gaussian pseudo-gradient: top-k's speed does not
depend much on the values, only on k and the chunk), on ``--threads`` torch threads:

- encode: into preallocated parts (``encode_piece(t, out)``), as a worker reusing its buffers;
  bf16's is the cast into a preallocated tensor;
- add_into: accumulate into a preallocated fp32 sum with weight 0.5 (the server's decode);
- +feedback (topk): ``ErrorFeedback.encode_piece``, a worker's whole step (compensate, encode,
  subtract what was sent from the residual).

Operations take turns ``--repeats`` times and each row is the median. Also printed: each codec's
bytes per element.

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.codecs.topk_speed              # 100M elements, 3 repeats
    .venv/bin/python -m benchmarks.codecs.topk_speed --smoke      # 100k elements, once
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from benchmarks.harness import smoke
from benchmarks.harness.report import machine_info, print_table
from diloco.core.codecs import Bf16Codec, BlockCodec, ErrorFeedback, Int4Codec, TopKCodec


def build_ops(t: torch.Tensor, topk: TopKCodec) -> tuple[dict[str, Callable[[], object]], dict]:
    n = t.numel()
    acc = torch.zeros(n)
    ops: dict[str, Callable[[], object]] = {}
    sizes: dict[str, float] = {}
    codecs: list[tuple[str, BlockCodec]] = [("bf16", Bf16Codec()), ("int4", Int4Codec())]
    codecs.append((f"topk d={topk.density} c={topk.chunk} b={topk.bits}", topk))
    for label, codec in codecs:
        out = codec.empty_parts(n, t.device)
        ops[f"{label} encode"] = partial(codec.encode_piece, t, out)
        codec.encode_piece(t, out)
        ops[f"{label} add_into"] = partial(codec.add_piece_into, acc, out, 0.5, False)
        sizes[label] = codec.nbytes((n,)) / n
    feedback = ErrorFeedback()
    feedback.residuals["t"] = torch.zeros(n)
    out = topk.empty_parts(n, t.device)
    ops["topk encode +feedback"] = lambda: feedback.encode_piece(topk, "t", (n,), 0, t, out)
    return ops, sizes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6, help="elements (default 100e6)")
    ap.add_argument("--repeats", type=int, default=3, help="timed turns per operation")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--density", type=float, default=0.0156)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--bits", type=int, default=2)
    smoke.add_flag(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.params, args.repeats = 1e5, 1
    torch.set_num_threads(args.threads)
    t = torch.randn(int(args.params), generator=torch.Generator().manual_seed(0)) * 1e-3
    ops, sizes = build_ops(t, TopKCodec(args.density, args.chunk, args.bits))
    times: dict[str, list[float]] = {k: [] for k in ops}
    for fn in ops.values():  # warm-up: first touches, allocator
        fn()
    for _ in range(args.repeats):
        for key, fn in ops.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    median = {k: statistics.median(v) for k, v in times.items()}
    info = machine_info()
    print(f"{datetime.date.today()}  {' '.join(sys.argv)}")
    print(
        f"{t.numel() / 1e6:.1f}M fp32 elements, {args.threads} torch thread(s), median of "
        f"{args.repeats}; torch {torch.__version__}; {info['cpu']} ({info['nproc']} cores)\n"
    )
    ref = median["bf16 encode"]
    rows = [[k, f"{median[k] * 1e3:.1f}", f"{median[k] / ref:.2f}x"] for k in ops]
    print_table(["operation", "median ms", "vs bf16 encode"], rows)
    print()
    print_table(
        ["codec", "bytes/element", "x below fp32"],
        [[k, f"{v:.4f}", f"{4 / v:.1f}x"] for k, v in sizes.items()],
    )
    if args.smoke:
        smoke.require(all(0 < v < 60 for v in median.values()), f"sane times: {median}")
        topk_bytes = [v for k, v in sizes.items() if k.startswith("topk")][0]
        smoke.require(4 / topk_bytes >= 50, f"topk at least 50x below fp32: {sizes}")
        smoke.passed("codecs.topk_speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
