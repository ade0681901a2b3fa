"""The server's HTTP API from a test: URLs, tensor bodies in the safetensors layout, posting
them, reading replies and errors, and the exact outer step the sync tests compute by hand."""

from __future__ import annotations

import json
import struct
import time
from typing import Any

import requests
import torch

from diloco.server.server import DiLoCoServer
from diloco.wire import encode

TIMEOUT = 10.0


TOKEN = "secret-token-123"


AUTH = {"Authorization": f"Bearer {TOKEN}"}


CLIENT = {"X-Diloco-Client": "test"}  # state-changing requests need it (the cross-site rule)


EXACT = {"outer_lr": 1.0, "outer_momentum": 0.0}  # new params = old params - mean pseudo-gradient


def pseudo_grad(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return {
        "w": torch.randn(3, 4, generator=g).to(dtype),
        "b": torch.randn(4, generator=g).to(dtype),
    }


def url(server: DiLoCoServer, path: str) -> str:
    return f"http://{server.address}{path}"


def post_json(
    server: DiLoCoServer, path: str, body: Any, headers: dict[str, str] | None = None
) -> requests.Response:
    return requests.post(
        url(server, path), json=body, headers={**CLIENT, **(headers or {})}, timeout=TIMEOUT
    )


def post_raw(
    server: DiLoCoServer, path: str, data: bytes, headers: dict[str, str] | None = None
) -> requests.Response:
    hdrs = {"Content-Type": "application/octet-stream", **CLIENT, **(headers or {})}
    return requests.post(url(server, path), data=data, headers=hdrs, timeout=TIMEOUT)


def register(
    server: DiLoCoServer, worker_id: str, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    resp = post_json(server, "/register", {"worker_id": worker_id}, headers)
    assert resp.status_code == 200, resp.text
    reply = resp.json()
    assert reply["worker_id"] == worker_id
    return reply


def body(
    worker_id: str | None,
    base_round: int | str | None,
    submission_id: str | None,
    tensors: dict[str, torch.Tensor] | None = None,
    *,
    seed: int = 0,
    weight: float | str | None = None,
) -> bytes:
    meta: dict[str, str] = {}
    if worker_id is not None:
        meta["worker_id"] = worker_id
    if base_round is not None:
        meta["base_round"] = str(base_round)
    if submission_id is not None:
        meta["submission_id"] = submission_id
    if weight is not None:
        meta["weight"] = str(weight)
    return encode(pseudo_grad(seed) if tensors is None else tensors, meta or None)


def submit(
    server: DiLoCoServer, data: bytes, headers: dict[str, str] | None = None
) -> requests.Response:
    return post_raw(server, "/submit_pseudograd", data, headers)


def accept(
    server: DiLoCoServer, data: bytes, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    resp = submit(server, data, headers)
    assert resp.status_code == 200, resp.text
    reply = resp.json()
    assert reply["status"] == "accepted", reply
    return reply


def status(server: DiLoCoServer) -> dict[str, Any]:
    return server.status()


def wait_round(server: DiLoCoServer, n: int, timeout: float = TIMEOUT) -> dict[str, Any]:
    """Poll the server's own status until its round reaches ``n`` (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        st = status(server)
        if st["round"] >= n and not st["closing"]:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"round {n} not reached in {timeout}s: {st}")
        time.sleep(0.005)


def state(server: DiLoCoServer) -> dict[str, Any]:
    st = status(server)
    return {
        "params": server.global_params(),
        "round": st["round"],
        "opened": st["opened"],
        "closing": st["closing"],
        "workers": sorted(w["worker_id"] for w in st["workers"]),
        "expected": st["expected"],
        "submitted": st["submitted"],
        "uploading": st["uploading"],
        "bytes_in": st["bytes_in"],
        "registrations": st["registrations"],
        "per_worker": {
            w["worker_id"]: (
                w["hostname"],
                w["submissions"],
                w["bytes_in"],
                w["last_round"],
                w["steps_per_second"],
                w["loss"],
            )
            for w in st["workers"]
        },
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def assert_params_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.float32, name
        assert torch.equal(bits(a[name]), bits(b[name])), name


def assert_unchanged(before: dict[str, Any], server: DiLoCoServer) -> None:
    after = state(server)
    assert_params_equal(before.pop("params"), after.pop("params"))
    assert after == before


def assert_error(resp: requests.Response, status_code: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status_code, resp.text
    assert resp.headers["Content-Type"].startswith("application/json")
    reply = resp.json()
    assert reply["error"] == code, reply
    assert isinstance(reply["detail"], str) and reply["detail"].strip(), reply
    return reply


def expected_exact(
    old: dict[str, torch.Tensor], *grads: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """old - mean(grads), computed the way an fp32 running sum would."""
    out = {}
    for name, p in old.items():
        acc = torch.zeros_like(p)
        for g in grads:
            acc = acc + g[name].float()
        out[name] = p - acc / len(grads)
    return out


def finish_round0(server: DiLoCoServer, old: dict[str, torch.Tensor]) -> None:
    """b contributes; the round must close with exactly a's and b's contributions."""
    accept(server, body("b", 0, "b-0", seed=2))
    wait_round(server, 1)
    assert_params_equal(server.global_params(), expected_exact(old, pseudo_grad(1), pseudo_grad(2)))


def parse_safetensors_metadata(data: bytes) -> dict[str, str]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n])["__metadata__"]
