"""The worker program of chaos_allreduce: trains the demo model and says what it holds.

Started by the driver as ``python -m benchmarks.faults.chaos_allreduce worker ARGS`` (with
``PYTHONPATH`` on a snapshot of ``src/``), it trains on its shard until its stdin closes, then
stops at its next completed sync, evaluates and leaves. It prints one JSON line per event on
stdout: started, joined, every completed sync (its round, the quorum that completed it, a CRC of
its parameters and the strategy's hash of its state), final.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from typing import Any


class SyncWatch:
    """Whether the inner step just taken completed a sync: the moment the worker reports its
    round and state, which the members of the quorum that completed it must share.

    Plain (``streaming`` False): ``local_step == 0`` after ``opt.step()``; the model then holds
    the run's parameters. Streaming: ``local_step`` is the schedule's phase and a round completes
    on the round's thread, so a sync is a round completed since the last one reported
    (``sync_metrics["rounds"]`` grew) with none in flight: its fragment is merged, and the
    round's thread, the only writer of the state while a round runs, has ended. A round is in
    flight for ``--overlap`` of the ``sync_every / P`` steps between two rounds (the driver
    keeps tau below that), so the check sees every completed round one step after its merge."""

    def __init__(self, worker: Any, streaming: bool) -> None:
        self.worker, self.streaming = worker, streaming
        self.rounds = int(worker.sync_metrics["rounds"])  # joining completes none

    def __call__(self) -> bool:
        if not self.streaming:
            return bool(self.worker.local_step == 0)
        payload = getattr(self.worker._strategy, "_payload", None)  # QuorumSync's
        if getattr(payload, "_inflight", None) is not None:
            return False
        rounds = int(self.worker.sync_metrics["rounds"])
        done, self.rounds = rounds > self.rounds, rounds
        return done


def worker_main(args: argparse.Namespace) -> int:
    """One worker: trains the demo model on its shard until stdin closes, then stops at its
    next completed sync (``--final-wait`` at most), evaluates and leaves. Prints JSON lines."""
    import logging

    import torch

    from benchmarks.faults import chaos_adversary
    from diloco.demo.data import build_corpus, sample_batch
    from diloco.demo.model import build_model, evaluate, loss_on
    from diloco.wire.checksum import tensor_checksum
    from diloco.worker import DiLoCoClient, DiLoCoWorker

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver's stack dump
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    torch.set_num_threads(1)

    def say(**event: Any) -> None:
        print(json.dumps(event), flush=True)

    corpus = build_corpus(args.shards)
    tokens = corpus.shards[args.shard]
    model = build_model(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed * 1000 + args.incarnation)
    stop = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()  # EOF: the driver asks this worker to stop
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    import diloco

    say(event="started", pid=os.getpid(), source=diloco.__file__)

    class RecordingClient(DiLoCoClient):
        """Remembers the last quorum the server handed out: the one a completed sync ran."""

        last: tuple[str, list[str]] | None = None

        def quorum(self, worker_id: str, **ask: Any) -> dict[str, Any]:
            reply = super().quorum(worker_id, **ask)
            if "quorum_id" in reply:
                self.last = (reply["quorum_id"], list(reply["members"]))
            return reply

    client_class: type[RecordingClient] = RecordingClient
    if args.fault == "weight":
        client_class = chaos_adversary.weight_client(RecordingClient)
    client = client_class(
        args.address,
        token=args.token,
        retries=8,
        backoff=0.2,
        max_backoff=2.0,
        read_timeout=30,
    )
    worker = DiLoCoWorker(
        model,
        opt,
        args.address,
        sync_every=args.sync_every,
        worker_id=args.worker_id,
        heartbeat_interval=1.0,
        client=client,
        num_fragments=args.fragments,
        overlap_steps=args.overlap,
        merge_alpha=args.alpha,
    )

    def say_state(event: str, **more: Any) -> None:
        """An event with the state the worker holds: its round, the model's checksum, and
        QuorumSync's hash of its state."""
        strategy = getattr(worker, "_strategy", None)
        say(
            event=event,
            round=worker.base_round,
            crc=tensor_checksum(model.parameters()),
            state=getattr(strategy, "_hash", None),
            **more,
        )

    stopping_since: float | None = None
    final: dict[str, Any] = {}
    fault = (
        chaos_adversary.install(args.fault, args.fault_step, worker, model, say)
        if args.fault
        else None
    )
    samples = 1e300 if args.fault == "weight" else 16.0  # a batch: 16 sequences
    steps = 0
    with worker:
        synced = SyncWatch(worker, streaming=args.fragments > 1)
        say_state("joined", quorum=client.last and client.last[0])
        while True:
            x, y = sample_batch(tokens, 16, 64, gen)
            loss = loss_on(model, x, y)
            loss.backward()
            worker.report(loss=loss.item(), samples=samples)
            opt.step()  # the worker's hook runs the sync every sync_every steps
            opt.zero_grad()
            steps += 1
            if fault is not None:
                fault(steps)
            if synced():
                say_state(
                    "sync",
                    quorum=client.last and client.last[0],
                    members=client.last and client.last[1],
                )
                if stop.is_set():
                    final = {"eval_loss": evaluate(model, corpus.eval), "at_sync": True}
                    break
            if stop.is_set():
                stopping_since = stopping_since or time.monotonic()
                if time.monotonic() - stopping_since > args.final_wait:
                    final = {"eval_loss": None, "at_sync": False}
                    break
        metrics = worker.sync_metrics
    say_state(
        "final",
        **final,
        metrics={k: v for k, v in metrics.items() if isinstance(v, int | float)},
    )
    return 0


def parse_worker_args(argv: list[str]) -> argparse.Namespace:
    """The worker program's arguments (after ``worker``), as the driver passes them."""
    p = argparse.ArgumentParser(prog="chaos_allreduce worker")
    for name in ("--address", "--worker-id"):
        p.add_argument(name, required=True)
    for name in ("--shard", "--shards", "--seed", "--incarnation", "--sync-every"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--final-wait", type=float, default=60.0)
    p.add_argument("--fragments", type=int, default=1)
    p.add_argument("--overlap", type=int, default=0)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--token")
    p.add_argument("--fault", choices=chaos_adversary_kinds(), help="this worker is faulty")
    p.add_argument("--fault-step", type=int, default=12)
    return p.parse_args(argv)


def chaos_adversary_kinds() -> tuple[str, ...]:
    from benchmarks.faults.chaos_adversary import KINDS

    return KINDS
