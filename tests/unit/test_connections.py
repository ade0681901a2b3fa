"""The pieces of the connection bounds that need no socket: address keys, the derived cap, and
logs limited per kind (asyncio's accept() failures among them)."""

from __future__ import annotations

import asyncio
import errno
import logging
import resource

import pytest

from diloco.edge import connections
from diloco.edge.log_limit import LogLimiter, limit_loop_errors


def test_address_keys() -> None:
    assert connections.address_key("192.0.2.7") == "192.0.2.7"
    assert connections.address_key("::ffff:192.0.2.7") == "192.0.2.7"  # dual-stack sockets
    # One machine can use any address of its /64: they count as one.
    a = connections.address_key("2001:db8:1:2::1")
    assert a == connections.address_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert connections.address_key("fe80::1%eth0") == "fe80::/64"
    assert connections.address_key(None) == "?"


def test_the_derived_cap_leaves_headroom_below_the_open_file_limit() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    derived = connections.default_max_connections()
    assert 16 <= derived <= connections.MAX_DERIVED
    if soft != resource.RLIM_INFINITY and soft > connections.FD_HEADROOM + 16:
        assert derived == min(connections.MAX_DERIVED, soft - connections.FD_HEADROOM)


def test_one_line_per_interval_and_kind_saying_how_many_were_left_out() -> None:
    now = [0.0]
    limiter = LogLimiter(interval=10.0, clock=lambda: now[0])
    assert limiter.allow("a") == 0
    assert limiter.allow("a") is None
    assert limiter.allow("b") == 0  # another kind has its own interval
    now[0] = 5.0
    assert limiter.allow("a") is None
    now[0] = 10.0
    assert limiter.allow("a") == 2
    assert "2 more like it" in limiter.note(2) and limiter.note(0) == ""


def test_accept_failures_do_not_flood_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """asyncio reports one ``socket.accept() out of system resource`` per pending connection
    each time the listening socket wakes up; a thousand of them make one line here."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        limit_loop_errors(loop, LogLimiter(interval=60.0))
        for _ in range(1000):
            loop.call_exception_handler(
                {
                    "message": "socket.accept() out of system resource",
                    "exception": OSError(errno.EMFILE, "Too many open files"),
                }
            )

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(scenario())
    lines = [r for r in caplog.records if "accept()" in r.getMessage()]
    assert len(lines) == 1
