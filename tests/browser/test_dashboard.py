"""The dashboard in a real browser: Playwright driving Debian's Chromium (``/usr/bin/chromium``;
``.ci/run`` installs it). Skipped only when that browser is absent.

Two workers run as threads against a server on loopback, one round every few tens of
milliseconds. A screenshot of the live page is kept in ``test-artifacts/dashboard.png``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from diloco.server.config import ServerConfig
from diloco.server.server import DiLoCoServer
from tests.helpers.dashboard import (
    ARTIFACTS,
    TOKEN,
    WAIT_MS,
    WORKERS,
    PacedWorker,
    Page,
    browser_fixture,  # noqa: F401 (the `browser` fixture)
    initial_params,
    playwright,
    row,
    shown_round,
    wait_until,
)

pytestmark = pytest.mark.browser

expect = playwright().expect


@pytest.fixture
def run() -> Iterator[DiLoCoServer]:
    server = DiLoCoServer(
        ServerConfig(
            port=0,
            num_workers=2,
            token=TOKEN,
            poll_timeout=0.2,
            heartbeat_timeout=0,
            stuck_timeout=0,
        ),
        initial_params=initial_params(),
    ).start()
    stop = threading.Event()
    workers = [PacedWorker(server.address, w, stop) for w in WORKERS]
    for w in workers:
        w.start()
    yield server
    stop.set()
    server.stop()
    for w in workers:
        w.join(10)


@pytest.fixture
def tab(browser: Any, run: DiLoCoServer) -> Iterator[Page]:
    page = Page(browser, run)
    yield page
    page.close()


def test_live_workers_with_no_network(tab: Page, run: DiLoCoServer) -> None:
    page = tab.open()
    for w in WORKERS:
        page.wait_for_selector(row(w), timeout=WAIT_MS)
    assert page.evaluate("sessionStorage.getItem('diloco.token')") == TOKEN
    # Both rows show a round that advances while the page refreshes itself.
    start = {w: shown_round(page, w) for w in WORKERS}
    for w in WORKERS:
        wait_until(lambda w=w: shown_round(page, w) >= start[w] + 2, f"{w}'s round to advance")
    page.wait_for_selector("#chart-loss polyline", state="attached", timeout=WAIT_MS)
    page.wait_for_selector("#chart-round-time polyline", state="attached", timeout=WAIT_MS)
    page.wait_for_selector("#chart-bytes polyline", state="attached", timeout=WAIT_MS)
    assert page.text_content("#s-mode") == "sync"
    assert int(page.text_content("#s-round").split()[0]) >= 2
    assert "params" in page.text_content("#s-model")
    assert "steps/s" in page.text_content("#s-throughput")
    assert page.text_content("#s-uploads").startswith("1 slot, 0 queued, ")
    assert page.text_content(f"{row(WORKERS[0])} td:nth-child(2)") == "host-a"
    assert page.locator(f"{row(WORKERS[0])} .health.ok").count() == 1
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    assert tab.outside == [], f"the page tried to reach outside the server: {tab.outside}"
    assert tab.errors == [], tab.errors


def loss_lines(page: Any) -> list[list[tuple[float, float]]]:
    """The loss chart's polylines (the mean first, then one per worker), in SVG coordinates."""
    lines = page.eval_on_selector_all(
        "#chart-loss polyline", "els => els.map(e => e.getAttribute('points'))"
    )
    return [[tuple(map(float, p.split(","))) for p in line.split()] for line in lines]


def chart_texts(page: Any) -> list[str]:
    return page.eval_on_selector_all("#chart-loss text", "els => els.map(e => e.textContent)")


def test_loss_chart_is_the_servers_history_by_round_and_by_steps(
    tab: Page, run: DiLoCoServer
) -> None:
    page = tab.open()
    wait_until(lambda: run.status()["round"] >= 6, "six rounds")
    # The mean and each worker, one point per round the server kept.
    wait_until(lambda: len(loss_lines(page)) == 3, "three loss lines")
    assert "round" in chart_texts(page) and {"mean", *WORKERS} <= set(chart_texts(page))
    wait_until(lambda: len(loss_lines(page)[0]) >= 5, "five rounds on the chart")
    # Against steps: the same points, the x axis named for them.
    page.select_option("#loss-x", "steps")
    wait_until(lambda: "inner steps" in chart_texts(page), "the steps axis")
    # A reload shows the rounds before it at once: the history is the server's.
    rounds_before = len(run.status()["loss_history"])
    page.reload()
    page.wait_for_selector("#chart-loss polyline", state="attached", timeout=WAIT_MS)
    assert len(loss_lines(page)[0]) >= rounds_before
    history = run.status()["loss_history"]
    assert history[0]["round"] == 0
    assert history[0]["workers"][0] == {"worker_id": WORKERS[0], "loss": 3.0, "steps": 10}
    # The mean line lies between the two workers' lines (SVG y grows downwards).
    mean, first, second = loss_lines(page)[:3]
    assert first[0][1] > mean[0][1] > second[0][1]
    assert tab.errors == [], tab.errors


def test_kick_evicts_a_worker(tab: Page, run: DiLoCoServer) -> None:
    page = tab.open()
    page.wait_for_selector(row(WORKERS[0]), timeout=WAIT_MS)
    page.click(f"{row(WORKERS[0])} button.kick")
    page.wait_for_selector(row(WORKERS[0]), state="detached", timeout=WAIT_MS)
    assert "kicked" in page.text_content("#message")
    ids = [w["worker_id"] for w in run.status()["workers"]]
    assert WORKERS[0] not in ids and WORKERS[1] in ids
    # The other worker trains on alone: its rounds still advance on the page.
    r = shown_round(page, WORKERS[1])
    wait_until(lambda: shown_round(page, WORKERS[1]) > r, "the other worker's round to advance")
    assert tab.errors == []


def test_lr_control_changes_the_server_optimizer(tab: Page, run: DiLoCoServer) -> None:
    page = tab.open()
    page.wait_for_selector(row(WORKERS[0]), timeout=WAIT_MS)
    page.fill("#lr-input", "0.25")
    page.fill("#momentum-input", "0.5")
    page.click("#optimizer-form button")
    expect(page.locator("#message")).to_contain_text("lr 0.25", timeout=WAIT_MS)
    groups = run.front.outer_optimizers()[0].param_groups
    assert all(g["lr"] == 0.25 and g["momentum"] == 0.5 for g in groups)
    assert run.status()["outer_optimizer"]["lr"] == 0.25
    expect(page.locator("#s-outer")).to_have_text("0.25 / 0.5", timeout=WAIT_MS)
    # A refused value is reported on the page and changes nothing.
    page.fill("#lr-input", "0")
    page.click("#optimizer-form button")
    page.wait_for_selector("#message.error", timeout=WAIT_MS)
    assert run.status()["outer_optimizer"]["lr"] == 0.25


def test_expected_workers_and_save_controls(tab: Page, run: DiLoCoServer) -> None:
    page = tab.open()
    page.wait_for_selector(row(WORKERS[0]), timeout=WAIT_MS)
    page.fill("#num-workers-input", "5")
    page.click("#workers-form button")
    expect(page.locator("#message")).to_contain_text("expected workers: 5", timeout=WAIT_MS)
    assert run.status()["num_workers"] == 5
    # This server has no --save-dir: the button is disabled and its tooltip says why.
    expect(page.locator("#save-state")).to_be_disabled(timeout=WAIT_MS)
    assert "--save-dir" in page.get_attribute("#save-state", "title")
    assert run.status()["save_dir"] is None


def test_without_the_token_the_page_shows_nothing(tab: Page, run: DiLoCoServer) -> None:
    page = tab.open(token=None)
    page.wait_for_selector("#login:not([hidden])", timeout=WAIT_MS)
    assert page.is_hidden("#main") and page.is_hidden("#summary")
    assert page.locator("#worker-table tbody tr").count() == 0
    assert [s for u, s in tab.statuses if u.endswith("/status")] == [401]
    # A wrong token is refused, forgotten, and still shows nothing.
    page.fill("#token-input", "not-the-token")
    page.click("#login-form button")
    expect(page.locator("#login-error")).to_contain_text("refused", timeout=WAIT_MS)
    assert page.evaluate("sessionStorage.getItem('diloco.token')") is None
    assert page.is_hidden("#main")
    html = page.content()
    assert all(w not in html for w in WORKERS)
    assert "host-a" not in html
    assert tab.outside == []


def test_shutdown_after_confirmation(tab: Page, run: DiLoCoServer) -> None:
    page = tab.open()
    page.wait_for_selector(row(WORKERS[0]), timeout=WAIT_MS)
    dialogs: list[str] = []

    def answer(dialog: Any) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss() if len(dialogs) == 1 else dialog.accept()

    page.on("dialog", answer)
    # Waits go through Playwright, not to the server alone: every request of the page passes
    # the route handler above, which runs only while this thread is inside a Playwright call, so
    # a plain wait holds back the very request it waits for (it did, once, in a clean-clone run),
    # or hides one that should not have been sent.
    page.click("#shutdown")  # dismissed: nothing happens
    page.wait_for_timeout(200)
    assert len(dialogs) == 1 and not run.wait_stopped(0)
    page.click("#shutdown")
    deadline = time.monotonic() + WAIT_MS / 1000
    while not run.wait_stopped(0):
        assert time.monotonic() < deadline, "the server did not stop"
        page.wait_for_timeout(20)
    assert "Shut the server down" in dialogs[1]
    expect(page.locator("#connection")).to_contain_text("shut down", timeout=WAIT_MS)
