"""All-reduce mode: the run's parameter table, which every worker's must equal.

The server holds no parameters in this mode, so nothing else stops a worker with another model
from joining a collective, where a tensor of the wrong shape would fail the whole quorum (or,
worse, line up by size and be averaged into the wrong parameter). Each registration carries its
table in ``RegisterInfo.params`` (``[[name, [shape...]], ...]``, its shape checked by the
message); the first registrant's becomes the run's (in memory: after a server restart the next
registrant sets it again) and a differing one is refused before it changes anything.
"""

from __future__ import annotations

from diloco.server.errors import ApiError, bad_request, conflict
from diloco.wire.messages import Table

SHOWN = 5
"""Differences named in a ``params_mismatch`` detail."""


def differences(run: Table, worker: Table) -> list[str]:
    """What differs between the run's table and a worker's, in the run's order."""
    theirs = dict(worker)
    mine = dict(run)
    found = []
    for name, shape in run:
        if name not in theirs:
            found.append(f"{name} missing")
        elif theirs[name] != shape:
            found.append(f"{name} has shape {list(theirs[name])}, the run's is {list(shape)}")
    found += [f"{name} is not in the run's table" for name, _ in worker if name not in mine]
    if not found and run != worker:
        found.append("the same tensors in another order")
    return found


class RunTable:
    """The run's table: set by the first registration, checked against every later one."""

    def __init__(self) -> None:
        self.table: Table | None = None

    def check(self, table: Table | None) -> Table:
        """The registering worker's table: 400 ``missing_params_table`` without one, 409
        ``params_mismatch`` when it differs from the run's. Changes nothing: ``adopt`` it once
        the registration went through."""
        if table is None:
            raise bad_request(
                "missing_params_table",
                "this server runs in all-reduce mode: the registration's info must carry the "
                "worker's parameter table, 'params': [[name, [shape...]], ...] (a worker too old "
                "for this mode?)",
            )
        if self.table is not None and table != self.table:
            diff = differences(self.table, table)
            more = f" (and {len(diff) - SHOWN} more)" if len(diff) > SHOWN else ""
            raise mismatch("; ".join(diff[:SHOWN]) + more)
        return table

    def adopt(self, table: Table) -> None:
        if self.table is None:
            self.table = table


def mismatch(what: str) -> ApiError:
    return conflict(
        "params_mismatch",
        f"the worker's parameters differ from this run's: {what}. Every worker of an "
        "all-reduce run must train the same model",
    )
