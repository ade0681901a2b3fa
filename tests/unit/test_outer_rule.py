"""The SparseLoCo outer rule (issue 30 item 2; core/outer_rules.py): how the settings resolve
and what they refuse, the server's step (plain averaged descent, no momentum buffer) and the
worker's decayed error feedback, each against hand-computed values. Through a real server:
tests/integration/test_outer_rule.py."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from diloco.core.outer import apply_outer_step, default_outer_optimizer
from diloco.core.outer_rules import SPARSELOCO_DECAY, ef_decay, outer_momentum
from diloco.server.config import ServerConfig
from diloco.wire import build_layout, iter_body
from diloco.worker.settings import WorkerSettings, parse_codec, resolve, to_env
from diloco.worker.state.encoder import UploadEncoder, comm_dtype
from diloco.worker.state.local_model import LocalModel

# --- settings -----------------------------------------------------------------------------------


def test_the_rule_resolves_the_momentum_and_the_decay() -> None:
    assert ServerConfig().outer_rule == "sgd" and ServerConfig().outer_momentum == 0.9
    assert ServerConfig(outer_momentum=0.5).momentum == 0.5
    sparse = ServerConfig(outer_rule="sparseloco")
    assert sparse.outer_momentum == 0.0 and sparse.momentum == 0.0
    assert ServerConfig(outer_rule="sparseloco", outer_momentum=0).momentum == 0.0
    assert outer_momentum("sgd", None) == 0.9
    # The worker's decay: its own when set, else the server's rule's (1 for a server naming none).
    assert ef_decay("sparseloco", None) == SPARSELOCO_DECAY == 0.95
    assert ef_decay("sgd", None) == ef_decay(None, None) == 1.0
    assert ef_decay("sparseloco", 0.5) == 0.5 and ef_decay("sgd", 0.8) == 0.8


def test_sparseloco_with_an_outer_momentum_is_refused_naming_both() -> None:
    for momentum in (0.9, 0.5):
        with pytest.raises(ValueError) as info:
            ServerConfig(outer_rule="sparseloco", outer_momentum=momentum)
        assert "--outer-rule sparseloco" in str(info.value)
        assert "--outer-momentum" in str(info.value)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"outer_rule": "adam"}, "outer_rule must be one of sgd, sparseloco"),
        ({"mode": "async", "delayed_nesterov": True}, "delayed_nesterov"),
        ({"swarm": True}, "--swarm (swarm=True) cannot go with --outer-rule"),
    ],
)
def test_what_the_rule_cannot_go_with(kw: dict, says: str) -> None:
    rule = {} if "outer_rule" in kw else {"outer_rule": "sparseloco"}
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        ServerConfig(**rule, **kw)
    if rule:  # the same settings stand under sgd
        ServerConfig(**kw)


def test_ef_decay_is_a_worker_setting_checked_at_construction() -> None:
    assert WorkerSettings().ef_decay is None
    assert resolve({}, {"DILOCO_EF_DECAY": "0.9"}).ef_decay == 0.9
    assert to_env(WorkerSettings(ef_decay=0.5))["DILOCO_EF_DECAY"] == "0.5"  # diloco worker
    assert "DILOCO_EF_DECAY" not in to_env(WorkerSettings())  # unset: the rule decides
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="ef_decay must be in"):
            WorkerSettings(ef_decay=bad)


# --- the server's step --------------------------------------------------------------------------


def test_sparseloco_steps_by_the_plain_average_and_keeps_no_momentum() -> None:
    """What the server builds from the config (``Coordinator._default_optimizer``'s call), fed
    as the server feeds it: the running sum of two uploads and their weight."""
    config = ServerConfig(outer_rule="sparseloco", outer_lr=0.5)
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, -1.0, 0.0]))
    opt = default_outer_optimizer([p], config.outer_lr, config.momentum, config.nesterov)
    u1, u2 = torch.tensor([0.5, -1.0, 0.0, 2.0]), torch.tensor([1.5, 1.0, -2.0, 2.0])
    apply_outer_step(opt, [p], [u1 + u2], divisor=2.0)
    # p - lr * (u1 + u2) / 2 = p - 0.5 * [1, 0, -1, 2]
    assert torch.equal(p.detach(), torch.tensor([0.5, 2.0, -0.5, -1.0]))
    assert "momentum_buffer" not in opt.state[p]
    # A second round moves by its own average only: nothing of the first is carried.
    u3, u4 = torch.tensor([1.0, 1.0, 1.0, 1.0]), torch.tensor([-1.0, 3.0, 1.0, 0.0])
    apply_outer_step(opt, [p], [u3 + u4], divisor=2.0)
    assert torch.equal(p.detach(), torch.tensor([0.5, 1.0, -1.0, -1.25]))
    assert "momentum_buffer" not in opt.state[p]


# --- the worker's decayed error feedback --------------------------------------------------------

# top-2 of each chunk of 8, 2-bit values: levels -3s, -s, s, 3s with s = absmax / 3 (bf16 up).
TOPK = "topk:density=0.25,chunk=8,bits=2"


class _One(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(8))


def _sync(enc: UploadEncoder, local: LocalModel, g: list[float]) -> torch.Tensor:
    """One counted upload of ``g`` (the snapshot set to local + g, local being zeros): the
    decoded body, after the commit."""
    local.snapshot = {"w": torch.tensor(g)}
    up = enc.model_upload()
    layout = build_layout(up.specs, enc.metadata, ordered=True)
    body = b"".join(bytes(c) for c in iter_body(layout, up.produce))  # type: ignore[arg-type]
    up.commit()
    tensors = safetensors.torch.load(body)
    return enc.codec.decode([tensors["w" + p.suffix] for p in enc.codec.parts((8,))], (8,))


@pytest.mark.parametrize("decay", [0.5, 1.0])
def test_the_encoder_decays_the_residual_before_it_compensates(decay: float) -> None:
    codec = parse_codec(TOPK)
    local = LocalModel(_One(), comm_dtype(codec), {})
    enc = UploadEncoder(codec, local, {"residual_norm": 0.0})
    enc.set_decay(decay)
    # Sync 1: 3 and -1 are kept (s = 1, both exact); the rest stays owed.
    sent = _sync(enc, local, [3.0, -1.0, 0.75, 0.25, -0.5, 0.125, 0.0, 0.125])
    assert torch.equal(sent, torch.tensor([3.0, -1.0, 0, 0, 0, 0, 0, 0]))
    e1 = torch.tensor([0.0, 0.0, 0.75, 0.25, -0.5, 0.125, 0.0, 0.125])
    assert enc.feedback is not None and torch.equal(enc.feedback.residuals["w"], e1)
    # Sync 2 sends c = g2 + decay * e1: -3 and, by the decay, a different second element.
    sent = _sync(enc, local, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -3.0, 0.5])
    if decay == 0.5:  # c = [0, 0, .375, .125, -.25, .0625, -3, .5625]: .5625 -> 1 (s = 1)
        want = [0.0, 0, 0, 0, 0, 0, -3, 1]
        e2 = [0.0, 0.0, 0.375, 0.125, -0.25, 0.0625, 0.0, -0.4375]
    else:  # c = [0, 0, .75, .25, -.5, .125, -3, .625]: .75 -> 1
        want = [0.0, 0, 1, 0, 0, 0, -3, 0]
        e2 = [0.0, 0.0, -0.25, 0.25, -0.5, 0.125, 0.0, 0.625]
    assert torch.equal(sent, torch.tensor(want))
    assert torch.equal(enc.feedback.residuals["w"], torch.tensor(e2))


def test_set_decay_refuses_a_value_outside_0_1_and_changes_nothing() -> None:
    codec = parse_codec(TOPK)
    enc = UploadEncoder(codec, LocalModel(_One(), comm_dtype(codec), {}), {})
    for bad in (1.5, -0.5, float("inf")):
        with pytest.raises(ValueError, match="decay must be in"):
            enc.set_decay(bad)
    assert enc.decay == 1.0
