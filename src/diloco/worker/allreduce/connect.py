"""Connecting one member to a quorum's process group (``QuorumCollective.build``): the quorum's
rendezvous store from a ``Meeting`` (``http_store.py``'s, on the server's authenticated API),
then gloo (CPU) or NCCL (CUDA) built directly on it, on the local address this machine routes to
the server from; the whole under a hard time limit."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

BUILD_MARGIN_S = 1.0
"""Added to twice the timeout (connecting to the rendezvous, then meeting the others) for the
hard limit on ``QuorumCollective.build``."""


class Meeting(Protocol):
    """Where a worker's quorums meet."""

    def store(self, quorum_id: str, timeout: float) -> dist.Store:
        """The quorum's keys, for this worker only; ``timeout`` bounds its waits."""
        ...

    def server(self) -> tuple[str, int]:
        """(host, port) the rendezvous is reached at: gloo listens on the local address this
        machine routes there from."""
        ...

    def joined(self) -> None:
        """The joining thread is done with the store (called on it, whatever happened)."""
        ...


def connect(
    meeting: Meeting,
    quorum_id: str,
    rank: int,
    size: int,
    timeout: float,
    device: torch.device,
    interface: str | None,
) -> tuple[Any, Any]:
    """The quorum's backend and the store it was built on, within twice ``timeout`` plus
    ``BUILD_MARGIN_S`` (``TimeoutError`` past it); torch's and gloo's errors pass through."""
    limit = timedelta(seconds=timeout)

    def build() -> tuple[Any, Any]:
        try:
            store = meeting.store(quorum_id, timeout)
            if device.type == "cuda":
                return _nccl(store, rank, size, limit, device), store
            address = interface or _route_address(*meeting.server())
            return _gloo(store, rank, size, limit, address), store
        finally:
            meeting.joined()

    return _within(build, 2 * timeout + BUILD_MARGIN_S, quorum_id)


def shut(backend: Any, quorum_id: str) -> None:
    """Abort a backend's pending work and connections, then shut it down."""
    for stop in ("abort", "shutdown"):
        try:
            getattr(backend, stop)()
        except Exception as err:  # a backend already broken may refuse; nothing to keep
            log.debug("quorum %s: %s: %s", quorum_id, stop, err)


def _within(connect: Callable[[], tuple[Any, Any]], seconds: float, quorum_id: str) -> Any:
    """``connect()`` on a thread of its own, waited for at most ``seconds``. Its own timeouts
    do not bound it as a whole: gloo connects to each peer in turn, each connect under the
    timeout (a chaos run saw 50 s with a 10 s timeout after the rendezvous died). Past the
    deadline the caller gets ``TimeoutError``; the thread is left to end by itself, and shuts
    down whatever it still builds."""
    lock = threading.Lock()
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            built = connect()
        except BaseException as exc:  # handed to the caller
            with lock:
                box["error"] = exc
            done.set()
            return
        with lock:
            late = box.get("abandoned", False)
            box["built"] = built
        done.set()
        if late:
            shut(built[0], quorum_id)

    threading.Thread(target=run, name=f"diloco-join-{quorum_id}", daemon=True).start()
    done.wait(seconds)
    with lock:
        if "built" in box:
            return box["built"]
        if "error" in box:
            raise box["error"]
        box["abandoned"] = True
    raise TimeoutError(f"joining took longer than {seconds:.0f} s")


def _gloo(store: Any, rank: int, size: int, limit: timedelta, address: str) -> Any:
    # torch 2.13: the (store, rank, size, timeout) form picks gloo's default device (the
    # hostname's address); an explicit device needs the _Options form.
    gloo: Any = dist.ProcessGroupGloo  # the stubs leave out _Options
    options = gloo._Options()
    options._timeout = limit
    options._devices = [gloo.create_device(hostname=address)]
    return gloo(store, rank, size, options)


def _nccl(store: Any, rank: int, size: int, limit: timedelta, device: torch.device) -> Any:
    # Untested: this project's tests have no GPU. getattr: CPU builds of torch lack the class.
    nccl: Any = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None or not torch.cuda.is_available():
        raise ValueError("this torch build has no NCCL or no CUDA device")
    options = nccl.Options()
    options._timeout = limit
    options.is_high_priority_stream = False
    backend = nccl(store, rank, size, options)
    # NCCL forms its communicator at the first collective by default; forming it now makes a
    # missing member fail build(), as with gloo, rather than the round's first all-reduce.
    backend.eager_connect_single_device(device)
    return backend


def _route_address(host: str, port: int) -> str:
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.connect(sockaddr)  # a UDP connect sends nothing: it only chooses the route
        return str(probe.getsockname()[0])
