"""The all-reduce mode's rendezvous: one ``torch.distributed.TCPStore`` the server hosts for its
whole life, where each round's quorum of workers meets to build its process group.

The server holds no parameters in this mode; it forms a quorum per round and hands each member
``address()``, a quorum id, a rank and the quorum's size. The members connect to this store as
clients (``worker/allreduce/collective.py``) and gloo (or NCCL) exchanges its connection details
through it under the quorum's own key prefix, ``quorum/<id>/``, so one store serves every round and
a quorum that failed leaves nothing behind that the next one could trip over. Tensors never pass
through the store: the members connect to one another.

Security assumption (deployment): the store and gloo's peer connections are NOT authenticated,
unlike the HTTP API (bearer token). Anyone who reaches the store's port can read or overwrite a
quorum's keys and so take part in, or break, a round. The rendezvous must therefore bind to the
address the workers reach on a private network (not ``0.0.0.0`` on a public host), and the
deployment must keep this port, and the workers' gloo ports, unreachable from outside it.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from types import TracebackType

import torch.distributed as dist

from diloco.wire.messages import quorum_prefix

log = logging.getLogger(__name__)


class RendezvousStore:
    """Hosts the store on ``host`` (the address workers reach; see the module's security note)
    and ``port`` (0: any free port, the real one is ``.port``).

    ``timeout`` bounds the store's own waits (seconds). The store does not wait for workers at
    start: quorums come and go, each with its own prefix. ``forget(quorum_id)`` drops a finished
    quorum's keys so the store does not grow with the number of rounds; ``close()`` stops it.
    """

    def __init__(self, host: str, port: int = 0, *, timeout: float = 30.0) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.host = host
        self._store: dist.TCPStore | None = dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
        )
        self.port: int = self._store.port
        log.info("rendezvous store listening on %s:%d", host, self.port)

    def address(self) -> tuple[str, int]:
        """(host, port) for the workers' ``QuorumCollective.build``."""
        return self.host, self.port

    def forget(self, quorum_id: str) -> int:
        """Delete a quorum's keys once its round is over (every member built its group or the
        quorum was abandoned); returns how many went. Deleting earlier would strand a member
        still connecting. Each quorum leaves a few hundred bytes per member otherwise."""
        store = self._require()
        head = quorum_prefix(quorum_id) + "/"
        gone = 0
        for key in store.list_keys():
            if key.startswith(head) and store.delete_key(key):
                gone += 1
        return gone

    def close(self) -> None:
        """Stop the store (dropping the master's last reference closes its listener and its
        clients' connections). Idempotent."""
        if self._store is not None:
            self._store = None
            log.info("rendezvous store on %s:%d closed", self.host, self.port)

    def _require(self) -> dist.TCPStore:
        if self._store is None:
            raise RuntimeError("the rendezvous is closed")
        return self._store

    def __enter__(self) -> RendezvousStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
