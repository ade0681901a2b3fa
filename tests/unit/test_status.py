"""The typed status (server/observe/status.py): its JSON keys, its parsing, and the keys the
dashboard reads. A renamed field must break one of these tests, not show ``-`` on a page."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from diloco.server.config import ServerConfig
from diloco.server.observe.records import (
    DelayedNesterovSettings,
    FragmentStatus,
    LeftOutStatus,
    OuterOptimizer,
    QuorumStatus,
    RoundLoss,
    UpdateEntry,
    UpstreamStatus,
    WorkerLoss,
    WorkerStatus,
)
from diloco.server.observe.status import Status, build_status
from diloco.server.observe.status_json import StatusFormatError
from diloco.server.observe.swarm_records import (
    BoundaryStatus,
    StageStatus,
    SuspectStatus,
    SwarmStatus,
)
from diloco.server.params.store import ParamStore
from diloco.server.paramserver.coordinator import Coordinator
from diloco.wire.messages import Register, RegisterInfo
from tests.helpers.clock import FakeClock
from tests.helpers.status import assert_keys, fresh

APP_JS = Path(__file__).parents[2] / "src" / "diloco" / "server" / "web" / "dashboard" / "app.js"


def test_a_fresh_status_has_every_field_and_round_trips() -> None:
    st = fresh()
    assert_keys(Status, st)
    assert Status.from_json(st).to_json() == st


def test_from_json_raises_on_a_missing_or_renamed_field() -> None:
    st = fresh()
    st["rounds"] = st.pop("round")  # a rename on the server's side
    with pytest.raises(StatusFormatError, match="'round'"):
        Status.from_json(st)
    st = fresh()
    st["workers"] = [{"worker_id": "a"}]
    with pytest.raises(StatusFormatError, match=r"status\.workers\[0\]: no field 'hostname'"):
        Status.from_json(st)
    with pytest.raises(StatusFormatError, match="expected an object"):
        Status.from_json([])


def test_from_json_ignores_unknown_fields_of_a_newer_server() -> None:
    st = {**fresh(), "a_field_of_tomorrow": 1}
    assert Status.from_json(st).to_json() == fresh()


def test_fields_omitted_while_none_are_optional_in_json() -> None:
    assert Status.from_json({**fresh(), "outer_optimizer": {"lr": 0.5}}).outer_optimizer == (
        OuterOptimizer(lr=0.5, momentum=None)
    )
    with pytest.raises(StatusFormatError, match="'lr'"):
        Status.from_json({**fresh(), "outer_optimizer": {"momentum": 0.9}})


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fragment_statuses_have_their_fields(mode: str) -> None:
    config = ServerConfig(port=0, num_workers=1, mode=mode, num_fragments=2)
    store = ParamStore.from_tensors({"w": torch.zeros(4), "b": torch.zeros(6)})
    coord = Coordinator(config, store, clock=FakeClock())
    coord.membership.register(Register("a", info=RegisterInfo(num_fragments=2)), "h")
    st = coord.status().to_json()
    assert_keys(Status, st)
    assert len(st["fragments"]) == 2
    sync_only = {"submitted", "closing"}
    assert (sync_only <= set(st["fragments"][0])) == (mode == "sync")
    assert Status.from_json(st) == build_status(coord)


def test_update_entries_keep_their_json_keys() -> None:
    names = [f.name for f in dataclasses.fields(UpdateEntry)]
    assert names[:7] == [
        "round", "fragment", "t", "round_time_s", "outer_step_s", "contributions", "bytes_in"
    ]  # fmt: skip


# --- the dashboard ---------------------------------------------------------------------------

# How app.js names the parts of a /status document it reads (see its renderSummary, record,
# renderWorkers, lossSeries): ``st`` the status, ``opt`` its outer_optimizer, ``w`` a worker,
# ``u`` an update_log entry, ``entry`` a loss_history round, ``wl`` one worker's report in it;
# the server panel's ``dn`` (delayed_nesterov), ``f`` a fragment, ``q`` the open quorum, ``l``
# a worker left out of the quorums; swarm mode's ``sw`` and its ``stg`` (a stage), ``bnd`` (a
# boundary), ``sus`` (a suspect).
DASHBOARD_NAMES: dict[str, tuple[type, str]] = {
    "st": (Status, r"\bst"),
    "opt": (OuterOptimizer, r"\bopt"),
    "w": (WorkerStatus, r"\bw"),
    "u": (UpdateEntry, r"\bu"),
    "entry": (RoundLoss, r"\bentry"),
    "wl": (WorkerLoss, r"\bwl"),
    "dn": (DelayedNesterovSettings, r"\bdn"),
    "f": (FragmentStatus, r"\bf"),
    "q": (QuorumStatus, r"\bq"),
    "l": (LeftOutStatus, r"\bl"),
    "sw": (SwarmStatus, r"\bsw"),
    "stg": (StageStatus, r"\bstg"),
    "bnd": (BoundaryStatus, r"\bbnd"),
    "sus": (SuspectStatus, r"\bsus"),
    "up": (UpstreamStatus, r"\bup"),
}


def dashboard_keys(source: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for name, (_, pattern) in DASHBOARD_NAMES.items():
        dotted = re.findall(pattern + r"\.([A-Za-z_]\w*)", source)
        indexed = re.findall(pattern + r"\[\s*[\"']([A-Za-z_]\w*)[\"']\s*\]", source)
        found[name] = set(dotted) | set(indexed)
    return found


def test_every_status_key_the_dashboard_reads_is_a_field() -> None:
    source = APP_JS.read_text()
    assert 'const st = await api("GET", statusPath());' in source  # the status is named ``st``
    assert "const opt = st.outer_optimizer || {};" in source
    keys = dashboard_keys(source)
    for name, (cls, _) in DASHBOARD_NAMES.items():
        assert keys[name], f"app.js no longer reads {name}.*: update DASHBOARD_NAMES"
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = keys[name] - fields
        assert not unknown, f"app.js reads {name}.{sorted(unknown)}: no such {cls.__name__} field"
    # What it shows today: a rename of any of these fields fails here.
    assert {"round", "workers", "update_log", "num_workers", "upload_slots"} <= keys["st"]
    assert {"worker_id", "loss", "last_seen_s_ago", "staleness", "codec"} <= keys["w"]
    assert {"codecs", "last_round_bytes_in", "last_round_bytes_out"} <= keys["st"]
    assert {"round_bytes_in", "round_bytes_out"} <= keys["u"]
    assert {"round", "workers", "mean_loss"} <= keys["entry"]
    assert {"worker_id", "loss", "steps"} <= keys["wl"]
    # The server panel and the throughput (issue 27).
    assert {"steps_per_second", "bytes_per_second", "submissions", "dn_buffered"} <= keys["st"]
    assert {"expected", "submitted", "worker_deaths", "kicks", "dylu", "save_dir"} <= keys["st"]
    assert {"quorum", "pending_quorum", "excluded_last", "left_out"} <= keys["st"]
    assert {"sync_every", "recommended_sync_every", "steps_per_second"} <= keys["w"]
    assert {"buffer_size"} <= keys["dn"] and {"fragment", "submitted"} <= keys["f"]
    assert {"url", "round", "last_upload_bytes"} <= keys["up"] and "region" in keys["w"]


def test_the_dashboard_key_check_catches_a_rename() -> None:
    source = APP_JS.read_text().replace("st.uploads_waiting", "st.uploads_queued")
    assert "uploads_queued" in dashboard_keys(source)["st"]
    assert "uploads_queued" not in {f.name for f in dataclasses.fields(Status)}


def test_the_cli_table_refuses_a_status_it_cannot_read(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from diloco.cli.main import main
    from diloco.worker import DiLoCoClient

    st = fresh()
    del st["num_workers"]
    monkeypatch.setattr(DiLoCoClient, "status", lambda self: st)
    assert main(["status", "--server", "127.0.0.1:1"]) == 1
    assert "no field 'num_workers'" in capsys.readouterr().err
    assert main(["status", "--server", "127.0.0.1:1", "--json"]) == 0  # raw JSON still shown
