"""Two replicas per stage against 2-worker DiLoCo: held-out loss at the same H and samples.

    python -m benchmarks.swarm.replicas --steps 200 --sync-every 50 --seeds 0,1,2
    python -m benchmarks.swarm.replicas --smoke      # 8 steps, H = 4, checked

Issue 29's target: a swarm with two replicas per stage within +2% held-out loss of 2-worker
DiLoCo at the same H and samples. Per seed, two runs of the demo's character model on the
demo's 2-way split of the training text (``build_corpus(2)``: worker / driver ``i`` on shard
``i`` with sampling seed ``seed * 1000 + i``, batch 16 x 64 bytes, AdamW lr 3e-3):

* **DiLoCo**: a server-mode ``DiLoCoServer`` (sync rounds, the server's outer SGD with Nesterov
  momentum) and two ``DiLoCoWorker``s in threads, the demo's settings (bf16 pseudo-gradients);
  its global model evaluated after the last round.
* **Swarm 2/2/2**: a ``--swarm`` coordinator (3 stages) and six ``SwarmPeer``s in threads: 2
  heads (the drivers), 2 stage-1 and 2 stage-2 replicas, stage sync every H steps (fp32
  pseudo-gradients, the same outer optimizer), int8 boundaries, micro-batches of 4, 4 in flight.
  Driver ``i`` sends only to replica ``i`` of each stage (``StaticRoutes``): a replica fed by two
  drivers would step under one driver's held forward (docs/design/swarm.md). The drivers go in
  lockstep chunks of H steps as in ``diloco demo --swarm``; after the last chunk every replica
  has drained and run its stage's round, so a stage's replicas hold the same bytes (checked),
  and replica 0 of each stage, joined, is evaluated.

Held-out loss on the demo's 256 held-out windows; the median over the seeds is the figure.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

from benchmarks.harness import smoke
from benchmarks.harness.report import (
    machine_info,
    now,
    print_machine,
    print_table,
    run_head,
    write_json,
)
from benchmarks.swarm.demo_swarm import D_MODEL, SEQ, STAGES, TOKEN, loss_fn
from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.demo.data import Corpus, build_corpus, sample_batch
from diloco.demo.model import build_model, evaluate
from diloco.demo.sequential import build_sequential
from diloco.swarm import Endpoint, StaticRoutes, SwarmPeer, stage_of
from diloco.wire.messages import RegisterInfo
from diloco.worker.transport.client import DiLoCoClient

LANES = 2
"""Drivers, DiLoCo workers, and replicas of every stage."""
MICRO_BATCH, IN_FLIGHT = 4, 4


def _batches(corpus: Corpus, i: int, args: Any) -> list[tuple[Any, Any]]:
    """Worker / driver ``i``'s batches, as the demo samples them."""
    g = torch.Generator().manual_seed(args.seed * 1000 + i)
    return [sample_batch(corpus.shards[i], args.batch, SEQ, g) for _ in range(args.steps)]


def diloco_run(corpus: Corpus, args: Any) -> dict[str, Any]:
    """Two DiLoCo workers (threads) through a server-mode server: the global model's loss."""
    model = build_model(args.seed, SEQ)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    server = DiLoCoServer(ServerConfig(port=0, num_workers=LANES), initial_params=initial).start()

    def work(i: int) -> None:
        m = build_model(args.seed, SEQ)
        opt = torch.optim.AdamW(m.parameters(), lr=args.lr)
        with DiLoCoWorker(
            m, opt, server.address, sync_every=args.sync_every, worker_id=f"worker-{i}",
            heartbeat_interval=5.0,
        ) as w:  # fmt: skip
            for x, y in _batches(corpus, i, args):
                loss = loss_fn(m(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                w.report(loss=float(loss.detach()), samples=x.numel())

    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(LANES) as pool:
            for f in [pool.submit(work, i) for i in range(LANES)]:
                f.result()
        rounds = int(server.status()["round"])
        model.load_state_dict(server.global_params(), strict=False)
    finally:
        server.stop()
    return {
        "loss": evaluate(model, corpus.eval, SEQ),
        "rounds": [rounds],
        "s": time.monotonic() - t0,
    }


@contextmanager
def _swarm(args: Any) -> Iterator[tuple[DiLoCoServer, list[list[SwarmPeer]]]]:
    """A coordinator and ``LANES`` replicas of every stage, stage sync every H; ``peers[k][i]``
    is replica ``i`` of stage ``k``. Every id is registered for its stage first, so each
    stage's first quorum waits for all its replicas (as ``diloco demo --swarm`` does)."""
    config = ServerConfig(
        port=0, num_workers=1, swarm=True, stages=STAGES, min_replicas=1, token=TOKEN,
        poll_timeout=0.5, join_timeout=30.0, heartbeat_timeout=0.0,
    )  # fmt: skip
    server = DiLoCoServer(config, initial_params=None).start()
    ids = {(k, i): f"s{k}-{i}" for k in range(STAGES) for i in range(LANES)}
    client = DiLoCoClient(server.address, token=TOKEN)
    try:
        for (k, _), peer_id in ids.items():
            client.register(peer_id, info=RegisterInfo(stages=(k,)))
    finally:
        client.close()
    made = {
        key: SwarmPeer(
            lambda k, s: stage_of(lambda: build_sequential(args.seed, SEQ), k, s),
            num_stages=STAGES,
            server=server.address,
            optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr),
            loss_fn=loss_fn,
            boundaries=(SEQ, D_MODEL),
            samples_per_step=args.batch,
            micro_batch=MICRO_BATCH,
            codec="int8",
            token=TOKEN,
            stages=[key[0]],
            worker_id=peer_id,
            sync_every=args.sync_every,
            idle_step_s=600.0,
            heartbeat_interval=0.0,
            max_in_flight=IN_FLIGHT,
            timeout_floor_s=5.0,
            token_dims=2,
            route_wait_s=30.0,
            seed=args.seed + n,
        )  # fmt: skip
        for n, (key, peer_id) in enumerate(ids.items())
    }
    try:
        with ThreadPoolExecutor(len(made)) as pool:
            for f in [pool.submit(p.start) for p in made.values()]:
                f.result(timeout=120)
        yield server, [[made[(k, i)] for i in range(LANES)] for k in range(STAGES)]
    finally:
        for p in made.values():
            p.stop()
        server.stop()


def _url(peer: SwarmPeer) -> Endpoint:
    assert peer.service is not None
    return Endpoint(f"http://127.0.0.1:{peer.service.port}", TOKEN)


def swarm_run(corpus: Corpus, args: Any) -> dict[str, Any]:
    """The 2/2/2 swarm, each driver pinned to its own lane; the joined model's loss."""
    t0 = time.monotonic()
    with _swarm(args) as (server, peers):
        heads = peers[0]
        for i, head in enumerate(heads):
            assert head.driver is not None
            head.driver.routes = StaticRoutes({k: [_url(peers[k][i])] for k in range(1, STAGES)})
        data = [_batches(corpus, i, args) for i in range(LANES)]

        def drive(i: int, chunk: slice) -> None:
            for x, y in data[i][chunk]:
                heads[i].train_step(x, y)

        with ThreadPoolExecutor(LANES) as pool:
            for first in range(0, args.steps, args.sync_every):
                chunk = slice(first, first + args.sync_every)
                for f in [pool.submit(drive, i, chunk) for i in range(LANES)]:
                    f.result()
                for group in peers:  # every replica's deferred step and its round are done
                    for p in group:
                        if p.service is not None:
                            p.service.drain()
        same = all(_same(group) for group in peers)
        model = build_sequential(args.seed, SEQ)
        model.load_state_dict(
            {n: t.detach() for g in peers for n, t in g[0].module.named_parameters()},  # type: ignore[union-attr]
            strict=True,
        )
        rounds = [int(st["rounds_completed"]) for st in server.status()["swarm"]["stages"]]
    loss = evaluate(model, corpus.eval, SEQ)
    return {"loss": loss, "rounds": rounds, "same": same, "s": time.monotonic() - t0}


def _same(group: list[SwarmPeer]) -> bool:
    """The replicas of one stage hold the same bytes."""
    first = dict(group[0].module.named_parameters())  # type: ignore[union-attr]
    return all(
        torch.equal(first[n], t)
        for p in group[1:]
        for n, t in p.module.named_parameters()  # type: ignore[union-attr]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="steps per worker / driver")
    ap.add_argument("--sync-every", type=int, default=50, help="H, of DiLoCo and stage sync")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate")
    ap.add_argument("--seeds", default="0,1,2", help="seeds, comma separated (median taken)")
    ap.add_argument("--out", default="benchmarks/results/swarm_replicas.json")
    smoke.add_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.sync_every, args.seeds = 8, 4, "0"
    torch.set_num_threads(1)
    # A handler of our own first: a worker then leaves the level alone, and the rounds' INFO
    # lines stay out of the figures.
    logging.basicConfig(level=logging.WARNING)
    date, machine = now(), machine_info()
    print(f"# Pipeline swarm, two replicas per stage against 2-worker DiLoCo, {date}", flush=True)
    print_machine(machine)
    print(
        f"{args.steps} steps a worker / driver, H {args.sync_every}, batch {args.batch} x {SEQ}; "
        f"swarm 2/2/2 replicas, int8 boundaries, micro-batch {MICRO_BATCH}, {IN_FLIGHT} in flight\n",
        flush=True,
    )
    corpus = build_corpus(LANES)
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        args.seed = seed
        d, s = diloco_run(corpus, args), swarm_run(corpus, args)
        rows.append({"seed": seed, "diloco": d, "swarm": s, "gap": s["loss"] / d["loss"] - 1})
        print(
            f"seed {seed}: DiLoCo {d['loss']:.4f} ({d['s']:.0f} s), swarm {s['loss']:.4f} "
            f"({s['s']:.0f} s), {100 * rows[-1]['gap']:+.2f}%",
            flush=True,
        )
    med = {k: statistics.median(r[k]["loss"] for r in rows) for k in ("diloco", "swarm")}
    print()
    table(rows, med)
    if args.smoke:
        check(rows, args)
        smoke.passed("swarm.replicas")
        return
    doc = {**run_head("swarm_replicas", date, machine), "args": vars(args), "runs": rows}
    write_json(args.out, {**doc, "median": med})


def table(rows: list[dict[str, Any]], med: dict[str, float]) -> None:
    def gap(swarm: float, diloco: float) -> str:
        return f"{100 * (swarm / diloco - 1):+.2f}%"

    print_table(
        ["seed", "2-worker DiLoCo", "swarm 2/2/2", "swarm against DiLoCo", "rounds", "equal"],
        [
            [
                str(r["seed"]),
                f"{r['diloco']['loss']:.4f}",
                f"{r['swarm']['loss']:.4f}",
                gap(r["swarm"]["loss"], r["diloco"]["loss"]),
                f"{r['diloco']['rounds'][0]}; {r['swarm']['rounds']}",
                str(r["swarm"]["same"]),
            ]
            for r in rows
        ]
        + [
            [
                "median",
                f"{med['diloco']:.4f}",
                f"{med['swarm']:.4f}",
                gap(med["swarm"], med["diloco"]),
                "",
                "",
            ]
        ],
    )
    print("(rounds: DiLoCo's; each stage's. equal: every stage's replicas hold the same bytes)")


def check(rows: list[dict[str, Any]], args: Any) -> None:
    want = args.steps // args.sync_every
    smoke.require(
        all(r[k]["loss"] == r[k]["loss"] for r in rows for k in ("diloco", "swarm")),
        "finite losses",
    )
    smoke.require(
        all(
            r["diloco"]["rounds"] == [want] and r["swarm"]["rounds"] == [want] * STAGES
            for r in rows
        ),
        f"{want} rounds of DiLoCo and of every stage",
    )
    smoke.require(all(r["swarm"]["same"] for r in rows), "a stage's replicas hold one state")


if __name__ == "__main__":
    main()
