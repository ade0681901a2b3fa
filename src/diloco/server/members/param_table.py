"""Comparing a registering worker's parameter table with the run's, in either mode.

A worker whose model differs from the run's must be refused at ``POST /register``, before the
registration changes anything: once registered it is counted in the expected workers and in the
next round's barrier (or quorum), and would hold them until it left. Each registration carries
its table in ``RegisterInfo.params`` (``[[name, [shape...]], ...]``, its shape checked by the
message).
"""

from __future__ import annotations

from diloco.server.errors import ApiError, conflict
from diloco.wire.messages import Table

SHOWN = 5
"""Differences named in a ``params_mismatch`` detail."""


def differences(run: Table, worker: Table, *, ordered: bool = True) -> list[str]:
    """What differs between the run's table and a worker's, in the run's order. ``ordered``:
    the same tensors in another order is a difference too (all-reduce mode's collectives sum
    flat buffers in table order; a parameter server matches tensors by name)."""
    theirs = dict(worker)
    mine = dict(run)
    found = []
    for name, shape in run:
        if name not in theirs:
            found.append(f"{name} missing")
        elif theirs[name] != shape:
            found.append(f"{name} has shape {list(theirs[name])}, the run's is {list(shape)}")
    found += [f"{name} is not in the run's table" for name, _ in worker if name not in mine]
    if ordered and not found and tuple(run) != tuple(worker):
        found.append("the same tensors in another order")
    return found


def mismatch(found: list[str], why: str) -> ApiError:
    """409 ``params_mismatch`` naming the first ``SHOWN`` differences, and ``why`` they
    matter."""
    more = f" (and {len(found) - SHOWN} more)" if len(found) > SHOWN else ""
    return conflict(
        "params_mismatch",
        f"the worker's parameters differ from this run's: {'; '.join(found[:SHOWN])}{more}. {why}",
    )
