"""Synchronous rounds when every worker sits behind its own slow link, for 1, 2, ... upload slots
and for one or more ways of putting the bytes on the wire (``--comm UP/DOWN``).

The loopback benchmark (``rounds/sync_round``) measures CPU overhead: on loopback the bytes move at
memory speed. Real workers reach the server over links of their own (a 1 Gbit office line, a
cloud region's egress), often slower than the server's. Then what matters is how many uploads
the server takes in at once: it receives an upload whole into a receive buffer before any of it
counts, and with one buffer (``upload_slots=1``, the default: memory flat in N) the uploads of a
round arrive one after the other, each at one link's speed.

Here each worker reaches the server through a shaping proxy (a child process, token buckets of
``--rate`` MB/s per worker and direction, shared by all of that worker's connections: its link;
``harness/shaped_links.py``). The server and the workers run in this process (threads; torch releases
the GIL in its kernels and the links, not the CPU, set the pace). For each ``--comm`` config and
slot count a fresh server is started and the round time is compared with the wire time: the
same bytes through the same proxies with plain sockets (N clients upload, then each gets its
download), measured beside the rounds.

``--comm UP/DOWN``: the workers' codec (``DiLoCoWorker(codec=UP)``: fp32, bf16, int8, int4,
lowrank:R, topk:density=D,chunk=C,bits=B) and the server's download codec
(``ServerConfig(download_codec=DOWN)``: fp32, bf16, int8, int4, sparse; anything but fp32
publishes each round as a compressed update). ``sparse`` (the positions the round changed, with
their new values) needs plain averaged descent, so it implies ``outer_rule="sparseloco"``, as
in ``rounds/sync_round``; every other config runs under the server's default rule (Nesterov). ``bf16/fp32`` is
what a worker sends and gets by default. The bytes the wire time moves are each config's own,
read from the workers' ``sync_metrics`` after a measured round (``last_bytes_up`` and
``last_bytes_down``: safetensors headers and payloads) and checked against the payload the model
and the codecs give. A compressed config moves fewer bytes, so the CPU work that a slow wire
hides for bf16/fp32 (encoding, the server's decode-add, step and downlink encode, the workers'
apply) shows: each row's phases, timed around the library's calls, say where the time goes.

    .venv/bin/python -m benchmarks.links.slow_links --params 25e6 --workers 4 --rate 50 --slots 1 2 4
    .venv/bin/python -m benchmarks.links.slow_links --slots 4 --comm bf16/fp32 int8/int8 int4/int8
    .venv/bin/python -m benchmarks.links.slow_links --slots 4 --comm bf16/fp32 \
        topk:density=0.0156,chunk=4096,bits=2/sparse topk:density=0.0156,chunk=4096,bits=2/int8
    .venv/bin/python -m benchmarks.links.slow_links --smoke

MB = 10**6 bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import statistics
import threading
import time
from typing import Any

from benchmarks.harness import smoke
from benchmarks.harness.model import build_model, width_shape
from benchmarks.harness.report import print_table, write_json
from benchmarks.harness.shaped_links import MB, Links, raw_rounds
from benchmarks.links.phase_clock import PhaseClock

BASELINE = "bf16/fp32"
"""What a worker sends (bf16 pseudo-gradients) and gets (fp32 parameters) by default."""
SIZE_TOLERANCE = 0.05
"""Measured bytes (headers included) may exceed the model's payload by this fraction."""
SPARSE = "sparse"
"""The download codec whose size depends on the round (the union of the uploads' supports)."""


# --- DiLoCo rounds ----------------------------------------------------------------------------


def parse_comm(spec: str) -> tuple[str, str]:
    """``UP/DOWN`` (``int8/int8``): the worker codec and the server's download codec."""
    up, sep, down = spec.partition("/")
    if not sep or not up.strip() or not down.strip() or "/" in down:
        raise argparse.ArgumentTypeError(f"expected UP/DOWN (like bf16/fp32), got {spec!r}")
    return up.strip(), down.strip()


def expected_bytes(params: float, up: str, down: str) -> tuple[int, int]:
    """Payload bytes one worker sends and gets per round with codec ``up`` and download codec
    ``down``, from the model's shapes and the codecs' parts (no headers). For ``sparse`` the
    download's size is the round's (its changed positions): the fp32 parameters' size, which
    bounds it, is returned."""
    from diloco.core.codecs import codec_by_name
    from diloco.worker.settings import parse_codec

    shapes = [tuple(p.shape) for p in build_model(width_shape(params)).parameters()]

    def nbytes(codec: Any) -> int:
        return sum(part.numel * part.dtype.itemsize for s in shapes for part in codec.parts(s))

    return nbytes(parse_codec(up)), nbytes(codec_by_name("fp32" if down == SPARSE else down))


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
    initial = {
        name: p.detach().clone() for name, p in build_model(width_shape(params)).named_parameters()
    }
    server = DiLoCoServer(
        ServerConfig(
            port=0,
            num_workers=n,
            upload_slots=slots,
            heartbeat_timeout=0,
            download_codec=download_codec,
            # The sparse update needs plain averaged descent (ServerConfig refuses it otherwise).
            outer_rule="sparseloco" if download_codec == SPARSE else "sgd",
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
            model = build_model(width_shape(params))
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
    payload (a sparse download: more than nothing, less than the fp32 parameters); with a
    compressed downlink every round came as an update."""
    sparse = comm.endswith("/" + SPARSE)
    for i, per_round in run["sizes"].items():
        for up, down in per_round:
            for what, got, want in (("up", up, expected[0]), ("down", down, expected[1])):
                low = 1 if sparse and what == "down" else want
                if not low <= got <= want * (1 + SIZE_TOLERANCE):
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
    smoke.add_flag(ap)
    args = ap.parse_args(argv)
    if args.smoke:  # 1M parameters, 2 workers, 1 slot, one measured round, three configs
        args.params, args.workers, args.slots, args.rounds = 1e6, 2, [1], 1
        args.comm = [parse_comm(c) for c in (BASELINE, "int8/int8", "topk/sparse")]

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
                "outer_rule": "sparseloco" if down_codec == SPARSE else "sgd (Nesterov)",
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
    print_table(
        [
            "config (up/down)",
            "workers",
            "slots",
            "round s, median",
            "wire time s",
            "round / wire",
            "MB up / worker / round",
            "MB down / worker / round",
            f"round vs {BASELINE}",
        ],
        [
            [
                r["comm"],
                str(r["workers"]),
                str(r["slots"]),
                f"{r['round_s']:.2f}",
                f"{r['wire_s']:.2f}",
                f"{r['ratio']:.2f}",
                f"{r['up_mb']:.2f}",
                f"{r['down_mb']:.2f}",
                "-" if r["vs_baseline"] is None else f"{r['vs_baseline']:.2f}x",
            ]
            for r in results
        ],
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
        keys = (
            "encode", "upload", "uploads_done_at", "server_add", "commit", "close",
            "outer_step", "downlink_encode", "close_done_at", "after_close", "apply",
        )  # fmt: skip
        print_table(
            [
                "config",
                "slots",
                "encode",
                "upload",
                "last upload answered",
                "server add",
                "commit",
                "close",
                "step",
                "downlink encode",
                "close done",
                "after close",
                "apply",
                "round",
            ],  # fmt: skip
            [
                [r["comm"], str(r["slots"]), *(f"{r['phases'][k]:.2f}" for k in keys)]
                + [f"{r['round_s']:.2f}"]
                for r in results
                if r["phases"]
            ],
        )
    if args.json:
        args_out = {**vars(args), "comm": [f"{u}/{d}" for u, d in args.comm]}
        write_json(args.json, {"args": args_out, "results": results})
    if args.smoke:
        check_smoke(results)
    return 0 if all(math.isfinite(r["round_s"]) for r in results) else 1


def check_smoke(results: list[dict[str, Any]]) -> None:
    """Every row ran rounds that moved bytes (``check_sizes`` held them to the payload) and
    took at least about their wire time, which was measured."""
    smoke.require(len(results) == 3, "the three configurations ran")
    for r in results:
        smoke.require(math.isfinite(r["round_s"]) and r["round_s"] > 0, f"{r['comm']}: a round")
        smoke.require(r["wire_s"] > 0 and r["up_bytes"] > 0, f"{r['comm']}: the wire time")
        smoke.require(r["ratio"] > 0.8, f"{r['comm']}: a round takes its wire time at least")
    smoke.passed("slow_links")


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
