"""A ``DiLoCoServer`` inside a spawned child, steered by its parent over a pipe.

The child imports torch and diloco only once it runs (the parent never does), optionally from
another checkout's ``src/`` put first on its path (an A/B of the server in one run). It sends a
hello (address, port, rendezvous store port in all-reduce mode, its RSS after importing torch
and diloco and after starting, its pid), then answers ``"status"`` with ``server.status()`` and
``"stop"`` with the last status and its peak RSS, and stops. Benchmark-side instrumentation
only: the library's code runs unchanged.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Any

from benchmarks.harness.rss import base_rss, maxrss, rss


def server_main(
    conn: Any,
    config: dict[str, Any],
    threads: int,
    server_src: str | None = None,
    store_proxy: tuple[str, int] | None = None,
    host: str = "127.0.0.1",
) -> None:
    """``config``: ``ServerConfig`` fields (``host`` and ``port`` 0 added here; ``host`` is the
    address to bind, the server namespace's in netns_links). With ``save_every`` > 0, a
    temporary ``save_dir`` (removed at the end). ``store_proxy``: in all-reduce mode, the
    address the quorum replies hand out for the rendezvous store (a counting proxy in front of
    it), so that its traffic is counted as well."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    if server_src:  # another checkout's server (an A/B in one run); the workers stay this one's
        sys.path.insert(0, server_src)
    from diloco.server import DiLoCoServer, ServerConfig

    save_every = int(config.get("save_every", 0))
    save_dir = tempfile.mkdtemp(prefix="bench-ckpt-") if save_every else None
    base = base_rss()
    fields = dict(config, host=host, port=0)
    if save_dir is not None:
        fields["save_dir"] = save_dir
    server_config = ServerConfig(**fields)
    if save_dir is not None:
        import diloco.server as where

        print(f"server: {where.__file__}, checkpoints every {save_every} round(s)", flush=True)
    server = DiLoCoServer(server_config).start()
    # All-reduce mode's rendezvous is served on the HTTP port now (counted there): no store
    # port. A server of another checkout (``server_src``) may still host a TCPStore.
    store_port = None
    if config.get("allreduce"):
        book: Any = server.front.book  # type: ignore[attr-defined]
        if isinstance(book.rendezvous, tuple):
            store_port = int(book.rendezvous[1])
            if store_proxy is not None:
                book.rendezvous = (str(store_proxy[0]), int(store_proxy[1]))
    conn.send(
        {
            "address": server.address,
            "port": server.port,
            "store_port": store_port,
            "base_rss": base,
            "rss_loaded": rss(),
            "pid": os.getpid(),
        }
    )
    try:
        while True:
            try:
                cmd = conn.recv()
            except EOFError:  # the parent went away
                return
            if cmd == "status":
                conn.send(server.status())
            elif cmd == "stop":
                conn.send({"status": server.status(), "maxrss": maxrss(), "rss_end": rss()})
                return
    finally:
        server.stop(timeout=10)
        if save_dir is not None:
            shutil.rmtree(save_dir, ignore_errors=True)
