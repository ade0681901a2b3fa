"""All-reduce mode: the run's parameter table, which every worker's must equal.

The server holds no parameters in this mode, so nothing else stops a worker with another model
from joining a collective, where a tensor of the wrong shape would fail the whole quorum (or,
worse, line up by size and be averaged into the wrong parameter). Each registration carries its
table in ``RegisterInfo.params`` (``[[name, [shape...]], ...]``, its shape checked by the
message); the first registrant's becomes the run's (in memory: after a server restart the next
registrant sets it again) and a differing one is refused before it changes anything.
"""

from __future__ import annotations

from diloco.server.errors import ApiError, bad_request
from diloco.server.members.param_table import differences
from diloco.server.members.param_table import mismatch as table_mismatch
from diloco.wire.messages import Table


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
            raise mismatch(differences(self.table, table))
        return table

    @property
    def numel(self) -> int:
        """Elements in the run's parameters (0 until a worker registered its table)."""
        return sum(_numel(shape) for _, shape in self.table or ())

    def adopt(self, table: Table) -> None:
        if self.table is None:
            self.table = table


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def mismatch(found: list[str]) -> ApiError:
    return table_mismatch(found, "Every worker of an all-reduce run must train the same model")
