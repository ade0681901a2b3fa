"""The relay's upstream link against a scripted client (no sockets): which submission ids and
bases it sends for each answer the upstream can give, so that a round's mean is counted once;
and the closed round kept on disk (``relay/pending.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco.server.config import ServerConfig
from diloco.server.relay import pending
from diloco.server.relay.upstream import Upstream
from diloco.wire import TensorSpec
from diloco.worker.transport.client import Conflict, UnknownWorker, Unreachable

MEAN = {"w": torch.tensor([0.5, -1.0]), "b": torch.tensor([2.0])}


class ScriptedClient:
    """Answers each upload with the next scripted outcome (a receipt round, or an exception)
    and records what was sent."""

    base_url = "http://up.example:8512"

    def __init__(self, uploads: list[int | Exception], last_counted: int | None = None) -> None:
        self.uploads = uploads
        self.last_counted = last_counted
        self.sent: list[tuple[str, int, dict[str, torch.Tensor], float]] = []
        self.fetched: list[int] = []
        self.registered: list[str | None] = []
        self.bytes_up = self.bytes_down = 0

    def submit_pseudogradients(
        self,
        worker_id: str,
        base: int,
        sid: str,
        specs: list[TensorSpec],
        produce: Callable[[TensorSpec], torch.Tensor],
        *,
        weight: float,
    ) -> dict[str, Any]:
        self.sent.append((sid, base, {s.name: produce(s) for s in specs}, weight))
        outcome = self.uploads.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        self.bytes_up += 100
        return {"status": "accepted", "round": outcome}

    def register(self, worker_id: str, **kw: Any) -> dict[str, Any]:
        self.registered.append(kw.get("last_submission_id"))
        last = kw.get("last_submission_id")
        reply: dict[str, Any] = {"worker_id": worker_id, "round": 0, "mode": "sync"}
        reply["has_params"] = True
        if last is not None:
            reply["last_submission"] = {"counted_in": self.last_counted, "in_params": False}
        return reply

    def get_global_params(self, *, min_round: int, worker_id: str) -> tuple[int, Any]:
        self.fetched.append(min_round)
        self.bytes_down += 10
        return min_round, {"w": torch.zeros(2), "b": torch.zeros(1)}


def conflict(code: str, round_: int, action: str) -> Conflict:
    return Conflict(409, {"error": code, "detail": "", "round": round_, "action": action})


def link(client: ScriptedClient) -> Upstream:
    up = Upstream(ServerConfig(upstream="up.example:8512", upstream_codec="fp32"), client)  # type: ignore[arg-type]
    up.relay_id, up.round = "relay-x", 4
    up.stopping.wait = lambda _s: False  # type: ignore[method-assign]  # no pause between tries
    return up


def exchange(up: Upstream) -> tuple[int, Any]:
    return up.exchange(7, 4, list(MEAN), list(MEAN.values()), 2.0)


def test_an_accepted_upload_is_sent_once_and_its_round_fetched() -> None:
    client = ScriptedClient([4])
    up = link(client)
    round_, _ = exchange(up)
    ((sid, base, body, weight),) = client.sent
    assert (sid, base, weight) == ("relay-x:7:4", 4, 2.0)
    assert all(torch.equal(body[n], MEAN[n]) for n in MEAN)
    assert client.fetched == [5] and round_ == 5 == up.round and up.uploads == 1
    assert (up.last_upload_bytes, up.last_download_bytes) == (100, 10)


def test_an_unreachable_upstream_gets_the_same_id_again() -> None:
    client = ScriptedClient([Unreachable("down"), Unreachable("down"), 4])
    exchange(link(client))
    assert [s[0] for s in client.sent] == ["relay-x:7:4"] * 3


@pytest.mark.parametrize(("counted", "resends"), [(4, 0), (None, 1)])
def test_a_410_registers_again_and_asks_whether_it_counted(
    counted: int | None, resends: int
) -> None:
    """A restarted upstream: counted already (its receipts say so), nothing is sent again;
    unknown, the same id goes again."""
    client = ScriptedClient([UnknownWorker(410, {"error": "unknown_worker"}), 4], counted)
    exchange(link(client))
    assert client.registered[-1] == "relay-x:7:4"
    assert [s[0] for s in client.sent] == ["relay-x:7:4"] * (1 + resends)
    assert client.fetched == [5]


def test_a_stale_upload_goes_on_the_upstreams_open_round_under_a_new_id() -> None:
    client = ScriptedClient([conflict("stale_round", 6, "rebase"), 6])
    exchange(link(client))
    assert [(s[0], s[1]) for s in client.sent] == [("relay-x:7:4", 4), ("relay-x:7:6", 6)]
    assert client.fetched == [7]  # only the result: the rebase took no download


@pytest.mark.parametrize(
    ("code", "action"),
    [("not_expected", "continue"), ("round_closing", "rebase"), ("already_submitted", "wait")],
)
def test_an_upload_the_open_round_cannot_take_waits_for_the_next(code: str, action: str) -> None:
    client = ScriptedClient([conflict(code, 4, action), 5])
    exchange(link(client))
    assert [(s[0], s[1]) for s in client.sent] == [("relay-x:7:4", 4), ("relay-x:7:5", 5)]
    assert client.fetched == [5, 6]  # the long poll for round 5 to open, then the result


def test_the_link_state_goes_into_checkpoints_and_back() -> None:
    up = link(ScriptedClient([]))
    other = link(ScriptedClient([]))
    other.relay_id, other.round = "relay-y", None
    other.restore(up.state())
    assert (other.relay_id, other.round) == ("relay-x", 4)
    with pytest.raises(ValueError, match="no relay state"):
        other.restore({"mode": "sync"})


def test_a_closed_round_on_disk_reads_back_and_is_discarded(tmp_path: Path) -> None:
    assert pending.read(str(tmp_path)) is None
    closed = pending.Pending(3, 9, 2.0, 2, ("a-1", "b-1"), MEAN)
    pending.write(str(tmp_path), closed)
    pending.write(str(tmp_path), closed)  # a second write replaces the first
    got = pending.read(str(tmp_path))
    assert got is not None
    assert (got.relay_round, got.base, got.weight, got.count, got.receipts) == (
        3,
        9,
        2.0,
        2,
        ("a-1", "b-1"),
    )
    assert all(torch.equal(got.mean[n], MEAN[n]) for n in MEAN)
    assert [p.name for p in tmp_path.iterdir()] == [pending.FILE]  # no temporary left
    pending.discard(str(tmp_path))
    assert pending.read(str(tmp_path)) is None
