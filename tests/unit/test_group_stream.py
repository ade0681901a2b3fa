"""The streamed broadcast of a replicated worker group (rank 0's side): which buckets go out
when, and when the verdict must ask for the parameters again (docs/design.md, "Worker groups")."""

from __future__ import annotations

from typing import Any

import torch

from diloco.worker.groups import group as group_mod
from diloco.worker.groups.group import _BucketStream, _plan


class _Work:
    def wait(self) -> None:
        pass


class _Group:
    def __init__(self, plan: list[list[str]]) -> None:
        self._plan = plan
        self.sent: list[list[str]] = []

    def _send_bucket(self, names: list[str]) -> Any:
        self.sent.append(names)
        return _Work()


def test_plan_puts_small_parameters_together_and_large_ones_alone() -> None:
    mib = 1 << 20
    params = {
        "a": torch.empty(mib // 4),  # 1 MiB
        "b": torch.empty(mib // 4),
        "big": torch.empty(2 * group_mod.STREAM_BUCKET_BYTES // 4),
        "c": torch.empty(10),
        "h": torch.empty(10, dtype=torch.float16),
    }
    assert _plan(params) == [["a", "b"], ["big"], ["c"], ["h"]]


def test_buckets_go_out_in_plan_order_as_adopted() -> None:
    g = _Group([["a", "b"], ["c"], ["d"]])
    s = _BucketStream(g)  # type: ignore[arg-type]
    s.body()
    s.adopted(["a"])
    assert g.sent == []
    s.adopted(["a", "c"])  # "c" waits for the bucket before it
    assert g.sent == []
    s.adopted(["a", "c", "b"])
    assert g.sent == [["a", "b"], ["c"]]
    assert s.end(adopted=True)  # "d" goes out at the end, from the parameters as they are
    assert g.sent == [["a", "b"], ["c"], ["d"]]


def test_a_retried_body_or_an_unadopted_sync_asks_for_the_parameters_again() -> None:
    g = _Group([["a"], ["b"]])
    s = _BucketStream(g)  # type: ignore[arg-type]
    s.body()
    s.adopted(["a"])
    s.body()  # the download broke off and starts again: "a" may have changed
    s.adopted(["a", "b"])
    assert not s.end(adopted=True)
    assert len(g.sent) == 2  # each bucket once per sync: the other ranks expect exactly that

    s.body()
    s.adopted(["a"])
    assert not s.end(adopted=False)  # broke off for good, or rebased after

    assert s.end(adopted=False)  # nothing went out early: all sent from the final values
