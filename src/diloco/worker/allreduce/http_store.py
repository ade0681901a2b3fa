"""A quorum's rendezvous keys as a ``torch.distributed.Store`` (``HttpStore``) that gloo (or
NCCL) builds its process group on, served by the server's authenticated HTTP API
(``POST /rendezvous/<op>``, ``wire/messages/rendezvous.py``) through the worker's own client
(``DiLoCoClient``: its token, TLS and timeouts; one attempt per call, since the keys die with
the server). No port of the server but its HTTP
one is involved, and only a member of the quorum may touch the quorum's keys.

``HttpMeeting`` hands ``connect.py`` a store per quorum (``connect.Meeting``). A store is bound
to one quorum and one rank position (``position``: sharded groups average shard with shard,
rank r of each group in a process group of its own, each in its own key space on the server;
0, a whole worker's, is left out of every call so its bytes are as before), so keys go as gloo
names them (no ``PrefixStore``: the server keeps each quorum's positions apart). Every call has a timeout: a wait is a series of long polls, each within
the client's read timeout, ending at the store's timeout with ``DistStoreError``, as a
``TCPStore``'s would; a server error or an unreachable server is a ``DistStoreError`` too.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, TypedDict
from urllib.parse import urlsplit

import torch.distributed as dist

from diloco.wire.messages import (
    Rendezvous,
    StoreAdd,
    StoreCompareSet,
    StoreCount,
    StoreDelete,
    StoreDeleted,
    StoreGet,
    StoreNumber,
    StoreReady,
    StoreSet,
    StoreValue,
    StoreWait,
)
from diloco.wire.messages.rendezvous import POSITIONS_LIMIT, StoreCall, decode, encode
from diloco.worker.transport.client import SYNC_FAILURES, DiLoCoClient

POLL_SHARE = 0.5
"""A long poll asks for at most this share of the client's read timeout, so that its reply
arrives before the client gives up on it."""


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class _Who(TypedDict):
    """What every call names (``StoreCall``'s fields)."""

    worker_id: str
    quorum_id: str
    position: int


def _checked(position: int) -> int:
    if not 0 <= position < POSITIONS_LIMIT:
        raise ValueError(f"position must be in [0, {POSITIONS_LIMIT}), got {position}")
    return position


class HttpStore(dist.Store):
    """Quorum ``quorum_id``'s keys at rank position ``position``, as member ``worker_id`` (a
    group's rank names its group's worker id); ``timeout`` (seconds) bounds a get or a wait
    without a timeout of its own. Used by one thread at a time (gloo's join). ``ValueError``
    for a position outside ``[0, POSITIONS_LIMIT)``."""

    def __init__(
        self,
        client: DiLoCoClient,
        path: str,
        worker_id: str,
        quorum_id: str,
        timeout: float,
        position: int = 0,
    ) -> None:
        super().__init__()
        self._client = client
        self._path = path
        self._who = _Who(worker_id=worker_id, quorum_id=quorum_id, position=_checked(position))
        self._timeout = timeout
        self._poll = max(0.1, client.timeout[1] * POLL_SHARE)

    def _call(self, op: str, body: StoreCall) -> dict[str, Any]:
        try:
            return self._client.rendezvous(self._path, op, body)
        except SYNC_FAILURES as err:
            raise dist.DistStoreError(f"rendezvous {op}: {err}") from err

    # --- torch.distributed.Store ----------------------------------------------------------------

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout.total_seconds()

    def set(self, key: str, value: Any) -> None:
        self._call("set", StoreSet(**self._who, key=key, value=encode(_bytes(value))))

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self._timeout
        while True:
            wait = max(0.0, min(deadline - time.monotonic(), self._poll))
            got = StoreValue.from_json(self._call("get", StoreGet(**self._who, key=key, wait=wait)))
            if got.found:
                return decode(got.value)
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"rendezvous: key {key!r} not set in {self._timeout} s")

    def add(self, key: str, amount: int) -> int:
        reply = self._call("add", StoreAdd(**self._who, key=key, amount=amount))
        return StoreNumber.from_json(reply).value

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        call = StoreCompareSet(
            **self._who, key=key, expected=encode(_bytes(expected)), desired=encode(_bytes(desired))
        )
        return decode(StoreValue.from_json(self._call("compare_set", call)).value)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = self._timeout if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + seconds
        while True:
            wait = max(0.0, min(deadline - time.monotonic(), self._poll))
            call = StoreWait(**self._who, keys=tuple(keys), wait=wait)
            if StoreReady.from_json(self._call("wait", call)).ready:
                return
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"rendezvous: keys {keys} not set in {seconds} s")

    def check(self, keys: list[str]) -> bool:
        call = StoreWait(**self._who, keys=tuple(keys), wait=0.0)
        return StoreReady.from_json(self._call("wait", call)).ready

    def delete_key(self, key: str) -> bool:
        reply = self._call("delete", StoreDelete(**self._who, key=key))
        return StoreDeleted.from_json(reply).deleted

    def num_keys(self) -> int:
        return StoreNumber.from_json(self._call("count", StoreCount(**self._who))).value


class HttpMeeting:
    """Where this worker's quorums meet (``connect.Meeting``): the rendezvous ``where`` of the
    server ``client`` talks to, as ``worker_id``, at rank position ``position`` (its stores'
    key space: a sharded group's rank r meets the other groups' rank r there)."""

    def __init__(
        self, client: DiLoCoClient, worker_id: str, where: Rendezvous, position: int = 0
    ) -> None:
        self._client = client
        self._worker_id = worker_id
        self._path = where.path
        self._position = _checked(position)

    def store(self, quorum_id: str, timeout: float) -> HttpStore:
        return HttpStore(
            self._client, self._path, self._worker_id, quorum_id, timeout, self._position
        )

    def server(self) -> tuple[str, int]:
        url = urlsplit(self._client.base_url)
        return url.hostname or "localhost", url.port or (443 if url.scheme == "https" else 80)

    def joined(self) -> None:
        self._client.end_thread()
