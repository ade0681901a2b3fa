"""A worker whose model is not the run's is refused at ``POST /register`` and leaves no trace:
not in the registry, the expected count, ``/status``'s workers, nor any round's barrier, so the
good workers' rounds close as if it had never tried."""

from __future__ import annotations

from typing import Any

import requests

from diloco import DiLoCoServer, ServerConfig
from tests.helpers.http import TIMEOUT, accept, assert_error, body, post_json, url
from tests.helpers.servers import ServerFactory

GOOD = [["w", [3, 4]], ["b", [4]]]  # tests.helpers.servers.initial_params's table
BAD = [["w", [5, 3]], ["b", [5]]]  # a torch.nn.Linear(3, 5)


def register(server: DiLoCoServer, worker_id: str, table: list[Any]) -> requests.Response:
    return post_json(server, "/register", {"worker_id": worker_id, "info": {"params": table}})


def published(server: DiLoCoServer, round: int) -> bool:
    """Long-poll for ``round``: True once the server publishes it, False when its poll ends
    first (the round did not close). The server's publication is the event waited on."""
    resp = requests.get(
        url(server, f"/global_params?min_round={round}&worker_id=good"), timeout=TIMEOUT
    )
    assert resp.status_code in (200, 202), resp.text
    return resp.status_code == 200


def membership(server: DiLoCoServer) -> dict[str, Any]:
    st = server.status()
    return {
        "num_workers": st["num_workers"],
        "expected": st["expected"],
        "workers": [w["worker_id"] for w in st["workers"]],
        "registrations": st["registrations"],
    }


def test_a_refused_registration_leaves_the_rounds_as_they_were(
    make_server: ServerFactory,
) -> None:
    # poll_timeout short: a round held for the refused worker shows as a 202 in 2 s.
    server = make_server(num_workers=1, poll_timeout=2.0, join_timeout=0.0)
    assert register(server, "good", GOOD).status_code == 200
    before = membership(server)
    assert before == {
        "num_workers": 1,
        "expected": ["good"],
        "workers": ["good"],
        "registrations": 1,
    }
    # Refused while round 0 is open: before the fix it was counted, and round 1's barrier,
    # formed from the live workers when round 0 closed, waited for it.
    reply = assert_error(register(server, "bad", BAD), 409, "params_mismatch")
    assert "w has shape [5, 3], the run's is [3, 4]" in reply["detail"]
    assert membership(server) == before
    for round in (0, 1):
        accept(server, body("good", round, f"s-{round}", seed=round))
        assert published(server, round + 1)
    assert membership(server) == {**before, "expected": ["good"]}


def test_before_the_server_holds_parameters_the_first_table_is_the_runs() -> None:
    # No --init: the first worker will seed the parameters, so its table is the one to match.
    with DiLoCoServer(ServerConfig(port=0, num_workers=2, join_timeout=0.0)) as server:
        assert register(server, "good", GOOD).status_code == 200
        assert_error(register(server, "bad", BAD), 409, "params_mismatch")
        st = server.status()
        assert [w["worker_id"] for w in st["workers"]] == ["good"]
        assert st["num_workers"] == 2 and not st["opened"] and st["registrations"] == 1
        # The same tensors in another order are the same model to a parameter server.
        assert register(server, "twin", list(reversed(GOOD))).status_code == 200
        assert [w["worker_id"] for w in server.status()["workers"]] == ["good", "twin"]


def test_a_registration_without_a_table_is_not_checked(make_server: ServerFactory) -> None:
    # Older workers send no table; they check the server's themselves after registering.
    server = make_server(num_workers=1)
    resp = post_json(server, "/register", {"worker_id": "plain"})
    assert resp.status_code == 200 and resp.json()["params"] == GOOD
