"""Where a lossy round's time goes (issue 30 item 5): each codec step of one sync round, timed
in one process with the library's own code, side by side with the bf16/fp32 round's steps.

The sync-round benchmark's model (``--params``, 2048-wide square layers), a snapshot and a
perturbed local model, one torch thread (a benchmark worker's). Per configuration ``UP/DOWN``
(``bf16/fp32``, ``int4/int4``, ``topk/int4``, ...), the steps a round takes, in order:

- ``worker body``: ``UploadEncoder.model_upload()`` and every part ``produce`` yields (the
  pseudo-gradient, the compensation ``g + e``, the encoding into the reused host buffer);
- ``worker commit``: ``Upload.commit`` (error feedback's residual update once counted);
- ``server check``: ``check_part`` of every part (what the server does before adding);
- ``server add``: ``WeightedSum.add`` of the body as the round's first upload;
- ``server downlink``: ``encode_update`` of every parameter and the payload's checksum, as
  ``Downlink.encode`` does them (lossy downlink only; with ``fp32`` the checksum runs beside the
  downloads, off the round's path);
- ``worker apply``: ``apply_update`` into the snapshot and its checksum, as ``UpdateBuffer.apply``
  does them (lossy downlink only).

The two downlink steps mirror what the library under test does (a workspace and the checksum
beside the work where it has them), so a run with ``PYTHONPATH`` on an older ``src/`` measures
the code before.

Not timed here: the outer step (the same for every codec) and the bytes on the wire (the
sync-round benchmark's job). Each step is the median of ``--repeats`` turns, the steps taking
turns. ``--profile`` adds cProfile's top functions of one lossy round.

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.codecs.round_cost --comm bf16/fp32 int4/int4 topk/int4
    .venv/bin/python -m benchmarks.codecs.round_cost --smoke
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import importlib
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from benchmarks.harness import smoke
from benchmarks.harness.report import machine_info, print_table
from diloco.core.accumulate import WeightedSum
from diloco.core.codecs import BlockCodec, Encoded
from diloco.core.codecs.downlink import apply_update, encode_update
from diloco.wire import byte_view
from diloco.wire.checksum import checksum
from diloco.worker.settings import parse_codec
from diloco.worker.state.encoder import UploadEncoder, comm_dtype
from diloco.worker.state.local_model import LocalModel

STEPS = (
    "worker body",
    "worker commit",
    "server check",
    "server add",
    "server downlink",
    "worker apply",
)


def _optional(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


Workspace = _optional("diloco.core.workspace", "Workspace")
checksum_behind = _optional("diloco.wire.checksum", "checksum_behind")


def _views(payload: torch.Tensor, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, at = {}, 0
    for name, p in like.items():
        out[name] = payload[at : at + p.numel()].view(p.shape)
        at += p.numel()
    return out


def _end(t: torch.Tensor, payload: torch.Tensor) -> int:
    """Byte offset in ``payload`` where view ``t`` ends."""
    return t.data_ptr() - payload.data_ptr() + t.numel() * t.element_size()


def _checksum(payload: torch.Tensor, work: Iterator[int]) -> None:
    """The library's checksum of a payload finished by ``work``: beside it where the code under
    test does that (``checksum_behind``), after it otherwise."""
    if checksum_behind is not None:
        checksum_behind(byte_view(payload), work)
        return
    for _ in work:
        pass
    checksum([byte_view(payload)])


def _timed(it: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
    """A generator's items, copied, and the seconds its ``next`` calls took."""
    out: list[torch.Tensor] = []
    spent = 0.0
    items = iter(it)
    while True:
        start = time.perf_counter()
        try:
            t = next(items)
        except StopIteration:
            return out, spent
        spent += time.perf_counter() - start
        out.append(t.clone())


def build_model(params: float, width: int = 2048) -> torch.nn.Module:
    layers = max(1, round(params / (width * width)))
    if params < width * width:
        width = max(64, int((params / layers) ** 0.5))
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


class Round:
    """One configuration's steps on one model, as closures that can run again and again."""

    def __init__(self, model: torch.nn.Module, up: str, down: str) -> None:
        self.codec = parse_codec(up)
        parsed = None if down == "fp32" else parse_codec(down)
        assert parsed is None or isinstance(parsed, BlockCodec)
        self.down: BlockCodec | None = parsed
        metrics: dict[str, float] = {}
        self.local = LocalModel(model, comm_dtype(self.codec), metrics)
        gen = torch.Generator().manual_seed(1)
        params = self.local.params
        # The snapshot and the published parameters as views of one payload each, as the
        # worker's snapshot and the server's ParamStore hold them (their checksums read those).
        self.snap_payload = torch.cat([p.detach().reshape(-1) for p in params.values()])
        self.snap_payload.add_(torch.randn(self.snap_payload.shape, generator=gen), alpha=1e-3)
        self.local.snapshot = _views(self.snap_payload, params)
        self.enc = UploadEncoder(self.codec, self.local, metrics)
        self.sent: dict[str, list[torch.Tensor]] = {}
        self.upload = self.enc.model_upload()
        self.sum = WeightedSum([p.shape for p in params.values()])
        self.true = {n: s + 1e-4 for n, s in self.local.snapshot.items()}
        self.pub_payload = self.snap_payload.clone()
        self.published = _views(self.pub_payload, params)
        self.update: dict[str, list[torch.Tensor]] = {}
        # What the library under test has (a before/after run may predate them): the server's
        # downlink and a worker's update buffer each keep a Workspace and checksum beside the work.
        self.server_work = None if Workspace is None else Workspace()
        self.worker_work = None if Workspace is None else Workspace()

    def body(self) -> float:
        """Seconds in the library's calls (the copies kept for the server's steps are not
        timed: a real body goes on the wire from the same buffers)."""
        spent = 0.0
        start = time.perf_counter()
        self.upload = self.enc.model_upload()
        spent += time.perf_counter() - start
        for spec in self.upload.specs:
            start = time.perf_counter()
            got = self.upload.produce(spec)
            spent += time.perf_counter() - start
            if isinstance(got, torch.Tensor):
                chunks = [got]
            else:  # bf16's pieces, computed as the body streams them
                chunks, more = _timed(got)
                spent += more
            kept = self.sent.get(spec.name)
            flat = torch.cat([c.reshape(-1) for c in chunks])
            self.sent[spec.name] = [kept[0].copy_(flat) if kept else flat]
        return spent

    def commit(self) -> None:
        self.upload.commit()

    def _parts(self, name: str, p: torch.Tensor) -> list[torch.Tensor]:
        return [self.sent[name + part.suffix][0] for part in self.codec.parts(p.shape)]

    def check(self) -> None:
        for name, p in self.local.params.items():
            for i, t in enumerate(self._parts(name, p)):
                self.codec.check_part(p.shape, i, t)

    def add(self) -> None:
        """A round's first upload into the server's running sum (``WeightedSum``)."""
        entries: list[Any] = []
        for name, p in self.local.params.items():
            parts = self._parts(name, p)
            if self.enc.raw:
                entries.append(parts[0].view(self.codec.parts(p.shape)[0].dtype).view(p.shape))
            else:
                entries.append(Encoded.of(self.codec, parts, tuple(p.shape)))
        self.sum.reset()
        self.sum.add(entries, 1.0)

    def downlink(self) -> None:
        """``Downlink.encode``: every parameter's update, then the published payload's checksum."""
        if self.down is None:
            return
        down, work = self.down, self.server_work

        def encoded() -> Iterator[int]:
            for name, t in self.true.items():
                pub = self.published[name]
                args = () if work is None else (None, work)
                self.update[name] = encode_update(down, t, pub, *args)
                yield _end(pub, self.pub_payload)

        _checksum(self.pub_payload, encoded())

    def apply(self) -> None:
        """``UpdateBuffer.apply``: every parameter's update, then the snapshot's checksum."""
        if self.down is None:
            return
        down, work = self.down, self.worker_work

        def applied() -> Iterator[int]:
            for name, parts in self.update.items():
                snap = self.local.snapshot[name]
                apply_update(down, snap, parts, *(() if work is None else (work,)))
                yield _end(snap, self.snap_payload)

        _checksum(self.snap_payload, applied())

    def steps(self) -> dict[str, Callable[[], float | None]]:
        return dict(
            zip(
                STEPS,
                (self.body, self.commit, self.check, self.add, self.downlink, self.apply),
                strict=True,
            )
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6, help="parameters (default 100e6)")
    ap.add_argument("--comm", nargs="+", default=["bf16/fp32", "int4/int4", "topk/int4"])
    ap.add_argument("--repeats", type=int, default=3, help="timed turns per step (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--profile", action="store_true", help="cProfile one round of each lossy one")
    smoke.add_flag(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.params, args.repeats = 3e5, 1
    torch.set_num_threads(args.threads)
    rounds = {}
    for comm in args.comm:
        up, _, down = comm.partition("/")
        rounds[comm] = Round(build_model(args.params), up, down)
    times: dict[tuple[str, str], list[float]] = {}
    for r in rounds.values():  # warm-up: first touches, the residual's first allocation
        for fn in r.steps().values():
            fn()
    for _ in range(args.repeats):
        for comm, r in rounds.items():
            for step, fn in r.steps().items():
                start = time.perf_counter()
                spent = fn()
                took = time.perf_counter() - start if spent is None else spent
                times.setdefault((comm, step), []).append(took)
    med = {k: statistics.median(v) for k, v in times.items()}
    info = machine_info()
    n = sum(p.numel() for p in next(iter(rounds.values())).local.params.values())
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  {' '.join(sys.argv)}")
    print(
        f"{n / 1e6:.1f}M parameters, {args.threads} torch thread(s), median of {args.repeats}; "
        f"torch {torch.__version__}; {info['cpu']} ({info['nproc']} cores)\n"
    )
    head = ["step"] + [f"{c} ms" for c in rounds]
    rows = [[s] + [f"{med[(c, s)] * 1e3:.1f}" for c in rounds] for s in STEPS]
    totals = {c: sum(med[(c, s)] for s in STEPS) for c in rounds}
    rows.append(["total"] + [f"{totals[c] * 1e3:.1f}" for c in rounds])
    print_table(head, rows)
    if args.profile:
        for comm, r in rounds.items():
            if not r.codec.lossy or comm.startswith("bf16"):
                continue
            prof = cProfile.Profile()
            prof.enable()
            for fn in r.steps().values():
                fn()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
            print(f"\ncProfile, one round of {comm} (tottime):")
            print("\n".join(out.getvalue().splitlines()[6:26]))
    if args.smoke:
        smoke.require(all(0 <= v < 60 for v in med.values()), f"sane times: {med}")
        smoke.require(all(t > 0 for t in totals.values()), "every round took time")
        smoke.passed("codecs.round_cost")
    return 0


if __name__ == "__main__":
    sys.exit(main())
