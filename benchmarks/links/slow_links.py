"""Synchronous rounds when every worker sits behind its own slow link, for 1, 2, ... upload slots
and for one or more ways of putting the bytes on the wire (``--comm UP/DOWN``).

The loopback benchmark (``sync_round.py``) measures CPU overhead: on loopback the bytes move at
memory speed. Real workers reach the server over links of their own (a 1 Gbit office line, a
cloud region's egress), often slower than the server's. Then what matters is how many uploads
the server takes in at once: it receives an upload whole into a receive buffer before any of it
counts, and with one buffer (``upload_slots=1``, the default: memory flat in N) the uploads of a
round arrive one after the other, each at one link's speed.

Here each worker reaches the server through a shaping proxy (a child process, token buckets of
``--rate`` MB/s per worker and direction, shared by all of that worker's connections: its link;
``shaped_links.py``). The server and the workers run in this process (threads; torch releases
the GIL in its kernels and the links, not the CPU, set the pace). For each ``--comm`` config and
slot count a fresh server is started and the round time is compared with the wire time: the
same bytes through the same proxies with plain sockets (N clients upload, then each gets its
download), measured beside the rounds.

``--comm UP/DOWN``: the workers' codec (``DiLoCoWorker(codec=UP)``: fp32, bf16, int8, int4,
lowrank:R) and the server's download codec (``ServerConfig(download_codec=DOWN)``: fp32, bf16,
int8, int4; anything but fp32 publishes each round as a compressed update). ``bf16/fp32`` is
what a worker sends and gets by default. The bytes the wire time moves are each config's own,
read from the workers' ``sync_metrics`` after a measured round (``last_bytes_up`` and
``last_bytes_down``: safetensors headers and payloads) and checked against the payload the model
and the codecs give. A compressed config moves fewer bytes, so the CPU work that a slow wire
hides for bf16/fp32 (encoding, the server's decode-add, step and downlink encode, the workers'
apply) shows: each row's phases, timed around the library's calls, say where the time goes.

    .venv/bin/python benchmarks/slow_links.py --params 25e6 --workers 4 --rate 50 --slots 1 2 4
    .venv/bin/python benchmarks/slow_links.py --slots 4 --comm bf16/fp32 int8/int8 int4/int8

MB = 10**6 bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import inspect
import json
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from shaped_links import CHUNK, MB, Bucket, Links, raw_round, raw_rounds

__all__ = [
    "CHUNK",
    "MB",
    "BASELINE",
    "Bucket",
    "Links",
    "PhaseClock",
    "build_model",
    "diloco_rounds",
    "expected_bytes",
    "main",
    "parse_comm",
    "raw_round",
    "raw_rounds",
]

BASELINE = "bf16/fp32"
"""What a worker sends (bf16 pseudo-gradients) and gets (fp32 parameters) by default."""
SIZE_TOLERANCE = 0.05
"""Measured bytes (headers included) may exceed the model's payload by this fraction."""


# --- where the time goes: wall time of the library's calls, by thread --------------------------

# (module, class, method, phase). Worker threads are named ``link-<i>``; every other thread is
# the server's. Nested phases overlap: ``encode`` is inside ``upload``, ``apply`` inside
# ``fetch``, ``fetch`` inside ``refresh``, ``downlink_encode`` inside ``close``.
PHASE_TARGETS = [
    ("diloco.worker.plain", "PlainSync", "upload", "upload"),
    ("diloco.worker.encoder", "_ModelBody", "encode", "encode"),
    ("diloco.worker.local_model", "LocalModel", "produce", "encode"),
    ("diloco.worker.encoder", "_ModelBody", "commit", "commit"),
    ("diloco.worker.local_model", "LocalModel", "refresh", "refresh"),
    ("diloco.worker.session", "Session", "fetch", "fetch"),
    ("diloco.worker.local_model", "LocalModel", "apply_update", "apply"),
    ("diloco.core.accumulate", "WeightedSum", "add", "server_add"),
    ("diloco.core.accumulate", "WeightedSum", "write_first", "server_add"),
    ("diloco.server.sync_aggregator", "SyncAggregator", "close", "close"),
    ("diloco.server.downlink", "Downlink", "encode", "downlink_encode"),
]


class PhaseClock:
    """Wraps the methods of ``PHASE_TARGETS`` while installed, recording ``(thread, phase, start,
    end)`` of every call (a generator's time is that of its ``next`` calls: ``LocalModel.produce``
    computes bf16 pieces as the upload streams them). A target missing from the library is
    skipped and named in ``missing``."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, float, float]] = []
        self.missing: list[str] = []
        self._saved: list[tuple[type, str, Any]] = []

    def _note(self, phase: str, t0: float) -> None:
        self.events.append((threading.current_thread().name, phase, t0, time.monotonic()))

    def _wrap(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        clock = self

        def timed_iter(it: Iterator[Any]) -> Iterator[Any]:
            while True:
                t0 = time.monotonic()
                try:
                    item = next(it)
                except StopIteration:
                    clock._note(phase, t0)
                    return
                clock._note(phase, t0)
                yield item

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                t0 = time.monotonic()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    clock._note(phase, t0)

            return run_async

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            try:
                out = fn(*args, **kwargs)
            finally:
                clock._note(phase, t0)
            return timed_iter(out) if inspect.isgenerator(out) else out

        return run

    def __enter__(self) -> PhaseClock:
        for module, cls_name, method, phase in PHASE_TARGETS:
            cls = getattr(importlib.import_module(module), cls_name, None)
            fn = None if cls is None else cls.__dict__.get(method)
            if fn is None:
                self.missing.append(f"{module}.{cls_name}.{method}")
                continue
            self._saved.append((cls, method, fn))
            setattr(cls, method, self._wrap(fn, phase))
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, method, fn in reversed(self._saved):
            setattr(cls, method, fn)
        self._saved.clear()

    def round_phases(self, start: float, end: float, workers: list[str]) -> dict[str, float]:
        """One round's phases (calls that began in ``[start, end]``), in seconds: worker phases
        the most any worker spent in them, server phases summed; ``*_at`` are offsets from
        ``start`` (the last upload answered, the server's round close ended)."""
        evs = [e for e in self.events if start <= e[2] <= end]
        out: dict[str, float] = {}

        def per_worker(phase: str) -> float:
            return max(
                (sum(b - a for th, ph, a, b in evs if th == w and ph == phase) for w in workers),
                default=0.0,
            )

        for phase in ("encode", "upload", "commit", "refresh", "fetch", "apply"):
            out[phase] = per_worker(phase)
        mine = set(workers)
        for phase in ("server_add", "close", "downlink_encode"):
            out[phase] = sum(b - a for th, ph, a, b in evs if th not in mine and ph == phase)
        uploads = [b for th, ph, _, b in evs if ph == "upload" and th in mine]
        closes = [b for th, ph, _, b in evs if ph == "close" and th not in mine]
        out["uploads_done_at"] = max(uploads) - start if uploads else math.nan
        out["close_done_at"] = max(closes) - start if closes else math.nan
        out["after_close"] = end - max(closes) if closes else math.nan
        return out


# --- DiLoCo rounds ----------------------------------------------------------------------------


def build_model(params: float) -> Any:
    import torch

    dim = 1024
    layers = max(1, round(params / (dim * dim)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)])


def parse_comm(spec: str) -> tuple[str, str]:
    """``UP/DOWN`` (``int8/int8``): the worker codec and the server's download codec."""
    up, sep, down = spec.partition("/")
    if not sep or not up.strip() or not down.strip() or "/" in down:
        raise argparse.ArgumentTypeError(f"expected UP/DOWN (like bf16/fp32), got {spec!r}")
    return up.strip(), down.strip()


def expected_bytes(params: float, up: str, down: str) -> tuple[int, int]:
    """Payload bytes one worker sends and gets per round with codec ``up`` and download codec
    ``down``, from the model's shapes and the codecs' parts (no headers)."""
    from diloco.core.codecs import codec_by_name
    from diloco.worker.settings import parse_codec

    shapes = [tuple(p.shape) for p in build_model(params).parameters()]

    def nbytes(codec: Any) -> int:
        return sum(part.numel * part.dtype.itemsize for s in shapes for part in codec.parts(s))

    return nbytes(parse_codec(up)), nbytes(codec_by_name(down))


def diloco_rounds(
    links: Links,
    params: float,
    slots: int,
    rounds: int,
    *,
    codec: str = "bf16",
    download_codec: str = "fp32",
    clock: PhaseClock | None = None,
) -> dict[str, Any]:
    """``rounds`` measured synchronous rounds (after one warm-up) of ``len(links.ports)`` workers
    behind ``links``, with worker codec ``codec`` and server download codec ``download_codec``.
    ``round_s``: each round's wall time (first worker in to last worker out); ``up``/``down``:
    the most bytes one worker sent/got in the last round (``sync_metrics``); ``phases``: each
    round's ``PhaseClock.round_phases`` when ``clock`` is installed."""
    import torch

    from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig

    n = len(links.ports)
    initial = {name: p.detach().clone() for name, p in build_model(params).named_parameters()}
    server = DiLoCoServer(
        ServerConfig(
            port=0,
            num_workers=n,
            upload_slots=slots,
            heartbeat_timeout=0,
            download_codec=download_codec,
        ),
        initial_params=initial,
    ).start()
    del initial
    links.point_at(server.port)
    start = threading.Barrier(n)
    times: dict[int, list[tuple[float, float]]] = {i: [] for i in range(n)}
    errors: list[BaseException] = []
    # Per worker and measured round: bytes up and down (the client's counters' change, and the
    # sync's own ``last_bytes_*``, which must agree), and the final metrics.
    sizes: dict[int, list[tuple[int, int]]] = {i: [] for i in range(n)}
    finals: dict[int, dict[str, float]] = {}

    def worker(i: int) -> None:
        try:
            model = build_model(params)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            gen = torch.Generator().manual_seed(100 + i)
            with DiLoCoWorker(
                model,
                opt,
                f"127.0.0.1:{links.ports[i]}",
                sync_every=10**9,
                worker_id=f"link-{i}",
                heartbeat_interval=0,
                codec=codec,
            ) as w:
                for r in range(rounds + 1):  # the first is a warm-up
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(torch.randn(p.shape, generator=gen), alpha=1e-3)
                    start.wait(600)
                    t0 = time.monotonic()
                    up0, down0 = w.sync_metrics["bytes_up"], w.sync_metrics["bytes_down"]
                    w.force_sync()
                    times[i].append((t0, time.monotonic()))
                    m = w.sync_metrics
                    up, down = int(m["bytes_up"] - up0), int(m["bytes_down"] - down0)
                    if (up, down) != (m["last_bytes_up"], m["last_bytes_down"]):
                        raise RuntimeError(
                            f"worker {i}: the sync's bytes {m['last_bytes_up']}/"
                            f"{m['last_bytes_down']} differ from the client's {up}/{down}"
                        )
                    if r > 0:
                        sizes[i].append((up, down))
                finals[i] = w.sync_metrics
                start.wait(600)  # nobody leaves (and deregisters) before the last round ends
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=worker, args=(i,), name=f"link-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    status = server.status()
    server.stop(timeout=10)
    if errors:
        raise RuntimeError(f"a worker failed: {errors[0]!r}") from errors[0]
    spans = [
        (min(times[i][r][0] for i in range(n)), max(times[i][r][1] for i in range(n)))
        for r in range(1, rounds + 1)
    ]
    names = [f"link-{i}" for i in range(n)]
    last = [sizes[i][-1] for i in range(n)]
    log_rounds = [e for e in status.get("update_log", ()) if e.get("round", 0) >= 1]
    return {
        "round_s": [b - a for a, b in spans],
        "up": max(u for u, _ in last),
        "down": max(d for _, d in last),
        "sizes": {i: sizes[i] for i in range(n)},
        "rounds_synced": [int(finals[i]["rounds"]) for i in range(n)],
        "update_downloads": [int(finals[i]["update_downloads"]) for i in range(n)],
        "full_downloads": [int(finals[i]["full_downloads"]) for i in range(n)],
        "outer_step_s": [e.get("outer_step_s") for e in log_rounds][-rounds:],
        "phases": [] if clock is None else [clock.round_phases(a, b, names) for a, b in spans],
        "status": status,
    }


def check_sizes(run: dict[str, Any], expected: tuple[int, int], comm: str, rounds: int) -> None:
    """Every worker moved the same bytes each round, within ``SIZE_TOLERANCE`` above the model's
    payload; with a compressed downlink every round came as an update."""
    for i, per_round in run["sizes"].items():
        for up, down in per_round:
            for what, got, want in (("up", up, expected[0]), ("down", down, expected[1])):
                if not want <= got <= want * (1 + SIZE_TOLERANCE):
                    raise RuntimeError(
                        f"{comm}: worker {i} moved {got} bytes {what} in a round, the model's "
                        f"payload is {want} (more than {SIZE_TOLERANCE:.0%} apart)"
                    )
    if not comm.endswith("/fp32"):
        want = rounds + 1  # the warm-up round too
        if any(u != want for u in run["update_downloads"]):
            raise RuntimeError(
                f"{comm}: update downloads per worker {run['update_downloads']}, expected {want} "
                f"(full downloads {run['full_downloads']})"
            )


def _med(values: list[float]) -> float:
    values = [v for v in values if math.isfinite(v)]
    return statistics.median(values) if values else math.nan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=25e6, help="model parameters (default 25e6)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate", type=float, default=50.0, help="MB/s per worker and direction")
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds per row")
    ap.add_argument(
        "--comm",
        type=parse_comm,
        nargs="+",
        default=[parse_comm(BASELINE)],
        metavar="UP/DOWN",
        help="worker codec / server download codec, one row per config and slot count "
        f"(default {BASELINE}; e.g. {BASELINE} int8/int8 int4/int8)",
    )
    ap.add_argument(
        "--no-phases", action="store_true", help="do not time the library's calls (phases)"
    )
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = ap.parse_args(argv)

    import torch

    from diloco.server.config import DOWNLOAD_CODECS
    from diloco.worker.settings import parse_codec

    for up, down in args.comm:
        try:
            parse_codec(up)
        except ValueError as exc:
            ap.error(f"--comm {up}/{down}: {exc}")
        if down not in DOWNLOAD_CODECS:
            ap.error(f"--comm {up}/{down}: download codec must be one of {DOWNLOAD_CODECS}")

    logging.basicConfig(level=logging.WARNING)  # the rounds' INFO lines would bury the rows
    torch.set_num_threads(1)
    results = []
    print(
        f"{args.workers} workers, {args.params / 1e6:.0f}M parameters, links of {args.rate:g} MB/s "
        "per worker and direction (shaping proxies)",
        flush=True,
    )
    for up_codec, down_codec in args.comm:
        comm = f"{up_codec}/{down_codec}"
        expected = expected_bytes(args.params, up_codec, down_codec)
        for slots in args.slots:
            links = Links(args.workers, args.rate)
            clock = None if args.no_phases else PhaseClock()
            try:
                with clock or contextlib.nullcontext():
                    run = diloco_rounds(
                        links, args.params, slots, args.rounds, codec=up_codec,
                        download_codec=down_codec, clock=clock,
                    )  # fmt: skip
            finally:
                links.close()
            check_sizes(run, expected, comm, args.rounds)
            raws = raw_rounds(args.workers, args.rate, run["up"], run["down"], args.rounds)
            round_s, raw_s = statistics.median(run["round_s"]), statistics.median(raws)
            ideal = (run["up"] + run["down"]) / (args.rate * MB)
            phases = {k: _med([p[k] for p in run["phases"]]) for k in (run["phases"] or [{}])[0]}
            if phases:
                phases["outer_step"] = _med(run["outer_step_s"])
            row = {
                "comm": comm,
                "codec": up_codec,
                "download_codec": down_codec,
                "workers": args.workers,
                "slots": slots,
                "round_s": round_s,
                "rounds": run["round_s"],
                "wire_s": raw_s,
                "wires": raws,
                "rate_bound_s": ideal,
                "ratio": round_s / raw_s,
                "efficiency": raw_s / round_s,
                "up_bytes": run["up"],
                "down_bytes": run["down"],
                "up_mb": run["up"] / MB,
                "down_mb": run["down"] / MB,
                "payload_up_bytes": expected[0],
                "payload_down_bytes": expected[1],
                "update_downloads": run["update_downloads"],
                "outer_step_s": run["outer_step_s"],
                "last_round_upload_wait_max_s": run["status"].get("last_round_upload_wait_max_s"),
                "phases": phases,
                "phases_per_round": run["phases"],
            }
            results.append(row)
            print(
                f"  {comm} slots={slots}: round {round_s:.2f} s (rounds "
                f"{', '.join(f'{x:.2f}' for x in run['round_s'])}); wire time {raw_s:.2f} s "
                f"(up {row['up_mb']:.1f} MB + down {row['down_mb']:.1f} MB per worker at "
                f"{args.rate:g} MB/s: {ideal:.2f} s); round/wire {row['ratio']:.2f}; longest "
                f"upload wait for a slot in the last round "
                f"{row['last_round_upload_wait_max_s']} s",
                flush=True,
            )
            if phases:
                print(f"    phases (median s): {_phase_line(phases)}", flush=True)
            if clock is not None and clock.missing:
                print(f"    (not timed, missing: {', '.join(clock.missing)})", flush=True)
    base = {r["slots"]: r["round_s"] for r in results if r["comm"] == BASELINE}
    for r in results:
        r["vs_baseline"] = r["round_s"] / base[r["slots"]] if r["slots"] in base else None
    print()
    print(
        "| config (up/down) | workers | slots | round s, median | wire time s | round / wire "
        f"| MB up / worker / round | MB down / worker / round | round vs {BASELINE} |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        vs = "-" if r["vs_baseline"] is None else f"{r['vs_baseline']:.2f}x"
        print(
            f"| {r['comm']} | {r['workers']} | {r['slots']} | {r['round_s']:.2f} | "
            f"{r['wire_s']:.2f} | {r['ratio']:.2f} | {r['up_mb']:.2f} | {r['down_mb']:.2f} "
            f"| {vs} |"
        )
    if any(r["phases"] for r in results):
        print()
        print(
            "Phases, median over rounds, s (worker phases: the slowest worker's; server: summed). "
            "encode is inside upload (encode, send, the server's answer); the close waits for "
            "the adds, then runs the outer step (with the downlink encode: 'step', the server's "
            "own outer_step_s) and ends at 'close done'; then downloads, apply and adoption."
        )
        print()
        print(
            "| config | slots | encode | upload | last upload answered | server add | commit "
            "| close | step | downlink encode | close done | after close | apply | round |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            p = r["phases"]
            if not p:
                continue
            cells = [
                p[k]
                for k in (
                    "encode", "upload", "uploads_done_at", "server_add", "commit", "close",
                    "outer_step", "downlink_encode", "close_done_at", "after_close", "apply",
                )
            ]  # fmt: skip
            print(
                f"| {r['comm']} | {r['slots']} | "
                + " | ".join(f"{c:.2f}" for c in cells)
                + f" | {r['round_s']:.2f} |"
            )
    if args.json:
        args_out = {**vars(args), "comm": [f"{u}/{d}" for u, d in args.comm]}
        with open(args.json, "w") as f:
            json.dump({"args": args_out, "results": results}, f, indent=1)
    return 0 if all(math.isfinite(r["round_s"]) for r in results) else 1


def _phase_line(p: dict[str, float]) -> str:
    return (
        f"encode {p['encode']:.2f} within upload {p['upload']:.2f} (last answered at "
        f"{p['uploads_done_at']:.2f}); server add {p['server_add']:.2f}; commit "
        f"{p['commit']:.2f}; close {p['close']:.2f} (step {p['outer_step']:.2f}, downlink "
        f"encode {p['downlink_encode']:.2f}), done at {p['close_done_at']:.2f}; then "
        f"{p['after_close']:.2f} to the last worker's end (apply {p['apply']:.2f})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
