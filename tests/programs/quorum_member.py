"""One quorum member as a real process, driven by tests/processes/test_quorum_group.py.

Run as ``python -m tests.programs.quorum_member``. It reads one JSON command per line on stdin and
answers one JSON line on stdout (plain data; tensors go to safetensors files the test names).
Ops: ``build`` (join a quorum, closing the previous group), ``average``, ``broadcast``.
A member's tensors are a pure function of (seed, rank, shapes): ``member_tensors``, which the
test calls too, to compute what a result must be.

``trip_at: k`` in an ``average`` catches the moment for a fault: the member issues its k-th
collective, then prints ``{"inside": true}`` and blocks without waiting for it, so the test can
SIGKILL or SIGSTOP it while the others are inside that collective (see the test's docstrings).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from diloco.worker.allreduce.collective import (
    QuorumCollective,
    QuorumFailed,
    average,
    broadcast,
    state_hash,
)
from diloco.worker.transport.client import DiLoCoClient
from tests.helpers.quorum import member_tensors, mixed_tensors
from tests.helpers.rendezvous_host import member_meeting

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _send(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _trip_at(group: QuorumCollective, k: int) -> None:
    """From the group's k-th collective on: issue it, announce it, never wait for it."""
    calls = 0
    real = group.collective

    def tripped(what: str, start: Any) -> None:
        nonlocal calls
        calls += 1
        if calls < k:
            return real(what, start)

        def issue_and_hold(backend: Any) -> Any:
            start(backend)  # the Work runs on gloo's threads; this rank's bytes start flowing
            _send({"inside": True, "what": what, "call": calls})
            sys.stdin.readline()  # held here until SIGKILL/SIGSTOP (or the test goes away)
            sys.exit(3)

        return real(what, issue_and_hold)

    group.collective = tripped  # type: ignore[method-assign]


def _failure(err: QuorumFailed, group: QuorumCollective | None) -> dict[str, Any]:
    return {
        "ok": False,
        "error": type(err).__name__,
        "detail": str(err)[:500],
        "failed_at": time.monotonic(),  # CLOCK_MONOTONIC: comparable across processes
        "closed": group is not None and group.closed,
    }


def _handle(cmd: dict[str, Any], group: QuorumCollective | None) -> tuple[dict[str, Any], Any]:
    op = cmd["op"]
    if op == "build":
        if group is not None:
            group.close()
        client = DiLoCoClient(cmd["server"], retries=0, read_timeout=30.0)
        meeting = member_meeting(client, cmd["rank"])
        group = QuorumCollective.build(
            meeting, cmd["quorum"], cmd["rank"], cmd["size"], cmd["timeout"]
        )
        return {"ok": True}, group
    assert group is not None, "build first"
    if op == "average":
        tensors = member_tensors(cmd["seed"], group.rank, cmd["shapes"])
        if cmd.get("trip_at"):
            _trip_at(group, cmd["trip_at"])
        began = time.monotonic()
        total = average(
            group, tensors, cmd["weight"], DTYPES[cmd["dtype"]], bucket_bytes=cmd["bucket_bytes"]
        )
        reply = {"ok": True, "weight_sum": total, "seconds": time.monotonic() - began}
    elif op == "broadcast":
        tensors = mixed_tensors(cmd["seed"], group.rank)
        broadcast(group, tensors, cmd["src"], bucket_bytes=cmd["bucket_bytes"])
        reply = {"ok": True}
    else:
        raise ValueError(f"unknown op {op!r}")
    save_file({f"t{i}": t for i, t in enumerate(tensors)}, cmd["out"])
    reply["hash"] = state_hash(tensors)
    return reply, group


def main() -> None:
    torch.set_num_threads(1)  # the tests run several members on a small machine
    group: QuorumCollective | None = None
    _send({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            reply, group = _handle(cmd, group)
        except QuorumFailed as err:
            reply = _failure(err, group)
        # The point of the design: nothing here ever touches the default process group.
        reply["initialized"] = dist.is_initialized()
        _send(reply)


if __name__ == "__main__":
    main()
