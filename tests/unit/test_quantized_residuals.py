"""The quantized all-reduce's residuals in a worker's checkpoint (``quantized.Residuals``:
``state_dict``, ``load_state_dict``, ``resumed``): what a restarted member saved is what its next
round of the same share sends, bit for bit; what does not fit is dropped; a malformed file is
refused naming the key, with nothing changed. Without error feedback (``feedback`` False) there
is none: a round sends its contribution quantized on its own (checked by hand through
``quantized_reduce`` on a quorum of one), nothing is kept or saved. The restart end to end is
``tests/integration/test_allreduce_residuals.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from diloco.worker.allreduce.collective import QuorumCollective
from diloco.worker.allreduce.quantized import QUORUM_RESIDUAL, Residuals, quantized_reduce


def owed(seed: int, sizes: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for n in sizes]


def committed(share: int, tensors: list[torch.Tensor], values: list[torch.Tensor]) -> Residuals:
    """Residuals that owe ``values`` for ``tensors`` at ``share``, as after a committed round."""
    res = Residuals()
    q = res.for_round("int8", share, tensors)
    assert q is not None and q.pending is not None
    for p, v in zip(q.pending, values, strict=True):
        p.copy_(v)
    res.commit()
    return res


def test_a_saved_residual_is_what_the_next_round_of_its_share_sends_bit_for_bit() -> None:
    tensors = [torch.zeros(3, 5), torch.zeros(7)]
    values = owed(0, [15, 7])
    res = committed(1, tensors, values)
    state = res.state_dict()
    assert sorted(state) == [f"{QUORUM_RESIDUAL}1/0", f"{QUORUM_RESIDUAL}1/1"]
    assert all(t.device.type == "cpu" for t in state.values())
    back = Residuals()
    back.load_state_dict({**state, "residual/w": torch.ones(2)})  # the encoder's: not ours
    assert back.state_dict().keys() == state.keys()  # held until taken: a second save keeps them
    assert back.for_round("int8", 0, tensors) is not None  # another share: zeros, not these
    q = back.for_round("int8", 1, tensors, 0.5)
    assert q is not None and q.decay == 0.5 and q.residual is not None
    for got, want in zip(q.residual, values, strict=True):
        assert torch.equal(got, want)
    assert back.restored == {}


def test_a_saved_residual_that_does_not_fit_the_round_is_dropped_for_zeros() -> None:
    res = committed(0, [torch.zeros(4)], owed(1, [4]))
    back = Residuals()
    back.load_state_dict(res.state_dict())
    q = back.for_round("int8", 0, [torch.zeros(5)])
    assert q is not None and q.residual is not None and torch.equal(q.residual[0], torch.zeros(5))
    assert back.restored == {}


def test_forget_drops_the_restored_residuals_too() -> None:
    back = Residuals()
    back.load_state_dict(committed(0, [torch.zeros(4)], owed(2, [4])).state_dict())
    back.forget()  # take_state: the run's state wholesale, nothing owed
    q = back.for_round("int8", 0, [torch.zeros(4)])
    assert q is not None and q.residual is not None and torch.equal(q.residual[0], torch.zeros(4))


@pytest.mark.parametrize(
    ("key", "tensor", "says"),
    [
        (f"{QUORUM_RESIDUAL}x/0", torch.zeros(2), "not quorum_residual/SHARE/INDEX"),
        (f"{QUORUM_RESIDUAL}0", torch.zeros(2), "not quorum_residual/SHARE/INDEX"),
        (f"{QUORUM_RESIDUAL}0/0", torch.zeros(2, 2), "not a finite 1-D float tensor"),
        (f"{QUORUM_RESIDUAL}0/0", torch.tensor([1.0, float("nan")]), "finite 1-D"),
        (f"{QUORUM_RESIDUAL}0/0", torch.zeros(2, dtype=torch.int32), "finite 1-D"),
        (f"{QUORUM_RESIDUAL}0/1", torch.zeros(2), "indices not 0..n-1"),
    ],
)
def test_a_malformed_checkpoint_residual_is_refused_with_nothing_changed(
    key: str, tensor: torch.Tensor, says: str
) -> None:
    res = Residuals()
    res.load_state_dict(committed(3, [torch.zeros(4)], owed(3, [4])).state_dict())
    before = res.state_dict()
    with pytest.raises(ValueError, match=says.replace(".", r"\.")):
        res.load_state_dict({f"{QUORUM_RESIDUAL}5/0": torch.ones(3), key: tensor})
    after = res.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_resumed_takes_the_session_checkpoint_once_and_saves_through_it() -> None:
    state = committed(0, [torch.zeros(4)], owed(4, [4])).state_dict()
    session: Any = SimpleNamespace(resumed_feedback=state, saved_feedback=dict)
    res = Residuals.resumed(session)
    assert session.resumed_feedback == {}  # a second strategy would not take it again
    assert sorted(res.restored) == ["0"]
    saved = session.saved_feedback()
    assert saved.keys() == state.keys()
    assert all(torch.equal(saved[k], state[k]) for k in state)


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


class OneMember:
    """A quorum of one, as ``quantized_reduce`` uses it: each collective hands the member its own
    bytes back (no process group, no socket)."""

    size, rank, timeout = 1, 0, 5.0

    def collective(self, what: str, start: Any) -> None:
        assert start(self).wait()

    def alltoall_base(self, out: torch.Tensor, inp: torch.Tensor, *_: Any) -> _Done:
        out.copy_(inp)
        return _Done()

    def allgather(self, outs: list[list[torch.Tensor]], mine: list[torch.Tensor], _: Any) -> _Done:
        outs[0][0].copy_(mine[0])
        return _Done()


def two_rounds(res: Residuals) -> list[torch.Tensor]:
    """Two int8 rounds of one member through ``res``, committed as ``QuorumSync`` does; what
    each round wrote back (the average of a quorum of one: its decoded payload)."""
    out, quorum = [], cast(QuorumCollective, OneMember())
    for values in ([100.0, 0.7], [127 / 64, 3 / 256]):
        g = torch.tensor(values)
        q = res.for_round("int8", 0, [g])
        assert q is not None
        quantized_reduce(quorum, [g], 1.0, q.codec, q.residual, q.pending, send_residual=True)
        res.commit()
        out.append(g)
    return out


def test_without_error_feedback_a_round_sends_its_own_quantization_and_keeps_nothing() -> None:
    res = Residuals(feedback=False)
    q = res.for_round("int8", 0, [torch.zeros(2)], 0.5)
    assert q is not None and q.residual is None and q.pending is None
    second = two_rounds(res)[1]
    # Round 2 by hand: absmax 127/64, so the bf16 scale is 1/64 exactly; codes round(x * 64):
    # 127 and round(0.75) = 1. Requantizing the sum (the same values) changes no bit.
    assert torch.equal(second, torch.tensor([127 / 64, 1 / 64]))
    assert res.held == {} and res.pending is None and res.state_dict() == {}
    # The control: with error feedback round 1's rounding error (100 and 0.7 on a grid of about
    # 0.79) rides along, and round 2 is not its own quantization.
    fed = Residuals()
    assert not torch.equal(two_rounds(fed)[1], second)
    assert any(bool(e.any()) for e in fed.state_dict().values())


def test_without_error_feedback_a_checkpoints_residuals_are_dropped_and_none_saved() -> None:
    state = committed(0, [torch.zeros(4)], owed(5, [4])).state_dict()
    session: Any = SimpleNamespace(resumed_feedback=state, saved_feedback=dict)
    res = Residuals.resumed(session, feedback=False)
    assert session.resumed_feedback == {} and res.restored == {}
    q = res.for_round("int8", 0, [torch.zeros(4)])
    assert q is not None and q.residual is None
    assert session.saved_feedback() == {}
