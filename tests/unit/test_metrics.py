"""The Prometheus text of /metrics: well formed for any status, full or a fresh server's."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from diloco.cli.status import render_status
from diloco.server.observe.metrics import render
from diloco.server.observe.status import Status
from diloco.server.web.counters import HttpCounters
from tests.helpers.metrics import parse, value
from tests.helpers.status import fresh


def worker(fields: dict[str, Any]) -> dict[str, Any]:
    """A worker's status: ``fields`` over a worker that reported nothing."""
    rest = {"registered_s_ago": 5.0, "submissions": 0, "step_age_s": None, "syncing": False,
            "smoothed_speed": None, "recommended_sync_every": None, "staleness": None}  # fmt: skip
    return {**rest, **fields}


FULL: dict[str, Any] = {
    **fresh(),
    "mode": "async",
    "instance": "abc123",
    "uptime_s": 12.5,
    "round": 7,
    "opened": True,
    "num_workers": 2,
    "min_workers": 1,
    "expected": ["a", "b"],
    "submitted": ["a"],
    "num_params": 1000,
    "model_bytes": 4000,
    "outer_optimizer": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
    "bytes_in": 123456,
    "bytes_out": 654321,
    "rejected_submissions": 2,
    "last_round_contributions": 2,
    "last_round_time_s": 1.25,
    "upload_slots": 2,
    "uploads_waiting": 1,
    "last_round_upload_wait_max_s": 0.75,
    "registrations": 5,
    "worker_deaths": 1,
    "staleness": {"last": 1, "mean": 0.5, "max": 3, "count": 8},
    "codecs": ["int8"],
    "allowed_codecs": ["bf16", "int8"],
    "last_round_bytes_in": 2100,
    "last_round_bytes_out": 8000,
    "workers": [
        worker({"worker_id": "a", "hostname": "h1", "loss": 2.5, "steps_per_second": 10.0,
                "last_seen_s_ago": 0.5, "bytes_in": 100, "bytes_out": 200, "last_round": 6,
                "codec": "int8"}),
        worker({"worker_id": 'we"ird\\id\n', "hostname": "h2", "loss": None,
                "steps_per_second": None, "last_seen_s_ago": 3.0, "bytes_in": 0, "bytes_out": 0,
                "last_round": None}),
    ],
}  # fmt: skip






def test_full_status() -> None:
    counters = HttpCounters(Counter({200: 5, 401: 2}), lambda: 2, lambda: 1)
    s = parse(render(Status.from_json(FULL), counters))
    assert value(s, "diloco_round") == 7
    assert value(s, "diloco_round_duration_seconds") == 1.25
    assert value(s, "diloco_bytes_in_total") == 123456
    assert value(s, "diloco_bytes_out_total") == 654321
    assert value(s, "diloco_workers_live") == 2
    assert value(s, "diloco_worker_deaths_total") == 1
    assert value(s, "diloco_registrations_total") == 5
    assert value(s, "diloco_outer_lr") == 0.7
    assert value(s, "diloco_staleness", 'stat="max"') == 3
    assert value(s, "diloco_staleness", 'stat="mean"') == 0.5
    assert value(s, "diloco_staleness_samples_total") == 8
    assert value(s, "diloco_worker_loss", 'worker="a"') == 2.5
    assert len(s["diloco_worker_loss"]) == 1  # no sample for a worker without a loss
    assert 'worker="we\\"ird\\\\id\\n"' in dict(s["diloco_worker_last_seen_seconds"])
    assert value(s, "diloco_http_responses_total", 'code="401"') == 2
    assert value(s, "diloco_auth_failures_total") == 2
    assert value(s, "diloco_auth_throttled_total") == 1
    assert value(s, "diloco_info", 'mode="async",instance="abc123"') == 1
    assert value(s, "diloco_upload_slots") == 2
    assert value(s, "diloco_uploads_waiting") == 1
    assert value(s, "diloco_last_round_upload_wait_max_seconds") == 0.75
    assert value(s, "diloco_round_bytes", 'direction="up"') == 2100
    assert value(s, "diloco_round_bytes", 'direction="down"') == 8000
    assert s["diloco_workers_by_codec"] == [('codec="int8"', 1)]  # b asked for none


def test_a_fresh_servers_status_is_still_valid() -> None:
    s = parse(render(Status.from_json(fresh())))
    assert value(s, "diloco_workers_live") == 0
    assert value(s, "diloco_round") == 0  # a typed status always has a round
    assert "diloco_staleness" not in s and "diloco_outer_lr" not in s


def test_non_finite_and_odd_values_are_dropped() -> None:
    st = Status.from_json(fresh())
    s = parse(render(dataclasses.replace(st, round=3, last_round_time_s=float("nan"),
                                         uptime_s=float("inf"))))  # fmt: skip
    assert value(s, "diloco_round") == 3
    assert "diloco_round_duration_seconds" not in s and "diloco_uptime_seconds" not in s


def test_status_table_shows_the_same_figures() -> None:
    text = render_status(Status.from_json(FULL))
    for expected in ("mode async", "round 7", "deaths 1", "registrations 5", "lr 0.7",
                     "staleness last 1", "max 3", "1.250 s", "2.5000",
                     "uploads: 2 slot(s), 1 waiting", "longest wait 0.750 s",
                     "codecs int8 (allowed bf16, int8)", "2.1 KB up, 7.8 KB down"):  # fmt: skip
        assert expected in text, expected
    assert "(no workers)" in render_status(Status.from_json(fresh()))
