"""The dashboard's panels against ``/status`` (issue 27), in Chromium through Playwright: each
test puts a server into a known state (uploads sent by hand, a kick, a silent worker, a
streaming worker that finished) and checks the page shows what ``/status`` says of it, plus
throughput before any heartbeat, the refresh selector and the Save button."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco import DiLoCoWorker
from diloco.server.config import ServerConfig
from diloco.server.server import DiLoCoServer
from diloco.wire import spec_of
from diloco.wire.messages import RegisterInfo
from diloco.worker.transport.client import DiLoCoClient
from tests.helpers.dashboard import (
    TOKEN,
    WAIT_MS,
    WORKERS,
    PacedWorker,
    Page,
    browser_fixture,  # noqa: F401 (the `browser` fixture)
    initial_params,
    playwright,
    row,
    wait_until,
)

pytestmark = pytest.mark.browser

expect = playwright().expect

GRADS = {"w": torch.full((3, 4), 0.01), "b": torch.full((4,), -0.01)}
SPECS = [spec_of(n, t) for n, t in GRADS.items()]


@pytest.fixture
def servers() -> Iterator[Any]:
    started: list[DiLoCoServer] = []

    def start(seeded: bool = True, **settings: Any) -> DiLoCoServer:
        """``seeded``: the server starts with parameters (else the first worker's)."""
        settings = {"port": 0, "token": TOKEN, "poll_timeout": 0.2, **settings}
        params = initial_params() if seeded and not settings.get("allreduce") else None
        server = DiLoCoServer(ServerConfig(**settings), initial_params=params).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def tabs(browser: Any) -> Iterator[Any]:
    opened: list[Page] = []

    def open_tab(server: DiLoCoServer, query: str = "?refresh=150") -> Any:
        tab = Page(browser, server)
        opened.append(tab)
        tab.page.goto(tab.origin + "/dashboard" + query)
        tab.page.wait_for_selector("#login:not([hidden])", timeout=WAIT_MS)
        tab.page.fill("#token-input", TOKEN)
        tab.page.click("#login-form button")
        tab.page.wait_for_selector("#main:not([hidden])", timeout=WAIT_MS)
        return tab

    yield open_tab
    for tab in opened:
        assert tab.outside == [] and tab.errors == [], (tab.outside, tab.errors)
        tab.close()


def client(server: DiLoCoServer) -> DiLoCoClient:
    return DiLoCoClient(server.address, token=TOKEN, retries=0, read_timeout=10)


def upload(c: DiLoCoClient, worker: str, round_: int, steps: int) -> None:
    c.submit_pseudogradients(
        worker, round_, f"{worker}-{round_}", SPECS, lambda s: GRADS[s.name], steps=steps
    )


def shows(page: Any, selector: str, text: str) -> None:
    expect(page.locator(selector)).to_have_text(text, timeout=WAIT_MS)


def agrees(page: Any, server: DiLoCoServer, selector: str, text: Any) -> None:
    """Wait until the page shows ``text(status)`` of a status taken at the same moment (the
    run may still be settling)."""
    wait_until(
        lambda: page.text_content(selector) == text(server.status()),
        f"{selector} to show what /status says",
    )


def number(text: str | None) -> float:
    try:
        return float(text or "")
    except ValueError:
        return 0.0  # "-": nothing known yet


def test_sync_panel_pending_dylu_and_save_are_the_status(
    servers: Any, tabs: Any, tmp_path: Path
) -> None:
    server = servers(
        num_workers=2, dylu=True, save_dir=str(tmp_path), heartbeat_timeout=0, join_timeout=0
    )
    c = client(server)
    try:
        c.register("a", hostname="host-a", info=RegisterInfo(sync_every=100))
        c.register("b", hostname="host-b", info=RegisterInfo(sync_every=50))
        upload(c, "a", 0, steps=100)  # b has not submitted: round 0 stays open
        st = server.status()
        assert (len(st["submitted"]), len(st["expected"])) == (1, 2)
        page = tabs(server).page
        shows(page, "#m-pending", "1/2 submitted")
        each = ", ".join(
            f"{w['worker_id']} {w['sync_every']}→{w['recommended_sync_every']}"
            for w in st["workers"]
        )
        assert "a 100→" in each and "b 50→" in each
        shows(page, "#m-dylu", "on: " + each)
        assert page.is_hidden("#m-dn-row")  # sync: no Delayed Nesterov buffer
        shows(page, "#m-fragments", "1 / 1 fragment")
        # A save dir: Save is enabled and saves there.
        expect(page.locator("#save-state")).to_be_enabled(timeout=WAIT_MS)
        assert str(tmp_path) in page.get_attribute("#save-state", "title")
        page.click("#save-state")
        expect(page.locator("#message")).to_contain_text("saved round 0", timeout=WAIT_MS)
        assert server.status()["last_save"]["round"] == 0
        upload(c, "b", 0, steps=50)  # the round closes; the next one has no submission
        shows(page, "#m-pending", "0/2 submitted")
        shows(page, "#m-fragments", "2 / 1 fragment")
        assert server.status()["submissions"] == 2
    finally:
        c.close()


def test_async_panel_shows_the_delayed_nesterov_buffer(servers: Any, tabs: Any) -> None:
    server = servers(num_workers=1, mode="async", dn_buffer_size=3, heartbeat_timeout=0)
    c = client(server)
    try:
        c.register("a", hostname="host-a")
        page = tabs(server).page
        shows(page, "#m-dn", "0/3")
        for n in range(2):
            upload(c, "a", n, steps=10 * (n + 1))  # each applied at once: the base moves on
            wait_until(lambda n=n: server.status()["updates"] == n + 1, f"update {n + 1}")
        wait_until(lambda: server.status()["dn_buffered"] == [2], "two arrivals in the buffer")
        shows(page, "#m-dn", "2/3")
        assert server.status()["delayed_nesterov"]["buffer_size"] == 3
        shows(page, "#m-pending", "0 uploading (async: applied as they arrive)")
        shows(page, "#m-dylu", "off")
    finally:
        c.close()


def test_deaths_count_evictions_and_kicks(servers: Any, tabs: Any) -> None:
    server = servers(num_workers=2, heartbeat_timeout=1.0, join_timeout=0)
    c = client(server)
    try:
        c.register("kicked", hostname="h")
        page = tabs(server).page
        page.click(f"{row('kicked')} button.kick")
        page.wait_for_selector(row("kicked"), state="detached", timeout=WAIT_MS)
        shows(page, "#m-deaths", "0 evicted, 1 kicked")
        c.register("silent", hostname="h")  # never heard from again: evicted after 1 s
        page.wait_for_selector(row("silent"), timeout=WAIT_MS)
        page.wait_for_selector(row("silent"), state="detached", timeout=WAIT_MS)
        st = server.status()
        assert (st["worker_deaths"], st["kicks"]) == (1, 1)
        shows(page, "#m-deaths", "1 evicted, 1 kicked")
    finally:
        c.close()


def test_fragments_panel_after_a_streaming_worker(servers: Any, tabs: Any) -> None:
    server = servers(seeded=False, num_workers=1, heartbeat_timeout=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 4))  # seeds the server
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with DiLoCoWorker(
        model, optimizer, server.address, sync_every=4, num_fragments=2, token=TOKEN,
        heartbeat_interval=0, worker_id="streamer",
    ) as worker:  # fmt: skip
        for _ in range(16):
            model(torch.randn(2, 3)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert worker.sync_metrics["fragments_sent"] >= 8
    st = server.status()
    assert len(st["fragments"]) == 2 and st["submissions"] >= 8
    page = tabs(server).page
    agrees(
        page,
        server,
        "#m-fragments",
        lambda st: f"{st['submissions']} / 2 fragments ({st['fragment_pattern']})",
    )
    agrees(
        page,
        server,
        "#m-pending",
        lambda st: ", ".join(
            f"f{f['fragment']} {len(f['submitted'])}/{len(st['expected'])}" for f in st["fragments"]
        ),
    )


def test_steps_per_second_before_any_heartbeat(servers: Any, tabs: Any) -> None:
    server = servers(num_workers=2, heartbeat_timeout=0, stuck_timeout=0)
    stop = threading.Event()
    workers = [PacedWorker(server.address, w, stop, heartbeats=False) for w in WORKERS]
    for w in workers:
        w.start()
    try:
        page = tabs(server).page
        for w in WORKERS:
            wait_until(
                lambda w=w: number(page.text_content(f"{row(w)} .worker-speed")) > 0,
                f"{w}'s steps/s",
            )
        throughput = page.text_content("#s-throughput") or ""
        steps, rest = throughput.split(" steps/s")
        assert number(steps) > 0 and rest.startswith(", ") and rest.endswith("/s")
        assert not rest.startswith(", 0 B/s")
        st = server.status()
        assert st["steps_per_second"] > 0 and st["bytes_per_second"] > 0
        # No heartbeat was sent: the speed is the uploads' step counts over time.
        assert all(w.heartbeats is False for w in workers)
    finally:
        stop.set()
        for w in workers:
            w.join(10)


def status_polls(tab: Page) -> int:
    return sum(1 for u, _ in tab.statuses if "/status" in u)


def test_refresh_selector_sets_the_polling_interval(servers: Any, tabs: Any) -> None:
    server = servers(num_workers=1)
    tab = tabs(server, query="")  # no ?refresh=: the selector's default, 1 s
    page = tab.page
    assert page.input_value("#refresh") == "1000"
    page.select_option("#refresh", "30000")
    page.wait_for_timeout(300)  # a poll already on its way may land
    before = status_polls(tab)
    page.wait_for_timeout(2500)  # waits through Playwright, so the page's requests flow
    assert status_polls(tab) == before, "polled within 2.5 s at a 30 s interval"
    page.select_option("#refresh", "1000")
    before = status_polls(tab)
    page.wait_for_timeout(3500)
    assert 2 <= status_polls(tab) - before <= 5
    # Kept in this browser: a reload comes back with the choice.
    page.select_option("#refresh", "5000")
    assert page.evaluate("localStorage.getItem('diloco.refresh')") == "5000"
    page.reload()
    page.wait_for_selector("#main:not([hidden])", timeout=WAIT_MS)
    assert page.input_value("#refresh") == "5000"


def test_save_is_disabled_without_a_save_dir(servers: Any, tabs: Any) -> None:
    server = servers(num_workers=1)
    page = tabs(server).page
    expect(page.locator("#save-state")).to_be_disabled(timeout=WAIT_MS)
    title = page.get_attribute("#save-state", "title") or ""
    assert "no save directory" in title and "--save-dir" in title
    assert server.status()["save_dir"] is None


def test_allreduce_shows_quorums_and_hides_the_parameter_servers_panels(
    servers: Any, tabs: Any
) -> None:
    server = servers(num_workers=2, allreduce=True)
    page = tabs(server).page
    shows(page, "#m-quorum", "none open")
    st = server.status()
    shows(
        page,
        "#m-quorum-rounds",
        f"{st['rounds_completed']} completed, {st['rounds_discarded']} discarded",
    )
    shows(page, "#m-excluded", "none")
    for hidden in ("#m-pending", "#m-dylu", "#m-fragments", "#m-dn"):
        assert page.is_hidden(hidden), hidden
    assert page.is_visible("#m-deaths") and page.is_visible("#s-outer")


def test_hierarchy_row_shows_a_relays_upstream_and_an_upstreams_relays(
    servers: Any, tabs: Any
) -> None:
    upstream = servers()
    relay = servers(seeded=False, upstream=upstream.address, upstream_token=TOKEN)
    wait_until(lambda: relay.status()["upstream"]["round"] == 0, "the relay to join upstream")
    st = relay.status()["upstream"]
    relay_page = tabs(relay).page
    shows(relay_page, "#m-hierarchy", f"relay of {st['url']}, upstream round 0, last upload -")
    (entry,) = upstream.status()["workers"]
    assert entry["worker_id"] == st["relay_id"] and entry["region"] == 0
    up_page = tabs(upstream).page
    shows(up_page, "#m-hierarchy", f"relays: {st['relay_id']} (0 workers)")
    plain = tabs(servers()).page  # neither: the row stays hidden once the panel is drawn
    shows(plain, "#m-deaths", "0 evicted, 0 kicked")
    expect(plain.locator("#m-hierarchy-row")).to_be_hidden(timeout=WAIT_MS)
