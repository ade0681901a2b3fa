"""Relative error ``||g - decode(encode(g))|| / ||g||`` of the codecs, and their bytes per element.

Three kinds of pseudo-gradient-like data:

- ``gauss``: 2**20 standard normal values;
- ``t3``: 2**20 Student-t values with 3 degrees of freedom (heavy tails: blocks with outliers);
- ``demo``: a real one: the demo model (src/diloco/demo/model.py, 137k parameters) trained with
  AdamW (lr 3e-3, batch 16 x 64) for 50 steps, then ``global - local`` over the next 50 steps,
  per tensor (vectors and matrices as they are).

Also measured, not registered: ``fp4`` (E2M1 grid, src/diloco/core/codecs/fourbit.py) and a
reference E3M0 grid (sign and a power of two ``2**-6 .. 2**0`` of the block's absmax, or 0;
the 4-bit format of Streaming DiLoCo's outer gradients), computed here in plain torch.

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.codecs.error
    .venv/bin/python -m benchmarks.codecs.error --smoke   # 2**14 values, 5 demo steps
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from collections.abc import Callable

import torch

from benchmarks.harness import smoke
from benchmarks.harness.report import print_table
from diloco.core.codecs import Bf16Codec, Codec, Fp4Codec, Int4Codec, Int8Codec, LowRankCodec

Data = dict[str, torch.Tensor]


def demo_pseudo_gradient(steps: int = 50, seed: int = 0) -> Data:
    from diloco.demo.data import build_corpus, sample_batch
    from diloco.demo.model import build_model, loss_on

    corpus = build_corpus(1)
    model = build_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)

    def train() -> None:
        for _ in range(steps):
            x, y = sample_batch(corpus.train, 16, 64, gen)
            opt.zero_grad()
            loss_on(model, x, y).backward()
            opt.step()

    train()  # a second round is more typical than the first, from the initialisation
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    train()
    return {k: start[k] - v.detach() for k, v in model.named_parameters()}


def e3m0(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Round to the nearest of ``0, +-2**-6 .. +-2**0`` times the block's absmax."""
    grid = torch.tensor([0.0] + [2.0**e for e in range(-6, 1)])
    flat = x.reshape(-1)
    pad = -flat.numel() % block
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, block)
    amax = blocks.abs().amax(1, keepdim=True)
    y = blocks / torch.where(amax > 0, amax, 1.0)
    mag = grid[torch.bucketize(y.abs(), (grid[1:] + grid[:-1]) / 2)]
    return (torch.sign(y) * mag * amax).reshape(-1)[: flat.numel()].view_as(x)


def _e3m0_of(block: int) -> Callable[[str, torch.Tensor], torch.Tensor]:
    return lambda _name, t: e3m0(t, block)


def rel_error(decode: Callable[[str, torch.Tensor], torch.Tensor], data: Data) -> float:
    num = sum(float((decode(k, v) - v).pow(2).sum()) for k, v in data.items())
    den = sum(float(v.pow(2).sum()) for v in data.values())
    return math.sqrt(num / den)


def through(codec: Codec) -> Callable[[str, torch.Tensor], torch.Tensor]:
    return lambda name, t: codec.decode(codec.encode(t, name), t.shape)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    smoke.add_flag(ap)
    args = ap.parse_args(argv)
    torch.manual_seed(0)  # StudentT samples from the global generator
    gen = torch.Generator().manual_seed(0)
    n = 1 << 14 if args.smoke else 1 << 20
    datasets: dict[str, Data] = {
        "gauss": {"g": torch.randn(n, generator=gen)},
        "t3": {"g": torch.distributions.StudentT(3.0).sample((n,))},
        "demo": demo_pseudo_gradient(steps=5 if args.smoke else 50),
    }
    demo = datasets["demo"]
    demo_n = sum(v.numel() for v in demo.values())
    rows: list[tuple[str, Callable[[str, torch.Tensor], torch.Tensor], float]] = [
        ("bf16", through(Bf16Codec()), 2.0)
    ]
    for block in (32, 64, 128, 256):
        rows.append((f"int8, block {block}", through(Int8Codec(block)), 1 + 2 / block))
    for block in (32, 64, 128):
        rows.append((f"int4, block {block}", through(Int4Codec(block)), 0.5 + 2 / block))
        rows.append((f"fp4 (E2M1), block {block}", through(Fp4Codec(block)), 0.5 + 2 / block))
        rows.append((f"E3M0 (reference), block {block}", _e3m0_of(block), 0.5 + 2 / block))
    low = LowRankCodec(rank=4)
    low_bytes = sum(low.nbytes(v.shape) for v in demo.values()) / demo_n
    rows.append(("lowrank r=4 (one round, demo only)", through(low), low_bytes))
    print(f"{datetime.date.today()}  {' '.join(sys.argv)}; torch {torch.__version__}\n")
    table = []
    for label, fn, nbytes in rows:
        errs = [
            "-" if label.startswith("lowrank") and k != "demo" else f"{rel_error(fn, d):.4f}"
            for k, d in datasets.items()
        ]
        table.append([label, f"{nbytes:.3f}", *errs])
    print_table(["codec", "bytes/element", *datasets], table)
    if args.smoke:
        gauss = {row[0]: float(row[2]) for row in table if row[2] != "-"}
        smoke.require(all(0 <= e < 1.5 for e in gauss.values()), f"relative errors: {gauss}")
        smoke.require(
            gauss["bf16"] < gauss["int8, block 64"] < gauss["int4, block 64"],
            "more bits, less error",
        )
        smoke.passed("codecs.error")
    return 0


if __name__ == "__main__":
    sys.exit(main())
