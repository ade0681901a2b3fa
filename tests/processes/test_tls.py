"""Security against a real server on loopback: every endpoint behind the token (no state change
without it), the admin token, the cross-site rule, the DNS-rebinding guard of open servers, the
auth slowdown, body and header limits, response headers and TLS."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import pytest
import requests
import torch

from diloco.swarm import Driver, StaticRoutes
from diloco.swarm.routing import NoReplica
from diloco.wire import spec_of
from diloco.worker.transport.client import DiLoCoClient, Unreachable
from tests.helpers.http import (
    AUTH,
    TIMEOUT,
    TOKEN,
    assert_params_equal,
)
from tests.helpers.servers import ServerFactory, initial_params
from tests.helpers.swarm import batches, boundaries, make_model, make_optimizer, reference, swarm
from tests.helpers.swarm_peers import BATCH, FAST, STAGES, peers

pytestmark = pytest.mark.slow

Cert = tuple[Path, Path]


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory: pytest.TempPathFactory) -> Cert:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True,
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    return cert, key


def test_tls_with_a_private_ca(make_server: ServerFactory, self_signed: Cert) -> None:
    cert, key = self_signed
    server = make_server(token=TOKEN, tls_cert=str(cert), tls_key=str(key))
    assert server.url.startswith("https://")
    client = DiLoCoClient(
        server.url, token=TOKEN, tls_ca=str(cert), retries=0, read_timeout=TIMEOUT
    )
    try:
        assert client.register("tls-worker")["worker_id"] == "tls-worker"
        round_, params = client.get_global_params()
        assert round_ == 0
        assert_params_equal(dict(params), initial_params())
        # Uploads over TLS take aiohttp's ordinary path (the socket holds ciphertext).
        grads = {name: torch.full_like(t, 0.5) for name, t in initial_params().items()}
        reply = client.submit_pseudogradients(
            "tls-worker", 0, "tls-0", [spec_of(n, t) for n, t in grads.items()],
            lambda spec: grads[spec.name],
        )  # fmt: skip
        assert reply["status"] == "accepted"
        assert client.get_global_params(min_round=1)[0] == 1
    finally:
        client.close()
    # Without the CA the certificate is not trusted: no silent fallback to unverified TLS.
    untrusting = DiLoCoClient(server.url, token=TOKEN, retries=0, read_timeout=TIMEOUT)
    try:
        with pytest.raises(Unreachable, match="CERTIFICATE_VERIFY_FAILED|certificate verify"):
            untrusting.status()
    finally:
        untrusting.close()
    # Plain HTTP to the TLS port gets no answer from the API.
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(f"http://{server.address}/status", headers=AUTH, timeout=TIMEOUT)


def test_swarm_stage_services_over_tls(self_signed: Cert) -> None:
    """A swarm peer's stage service serves HTTPS with the operator's certificate; a driver
    given the CA trains through it exactly as over plain HTTP (fp32, one replica per stage:
    the unsplit model's losses bit for bit); a driver without the CA gets no answer (its calls
    fail verification, the replica is suspect, the step fails), and plain HTTP to the TLS port
    gets no reply from the stage's routes."""
    cert, key = self_signed
    tls = {"tls_cert": str(cert), "tls_key": str(key)}
    data = batches(3, 16)
    with swarm(service_options={1: tls, 2: tls}) as s:
        services = [sv for group in s.services.values() for sv in group]
        assert all(sv.address.startswith("https://") for sv in services)
        edges = boundaries(s.stages)
        trusting = Driver(
            s.stages[0], make_optimizer(s.stages[0]), s.routes, edges, micro_batch=16,
            tls_ca=str(cert),
        )  # fmt: skip
        try:
            assert [trusting.train_step(x, y) for x, y in data] == reference(make_model(0), data)
        finally:
            trusting.close()
        head = copy.deepcopy(s.stages[0])
        own = StaticRoutes({k: [s.endpoint(sv) for sv in g] for k, g in s.services.items()})
        untrusting = Driver(
            head, make_optimizer(head), own, edges, micro_batch=16, replica_wait_s=0.05
        )
        try:
            with pytest.raises(NoReplica):
                untrusting.train_step(*data[0])
        finally:
            untrusting.close()
        assert "CERTIFICATE_VERIFY_FAILED" in " ".join(own.suspects.values())
        plain = services[0].address.replace("https://", "http://")
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.post(f"{plain}/swarm/stage/forward", data=b"", timeout=TIMEOUT)


def test_a_swarm_over_tls_end_to_end(make_server: ServerFactory, self_signed: Cert) -> None:
    """A `--swarm` coordinator over HTTPS and peers whose stage services serve HTTPS
    (`SwarmPeer(tls_cert=, tls_key=)`), every call verified with the operator's CA
    (`tls_ca`): the ready addresses are https, and the head trains the unsplit model's losses
    bit for bit (fp32, one replica per stage)."""
    cert, key = self_signed
    server = make_server(
        token=TOKEN, swarm=True, stages=STAGES, min_replicas=1, tls_cert=str(cert),
        tls_key=str(key), **FAST,
    )  # fmt: skip
    assert server.url.startswith("https://")
    tls = {"tls_ca": str(cert), "tls_cert": str(cert), "tls_key": str(key)}
    data = batches(2, BATCH)
    with peers(server, 1, 2, 0, **tls) as (body, tail, head):
        assert body.address is not None and body.address.startswith("https://")
        assert tail.address is not None and tail.address.startswith("https://")
        losses = [head.train_step(x, y) for x, y in data]
    assert losses == reference(make_model(0), data)
