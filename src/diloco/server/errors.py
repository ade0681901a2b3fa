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


def swarm_mode(what: str) -> ApiError:
    """409 for a request of another mode made to a swarm coordinator (``--swarm``)."""
    return conflict(
        "swarm_mode",
        f"this server coordinates a pipeline swarm (--swarm): {what}; the peers hold their "
        "stages' parameters and call one another's stage services (GET /swarm/routes)",
    )


def not_swarm_mode() -> ApiError:
    """409 for a swarm route (``/swarm/*``) made to a server that runs another mode."""
    return conflict(
        "not_swarm_mode",
        "this server does not coordinate a pipeline swarm: start it with --swarm --stages S",
    )


QUORUM_ADVICE = (
    "ask again presenting no state (has_state false) to receive the run's, keeping your "
    "progress on top"
)
READY_ADVICE = (
    "a replica enters the route table only holding a state its stage agreed on: join the "
    "stage's quorums first (SwarmPeer(sync_every=H)), which hand a joiner that state"
)


def unagreed_state(
    claim: tuple[int, str], latest: tuple[int, str] | None, advice: str = QUORUM_ADVICE
) -> ApiError:
    """409 for a request presenting a state the run never agreed on: a quorum request's
    (all-reduce mode, stage sync: it could otherwise become the quorum's source and replace
    every replica's state) or a swarm replica's ready (``advice`` says what to do)."""
    last = f"round {latest[0]}, hash {latest[1]}" if latest else "none yet"
    return conflict(
        "unagreed_state",
        f"the state presented (round {claim[0]}, hash {claim[1]}) is not one the run agreed on "
        f"(the last agreed: {last}); {advice}",
        round=latest[0] if latest else None,
        action="rebase",
    )


def state_required(worker_id: str, latest: tuple[int, str] | None) -> ApiError:
    """409 for a swarm replica's ready that presents no state where its stage's replicas sync
    and agreed on states: it would serve parameters the stage never agreed on."""
    last = f"round {latest[0]}, hash {latest[1]}" if latest else "none yet"
    return conflict(
        "state_required",
        f"peer {worker_id!r} presented no state, but its stage's replicas sync and agreed on "
        f"states (the last: {last}); {READY_ADVICE}",
        round=latest[0] if latest else None,
    )


def left_out(worker_id: str, reason: str, seconds: float, rejoin: bool) -> ApiError:
    """409 for a quorum request from a worker the next quorums do without (all-reduce mode):
    it trains on alone (``continue``), or registers again first (``rejoin``)."""
    until = "until it registers again" if rejoin else f"for another {seconds:.1f} s"
    return conflict(
        "left_out",
        f"worker {worker_id!r} is left out of quorums {until}: {reason}",
        action="rejoin" if rejoin else "continue",
    )
