"""The dashboard's browser tests' shared parts (tests/browser/): paced workers as threads, a
browser tab that may reach the server only, and waits that go through Playwright."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco.server.server import DiLoCoServer
from diloco.wire import spec_of
from diloco.worker.transport.client import DiLoCoClient

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
TOKEN = "browser-token-123"
WORKERS = ("alpha-worker", "beta-worker")
WAIT_MS = 15_000


def playwright() -> Any:
    """Playwright's sync API, or the calling test module skipped when Chromium or Playwright
    is absent (call it at module level)."""
    if not CHROMIUM.exists():
        pytest.skip(
            f"{CHROMIUM} is not installed (apt-get install chromium)", allow_module_level=True
        )
    return pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="module", name="browser")
def browser_fixture() -> Iterator[Any]:
    """``browser``: one headless Chromium per test module (import it into the module)."""
    with playwright().sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        yield b
        b.close()


def initial_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}


def loss(worker_id: str, round_: int) -> float:
    return (3.0 if worker_id == WORKERS[0] else 4.0) / (1 + 0.1 * round_)


class PacedWorker(threading.Thread):
    """Submits a pseudo-gradient each round with a falling loss and its step count (10 steps a
    round), adopts the result; stops when told, or when the server no longer knows it (kicked)
    or goes away."""

    def __init__(
        self, address: str, worker_id: str, stop: threading.Event, *, heartbeats: bool = True
    ) -> None:
        super().__init__(name=f"worker-{worker_id}", daemon=True)
        self.address, self.worker_id, self.stop = address, worker_id, stop
        self.heartbeats = heartbeats  # off: the server learns its speed from its uploads alone
        self.rounds = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        client = DiLoCoClient(self.address, token=TOKEN, retries=0, read_timeout=10)
        grads = {"w": torch.full((3, 4), 0.01), "b": torch.full((4,), -0.01)}
        specs = [spec_of(n, t) for n, t in grads.items()]
        try:
            reply = client.register(self.worker_id, hostname=f"host-{self.worker_id[0]}")
            round_ = reply["round"]
            while not self.stop.is_set():
                client.submit_pseudogradients(
                    self.worker_id, round_, f"{self.worker_id}-{round_}", specs,
                    lambda s: grads[s.name], loss=loss(self.worker_id, round_),
                    steps=10 * (round_ + 1),
                )  # fmt: skip
                if self.heartbeats:
                    client.heartbeat(
                        self.worker_id, loss=3.0 / (1 + 0.1 * round_), steps_per_second=20.0
                    )
                while not self.stop.is_set():
                    got = client.download(
                        lambda layout: memoryview(bytearray(layout.payload_size)),
                        min_round=round_ + 1,
                        worker_id=self.worker_id,
                    )
                    if got is not None:
                        round_ = got.round
                        break
                self.rounds += 1
                self.stop.wait(0.03)  # the time "training" takes between syncs
        except Exception as exc:  # kicked (410), or the server stopped
            self.error = exc
        finally:
            client.close()


class Page:
    """A tab on the dashboard that may reach the server only: every other request is refused
    and recorded, and console errors (a CSP violation, a script error) are recorded too."""

    def __init__(self, browser: Any, server: DiLoCoServer) -> None:
        self.origin = f"http://{server.address}"
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000})
        self.page = self.context.new_page()
        self.outside: list[str] = []
        self.errors: list[str] = []
        self.statuses: list[tuple[str, int]] = []
        self.page.route("**/*", self._route)
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("response", lambda r: self.statuses.append((r.url, r.status)))

    def _console(self, message: Any) -> None:
        # The first look at /status without a token is answered 401 on purpose.
        if message.type == "error" and "status of 401" not in message.text:
            self.errors.append(message.text)

    def _route(self, route: Any) -> None:
        if route.request.url.startswith(self.origin + "/"):
            route.continue_()
        else:
            self.outside.append(route.request.url)
            route.abort()

    def open(self, token: str | None = TOKEN) -> Any:
        self.page.goto(self.origin + "/dashboard?refresh=150")
        if token is not None:
            self.page.wait_for_selector("#login:not([hidden])", timeout=WAIT_MS)
            self.page.fill("#token-input", token)
            self.page.click("#login-form button")
        return self.page

    def close(self) -> None:
        self.context.close()


def row(worker: str) -> str:
    return f'#worker-table tbody tr[data-worker="{worker}"]'


def shown_round(page: Any, worker: str) -> int:
    return int(page.text_content(f"{row(worker)} .worker-round"))


def wait_until(predicate: Any, what: str, timeout: float = WAIT_MS / 1000) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
