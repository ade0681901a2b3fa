"""The loss that travels with uploads: the server's per-round history in /status."""

from __future__ import annotations

from typing import Any

import pytest
import requests
import torch

from diloco.server.observe.loss_history import LossHistory
from diloco.server.observe.status import Status
from diloco.wire import encode, spec_of
from diloco.worker.transport.client import DiLoCoClient
from tests.helpers.clock import FakeClock
from tests.helpers.http import TIMEOUT, submit, url, wait_round
from tests.helpers.servers import ServerFactory
from tests.helpers.status import assert_keys


def upload(client: DiLoCoClient, worker: str, round_: int, **progress: Any) -> None:
    grads = {"w": torch.zeros(3, 4), "b": torch.zeros(4)}
    specs = [spec_of(n, t) for n, t in grads.items()]
    reply = client.submit_pseudogradients(
        worker, round_, f"{worker}-{round_}", specs, lambda s: grads[s.name], **progress
    )
    assert reply["status"] == "accepted", reply


def test_uploads_carry_loss_and_steps_into_the_history(make_server: ServerFactory) -> None:
    server = make_server(num_workers=2)
    client = DiLoCoClient(server.address, retries=0)
    for w in ("a", "b"):
        client.register(w, hostname="h")
    upload(client, "a", 0, loss=2.0, steps=10)
    upload(client, "b", 0, loss=3.0, steps=12)
    wait_round(server, 1)
    upload(client, "a", 1, loss=1.5, steps=20)
    upload(client, "b", 1, steps=24)  # no loss reported yet: steps only
    wait_round(server, 2)
    st = requests.get(url(server, "/status"), timeout=TIMEOUT).json()
    assert_keys(Status, st)
    assert Status.from_json(st).to_json() == st
    history = st["loss_history"]
    assert [h["round"] for h in history] == [0, 1]
    assert history[0]["mean_loss"] == 2.5 and history[1]["mean_loss"] == 1.5
    assert history[0]["workers"] == [
        {"worker_id": "a", "loss": 2.0, "steps": 10},
        {"worker_id": "b", "loss": 3.0, "steps": 12},
    ]
    assert history[1]["workers"][1] == {"worker_id": "b", "loss": None, "steps": 24}
    assert history[0]["t"] <= history[1]["t"]
    # The upload's loss is the worker's latest, as a heartbeat's would be.
    assert {w["worker_id"]: w["loss"] for w in st["workers"]} == {"a": 1.5, "b": 3.0}
    since = requests.get(url(server, "/status?history_since=1"), timeout=TIMEOUT).json()
    assert [h["round"] for h in since["loss_history"]] == [1]
    client.close()


@pytest.mark.parametrize(("key", "value"), [("loss", "nan"), ("loss", "low"), ("steps", "-1")])
def test_a_bad_loss_or_step_count_is_refused(
    make_server: ServerFactory, key: str, value: str
) -> None:
    server = make_server()
    DiLoCoClient(server.address).register("a", hostname="h")
    meta = {"worker_id": "a", "base_round": "0", "submission_id": "s", key: value}
    resp = submit(server, encode({"w": torch.zeros(3, 4), "b": torch.zeros(4)}, meta))
    assert resp.status_code == 400 and resp.json()["error"] == "bad_metadata", resp.text
    assert server.status()["loss_history"] == []


def test_the_history_is_bounded_and_in_round_order() -> None:
    history = LossHistory(FakeClock(), rounds=3)
    for r in range(5):
        history.record(r, "a", float(r), r * 10)
    history.record(3, "b", 1.0, None)  # a second worker in a kept round
    history.record(1, "c", 1.0, 5)  # older than all kept once the bound applies: dropped
    history.record(9, "a", None, None)  # nothing said: nothing kept
    entries = history.entries(0, 0.0)
    assert [e.round for e in entries] == [2, 3, 4]
    assert entries[1].mean_loss == 2.0 and len(entries[1].workers) == 2
    assert [e.round for e in history.entries(4, 0.0)] == [4]
