"""Connections cut mid-upload and mid-download: retried, counted once, no progress lost."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from diloco import DiLoCoClient, DiLoCoServer, DiLoCoWorker, ServerConfig
from tests.helpers.faultproxy import Fault, FaultProxy
from tests.helpers.http import accept, body, register
from tests.helpers.workers import fake_step, params_of

RETRIES = 3
# An upload's first answer is the interim "100 Continue" (the body follows it); its reply's
# bytes come after.
CONTINUE = len(b"HTTP/1.1 100 Continue\r\n\r\n")


def make_model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Linear(64, 64)  # ~16 KB of fp32: bodies span many TCP segments


class Trial:
    """One worker (SGD lr 1, outer lr 1, no momentum) reaching its server through a fault
    proxy: each step moves every parameter by a known amount, so where the parameters end
    says which steps counted."""

    def __init__(self, server: DiLoCoServer, proxy: FaultProxy) -> None:
        self.server, self.proxy = server, proxy
        self.model = make_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1.0)
        self.start: dict[str, torch.Tensor] = {}

    @contextmanager
    def worker(self) -> Iterator[DiLoCoWorker]:
        """The worker, joined; ``start`` holds the parameters it joined with."""
        client = DiLoCoClient(self.proxy.address, retries=RETRIES, backoff=0.01, read_timeout=10)
        with DiLoCoWorker(
            self.model,
            self.opt,
            self.proxy.address,
            sync_every=2,
            heartbeat_interval=0,
            bf16_comm=False,
            client=client,
        ) as w:
            self.start = params_of(self.model)
            yield w

    def sync(self, delta: float) -> None:
        """Two steps of ``delta``: the second syncs."""
        fake_step(self.model, self.opt, delta)
        fake_step(self.model, self.opt, delta)

    def on_every_attempt(self, fault: Fault) -> None:
        """The fault on the first try and on each of the worker's retries of that request."""
        for _ in range(1 + RETRIES):
            self.proxy.add(Fault(fault.direction, fault.after, fault.prefix))

    def assert_model_moved(self, by: float) -> None:
        for name, p in self.model.named_parameters():
            torch.testing.assert_close(p.detach(), self.start[name] + by)

    def assert_server_moved(self, by: float) -> None:
        for name, t in self.server.global_params().items():
            torch.testing.assert_close(t, self.start[name] + by)


@pytest.fixture
def trial() -> Iterator[Trial]:
    server = DiLoCoServer(
        ServerConfig(port=0, num_workers=1, outer_lr=1.0, outer_momentum=0.0)
    ).start()
    proxy = FaultProxy(server.port)
    yield Trial(server, proxy)
    proxy.close()
    server.stop()


@pytest.mark.parametrize("cut_after", [100, 9000])
def test_upload_cut_midway_is_retried_and_counted_once(trial: Trial, cut_after: int) -> None:
    with trial.worker() as w:
        trial.proxy.add(Fault("up", cut_after, prefix=b"POST /submit_pseudograd"))
        trial.sync(0.5)
        assert trial.proxy.fired, "the fault never fired"
        m = w.sync_metrics
        assert (
            m["rounds"] == 1 and m["retries"] >= 1 and m["failed_syncs"] == 0 and m["rebases"] == 0
        )
    st = trial.server.status()
    # Round 0 got exactly one contribution; with outer lr 1 the global params moved by exactly +1.
    assert st["round"] == 1 and st["last_round_contributions"] == 1
    trial.assert_server_moved(1.0)


@pytest.mark.parametrize(
    "cut_down_after",
    [5, CONTINUE + 5],
    ids=["inside the 100: no body went", "the reply: the whole body went and counted"],
)
def test_upload_cut_on_the_way_down_is_retried_and_counted_once(
    trial: Trial, cut_down_after: int
) -> None:
    with trial.worker() as w:
        trial.proxy.add(Fault("down", cut_down_after, prefix=b"POST /submit_pseudograd"))
        trial.sync(0.25)
        assert trial.proxy.fired
        m = w.sync_metrics
        assert (
            m["rounds"] == 1
            and m["retries"] >= 1
            and m["failed_syncs"] == 0
            and m["rebases"] == 0
            and m["refused_submissions"] == 0
        )
    st = trial.server.status()
    assert st["round"] == 1 and st["last_round_contributions"] == 1
    trial.assert_server_moved(0.5)


@pytest.mark.parametrize("cut_after", [10, 12000])
def test_download_cut_midway_is_retried(trial: Trial, cut_after: int) -> None:
    with trial.worker() as w:
        trial.proxy.add(Fault("down", cut_after, prefix=b"GET /global_params?min_round=1"))
        trial.sync(0.5)
        assert trial.proxy.fired
        assert w.sync_metrics["rounds"] == 1 and w.sync_metrics["retries"] >= 1
        trial.assert_model_moved(1.0)
    assert trial.server.status()["round"] == 1


@pytest.mark.parametrize(
    ("cut_after", "dropped", "final_round"),
    [
        # Cut before the payload: the old snapshot is intact and the counted steps stay in the
        # model (the server holds them only in memory until round 1 is durable). The next sync
        # sends them again under the same id: "duplicate", so the steps mixed in since are
        # dropped (and counted), and round 1 is adopted.
        (10, 2, 1),
        # Cut inside the payload: round 1 was published, so the worker first fetches it in full;
        # its next upload is then on time and closes round 2.
        (12000, 0, 2),
    ],
)
def test_counted_upload_is_not_counted_again_after_its_download_failed(
    trial: Trial, cut_after: int, dropped: int, final_round: int
) -> None:
    """The upload is counted, then every download attempt breaks. Training goes on, but the
    counted steps must not count a second time."""
    with trial.worker() as w:
        trial.on_every_attempt(Fault("down", cut_after, prefix=b"GET /global_params?min_round=1"))
        trial.sync(0.5)  # +1 counted, round 1 closes, its download fails
        assert len(trial.proxy.fired) == 4
        assert trial.server.status()["round"] == 1
        trial.assert_server_moved(1.0)
        trial.sync(0.25)
        m = w.sync_metrics
        assert m["failed_syncs"] == 1 and m["refused_submissions"] == 0
        assert m["dropped_steps"] == dropped
        trial.assert_model_moved(1.5 - 0.25 * dropped)  # every step in the parameters once
    assert trial.server.status()["round"] == final_round


def test_upload_failing_part_way_leaves_the_model_trainable_and_loses_nothing(
    trial: Trial,
) -> None:
    """Cut every attempt of an upload after the first tensor went out: the model must keep its
    local values, and the next sync must deliver all the steps, once."""
    with trial.worker() as w:
        trial.on_every_attempt(Fault("up", 9000, prefix=b"POST /submit_pseudograd"))
        trial.sync(0.5)
        assert len(trial.proxy.fired) == 4 and w.sync_metrics["failed_syncs"] == 1
        assert trial.server.status()["round"] == 0
        trial.assert_model_moved(1.0)
        trial.sync(0.5)
        assert w.sync_metrics["rounds"] == 1
    assert trial.server.status()["round"] == 1
    trial.assert_server_moved(2.0)
    trial.assert_model_moved(2.0)


def test_upload_counted_but_every_answer_lost_is_not_counted_twice(trial: Trial) -> None:
    """The server counts the first attempt and every reply is cut: the worker cannot know. Its
    next sync sends under the same id, learns it was a duplicate, and drops the steps it has
    taken since (they cannot be told apart from the counted ones) instead of counting the
    first ones a second time."""
    with trial.worker() as w:
        trial.on_every_attempt(Fault("down", CONTINUE + 5, prefix=b"POST /submit_pseudograd"))
        trial.sync(0.25)
        assert len(trial.proxy.fired) == 4 and w.sync_metrics["failed_syncs"] == 1
        # Round 0 closed with the first attempt (+0.5); the worker still holds its local values.
        assert trial.server.status()["round"] == 1
        trial.sync(0.25)
        m = w.sync_metrics
        assert m["rounds"] == 1 and m["dropped_steps"] == 2 and m["rebases"] == 0
        trial.assert_model_moved(0.5)
    st = trial.server.status()
    # Only the first contribution ever counted; nothing was added twice (the exit sends nothing:
    # no steps since the last sync).
    assert st["round"] == 1
    trial.assert_server_moved(0.5)


def test_progress_of_a_failed_last_sync_is_handed_in_at_exit(trial: Trial) -> None:
    """The last sync's upload fails on every attempt and the loop ends right after: the model
    still holds those steps, so leaving hands them in (under the unanswered id) instead of
    dropping them with the sync's step counter."""
    with trial.worker() as w:
        trial.on_every_attempt(Fault("up", 9000, prefix=b"POST /submit_pseudograd"))
        trial.sync(0.5)
        assert len(trial.proxy.fired) == 4 and w.sync_metrics["failed_syncs"] == 1
        assert trial.server.status()["round"] == 0
    trial.assert_server_moved(1.0)
    assert w.sync_metrics["dropped_steps"] == 0


def test_a_late_answer_counts_the_first_body_and_drops_every_step_since() -> None:
    """Two syncs in a row lose every answer of an upload the server counted the first time:
    the third learns "duplicate" and drops all four steps taken since that first body, not only
    the last two."""
    server = DiLoCoServer(
        ServerConfig(port=0, num_workers=1, outer_lr=1.0, outer_momentum=0.0)
    ).start()
    proxy = FaultProxy(server.port)
    trial = Trial(server, proxy)
    try:
        with trial.worker() as w:
            trial.on_every_attempt(Fault("down", CONTINUE + 5, prefix=b"POST /submit_pseudograd"))
            trial.sync(0.25)  # counted, every answer lost
            trial.on_every_attempt(Fault("down", CONTINUE + 5, prefix=b"POST /submit_pseudograd"))
            trial.sync(0.25)  # the same id again: its answers are lost too
            assert w.sync_metrics["failed_syncs"] == 2
            trial.sync(0.25)
            m = w.sync_metrics
            assert m["rounds"] == 1 and m["dropped_steps"] == 4
        trial.assert_server_moved(0.5)
    finally:
        proxy.close()
        server.stop()


def test_progress_kept_by_a_rebase_is_handed_in_at_exit() -> None:
    """An async upload refused as too stale (action ``rebase``) keeps its steps on top of the
    newer parameters; when the loop ends right there, leaving hands them in."""
    server = DiLoCoServer(
        ServerConfig(
            port=0, num_workers=2, mode="async", max_staleness=0, outer_lr=1.0, outer_momentum=0.0
        )
    ).start()
    proxy = FaultProxy(server.port)
    trial = Trial(server, proxy)
    try:
        with trial.worker() as w:
            register(server, "other")
            other = {n: torch.full_like(p, -0.25) for n, p in trial.start.items()}
            accept(server, body("other", 0, "other-1", other))  # version 1: +0.25
            trial.sync(0.5)  # based on version 0: refused, rebased onto version 1
            m = w.sync_metrics
            assert m["refused_submissions"] == 1 and m["rebases"] == 1
            trial.assert_model_moved(1.25)
        trial.assert_server_moved(1.25)
        assert w.sync_metrics["dropped_steps"] == 0
    finally:
        proxy.close()
        server.stop()


def test_steps_since_a_counted_upload_are_dropped_when_a_restart_says_it_is_served(
    tmp_path: Path,
) -> None:
    """The upload counts and its round is saved, then every download breaks and the server
    restarts. At the next sync the re-join says the upload is in the served parameters: the
    worker adopts them, and the steps it took since (mixed into the values it replaces) are
    counted as dropped, so the ledger stays exact."""
    cfg = ServerConfig(
        port=0,
        num_workers=1,
        outer_lr=1.0,
        outer_momentum=0.0,
        save_dir=str(tmp_path),
        save_every=1,
        heartbeat_timeout=0,
    )
    server = DiLoCoServer(cfg).start()
    proxy = FaultProxy(server.port)
    trial = Trial(server, proxy)
    try:
        with trial.worker() as w:
            trial.on_every_attempt(Fault("down", 10, prefix=b"GET /global_params?min_round=1"))
            trial.sync(0.5)  # counted, round 1 closes and is saved; every download breaks
            assert w.sync_metrics["failed_syncs"] == 1
            server.stop()
            server = trial.server = DiLoCoServer(cfg).start()  # resumes round 1 from disk
            proxy.target = ("127.0.0.1", server.port)
            trial.sync(0.25)  # 410, re-join: the last upload is in the served parameters
            m = w.sync_metrics
            assert m["dropped_steps"] == 2 and m["rebases"] == 0
            trial.assert_model_moved(1.0)
        trial.assert_server_moved(1.0)
    finally:
        proxy.close()
        server.stop()
