"""The quantized all-reduce's residuals in a worker's checkpoint (``quantized.Residuals``:
``state_dict``, ``load_state_dict``, ``resumed``): what a restarted member saved is what its next
round of the same share sends, bit for bit; what does not fit is dropped; a malformed file is
refused naming the key, with nothing changed. The restart end to end is
``tests/integration/test_allreduce_residuals.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diloco.worker.allreduce.quantized import QUORUM_RESIDUAL, Residuals


def owed(seed: int, sizes: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for n in sizes]


def committed(share: int, tensors: list[torch.Tensor], values: list[torch.Tensor]) -> Residuals:
    """Residuals that owe ``values`` for ``tensors`` at ``share``, as after a committed round."""
    res = Residuals()
    q = res.for_round("int8", share, tensors)
    assert q is not None
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
    assert q is not None and q.decay == 0.5
    for got, want in zip(q.residual, values, strict=True):
        assert torch.equal(got, want)
    assert back.restored == {}


def test_a_saved_residual_that_does_not_fit_the_round_is_dropped_for_zeros() -> None:
    res = committed(0, [torch.zeros(4)], owed(1, [4]))
    back = Residuals()
    back.load_state_dict(res.state_dict())
    q = back.for_round("int8", 0, [torch.zeros(5)])
    assert q is not None and torch.equal(q.residual[0], torch.zeros(5))
    assert back.restored == {}


def test_forget_drops_the_restored_residuals_too() -> None:
    back = Residuals()
    back.load_state_dict(committed(0, [torch.zeros(4)], owed(2, [4])).state_dict())
    back.forget()  # take_state: the run's state wholesale, nothing owed
    q = back.for_round("int8", 0, [torch.zeros(4)])
    assert q is not None and torch.equal(q.residual[0], torch.zeros(4))


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
