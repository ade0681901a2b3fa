"""How long a quorum takes to build its gloo group through the rendezvous: the server's HTTP
store (``worker/allreduce/http_store.py``, as the workers use it) beside a plain
``torch.distributed.TCPStore`` (what the rendezvous was before issue 26), N members in threads
of one process on loopback, the median of ``--repeats`` joins (each: from the first member's
start to the last member's group built).

    python -m benchmarks.rounds.rendezvous_join --sizes 2 4 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from benchmarks.harness import smoke
from diloco import DiLoCoServer, ServerConfig
from diloco.wire.messages import Rendezvous, quorum_prefix
from diloco.worker.allreduce.collective import QuorumCollective
from diloco.worker.allreduce.http_store import HttpMeeting
from diloco.worker.transport.client import DiLoCoClient

TABLE = {"params": [["w", [4]]]}


class TcpMeeting:
    """The rendezvous before issue 26: a TCPStore client per join, a prefix per quorum."""

    def __init__(self, port: int) -> None:
        self.port = port

    def store(self, quorum_id: str, timeout: float) -> Any:
        client = dist.TCPStore(
            "127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=timeout)
        )
        return dist.PrefixStore(quorum_prefix(quorum_id), client)

    def server(self) -> tuple[str, int]:
        return "127.0.0.1", self.port

    def joined(self) -> None:
        pass


def _join_all(meetings: list[Any], quorum_id: str) -> float:
    n = len(meetings)
    began = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        groups = list(
            pool.map(lambda r: QuorumCollective.build(meetings[r], quorum_id, r, n, 30.0), range(n))
        )
    took = time.perf_counter() - began
    for g in groups:
        g.close()
    return took


def http_joins(n: int, repeats: int) -> list[float]:
    config = ServerConfig(port=0, allreduce=True, num_workers=n, join_timeout=0.0)
    with DiLoCoServer(config) as srv:
        ids = [f"w{i}" for i in range(n)]
        clients = [DiLoCoClient(srv.address) for _ in ids]
        for c, w in zip(clients, ids, strict=True):
            c.register(w, info=TABLE)
        times = []
        for r in range(repeats):

            def ask(i: int, r: int = r) -> dict[str, Any]:
                return clients[i].quorum(ids[i], round=r, hash="h")

            with ThreadPoolExecutor(n) as pool:
                asks = list(pool.map(ask, range(n)))
            assert [a["rank"] for a in asks] == list(range(n))  # ranks follow the ids
            qid = asks[0]["quorum_id"]
            where = Rendezvous.from_json(asks[0]["rendezvous"])
            meetings = [HttpMeeting(clients[i], ids[i], where) for i in range(n)]
            times.append(_join_all(meetings, qid))
            for i in range(n):
                clients[i].quorum_outcome(ids[i], qid, ok=True, round=r + 1, hash="h")
        for c in clients:
            c.close()
    return times


def tcp_joins(n: int, repeats: int) -> list[float]:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    meetings = [TcpMeeting(master.port) for _ in range(n)]
    return [_join_all(meetings, f"q-{r}") for r in range(repeats)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=7)
    smoke.add_flag(parser)
    args = parser.parse_args()
    if args.smoke:  # two members, two joins each way
        args.sizes, args.repeats = [2], 2
    medians: dict[str, float] = {}
    for n in args.sizes:
        for name, joins in (("TCPStore", tcp_joins), ("HTTP store", http_joins)):
            times = joins(n, args.repeats)
            medians[name] = statistics.median(times)
            print(
                f"N={n} {name:10s}: median {medians[name] * 1e3:7.1f} ms "
                f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}, "
                f"{len(times)} joins, {threading.active_count()} threads)"
            )
    if args.smoke:
        smoke.require(
            all(0 < m < 30 for m in medians.values()), f"every join completed ({medians})"
        )
        smoke.passed("rendezvous_join")


if __name__ == "__main__":
    main()
