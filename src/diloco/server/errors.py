"""API errors: each becomes an ``ErrorBody`` (``{"error": code, "detail": sentence}``, and the
fields a worker acts on: a 409's ``round`` and ``action``...) with a status."""

from __future__ import annotations

from typing import Any

from diloco.wire.messages import ErrorBody


class ApiError(Exception):
    """An error reply: ``status`` and ``reply``; ``extra`` are ``ErrorBody``'s optional
    fields (``round``, ``action``, ``staleness``, ``fragment``, ``allowed``...), a None one
    left out."""

    def __init__(self, status: int, code: str, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
        self.reply = ErrorBody(error=code, detail=detail, **extra)


def bad_request(code: str, detail: str, **extra: Any) -> ApiError:
    return ApiError(400, code, detail, **extra)


def unknown_worker(worker_id: str) -> ApiError:
    return ApiError(
        410,
        "unknown_worker",
        f"worker {worker_id!r} is not registered here (evicted, or the server restarted); register again",
    )


def conflict(code: str, detail: str, **extra: Any) -> ApiError:
    return ApiError(409, code, detail, **extra)


def allreduce_mode(what: str) -> ApiError:
    """409 for a server-mode request (parameters, uploads, the outer optimizer) made to a
    server in all-reduce mode."""
    return conflict(
        "allreduce_mode",
        f"this server runs in all-reduce mode (--allreduce): {what}; the workers average "
        "among themselves and hold the parameters (POST /quorum)",
    )


def server_mode() -> ApiError:
    """409 for an all-reduce request (``/quorum``) made to a server that holds the parameters."""
    return conflict(
        "server_mode",
        "this server holds the parameters (it runs without --allreduce): upload "
        "pseudo-gradients to POST /submit_pseudograd instead",
    )
