"""The server's first settings: where it listens, who makes up a round and when it closes
(quorum rounds included), the outer optimizer, and where the model comes from and checkpoints
go."""

from __future__ import annotations

from dataclasses import dataclass

from diloco.core.grace import parse_grace, parse_quorum
from diloco.core.outer_rules import OUTER_RULES, SGD
from diloco.server.config.declare import _QUORUM, GRACE_CEILING, GRACE_FLOOR, _flag


@dataclass(frozen=True)
class ServiceSettings:
    """Fields of ``ServerConfig`` (its first ones, in ``--help`` order); each documented here."""

    host: str = _flag("127.0.0.1", "interface to bind")
    """Interface to bind. Loopback by default: binding wider is a deliberate choice."""

    port: int = _flag(8512, "TCP port (0: any free port)")
    """TCP port; 0 picks a free one (read it back from ``DiLoCoServer.address``)."""

    num_workers: int = _flag(1, "workers that must register before round 0 opens", short="-n")
    """Workers that must register before round 0 opens."""

    min_workers: int = _flag(1, "never close a round with fewer contributions")
    """A round never closes with fewer contributions than this."""

    quorum: str | None = _flag(
        None,
        "sync: close a round once K contributions are in (an int, or a fraction in (0, 1] of "
        "its expected workers) and --grace has passed; late uploads are merged",
        group=_QUORUM,
    )
    """Sync quorum rounds (docs/design/server-mode.md, "Quorum rounds"): a round closes once this
    many contributions are in and the grace window has passed since the last of them arrived
    (at once when every expected worker is in). An int, or a fraction of the round's expected
    workers rounded up; never below ``min_workers``. None: the barrier waits for everyone."""

    grace: str | None = _flag(
        None,
        "after the quorum, wait this long for more: seconds, or auto (default): "
        "median + 3 MAD of recent arrivals after the quorum",
        group=_QUORUM,
    )
    """Seconds the round stays open after its quorum, or ``auto`` (the default with
    ``quorum``): from recent arrival offsets after the quorum (``core/grace.py``)."""

    grace_floor: float = _flag(GRACE_FLOOR, "auto grace: shortest window, s", group=_QUORUM)
    """``auto``'s lower bound: a second covers network and scheduling jitter between workers
    that are really equally fast, so closing sooner would turn on-time work into late work."""

    grace_ceiling: float = _flag(GRACE_CEILING, "auto grace: longest window, s", group=_QUORUM)
    """``auto``'s upper bound: a minute bounds what a frozen worker costs a round while leaving
    room for uploads of a large model on a slow link."""

    max_lateness: int = _flag(
        1,
        "merge an upload whose round closed without it into a round at most this many rounds "
        "later, weighted 1/sqrt(1 + lateness); older: 409 stale_round",
        group=_QUORUM,
    )
    """Quorum rounds: an upload whose base round closed without it counts in the open round if
    that is at most this many rounds after its base (weight x 1/sqrt(1 + lateness)); older ones
    are refused (409 ``stale_round``, rebase). 0 refuses them all."""

    outer_lr: float = _flag(0.7, "outer SGD learning rate")
    """Learning rate of the default outer optimizer (SGD with Nesterov momentum)."""

    outer_rule: str = _flag(
        SGD,
        "outer rule: sgd (momentum, Nesterov) or sparseloco (plain averaged descent; the "
        "workers' decayed error feedback stands in for momentum)",
        choices=OUTER_RULES,
    )
    """``sgd``: outer SGD with ``outer_momentum`` and ``nesterov``. ``sparseloco`` (arXiv
    2508.15706): plain averaged descent, no momentum; registering workers are told the rule and
    decay their error feedback (``core/outer_rules.py``). Parameter-server and all-reduce mode
    (the quorums' members step with momentum 0 and decay their quorum residuals); not swarm."""

    outer_momentum: float | None = _flag(None, "outer SGD momentum (default: 0.9; sparseloco: 0)")
    """Momentum of the default outer optimizer. None: the rule's (0.9 under ``sgd``, 0 under
    ``sparseloco``, which refuses any other); a float once constructed."""

    nesterov: bool = _flag(True, "plain momentum instead of Nesterov")
    """Use Nesterov momentum in the default outer optimizer."""

    output_dir: str | None = _flag(
        None,
        "model/output folder: the initial model is read from it when it holds one, checkpoints "
        "go to DIR/checkpoints (resuming from the newest there); --init and --save-dir, given, "
        "take the place of either half",
        short="-o",
        metavar="DIR",
    )
    """A model folder that is also the run's output, as the reference's ``-o``: when it holds
    weights (safetensors, or a PyTorch state dict: ``params/initial.py``) they are the initial
    parameters, else the first worker's are; checkpoints go to ``<output_dir>/checkpoints``
    (``save_dir`` is set to it here, so a restart resumes from there). An explicit
    ``initial_params`` or ``save_dir`` takes the place of its half. Refused in all-reduce mode,
    where the server holds no parameters (the workers' ``save_dir`` is where checkpoints go)."""

    initial_params: str | None = _flag(
        None,
        "initial parameters: a .safetensors or PyTorch state dict (.pt, .pth, .bin) file, or a "
        "model folder (default: the first worker's)",
        flag="--init",
        metavar="PATH",
    )
    """A safetensors file or a directory of them (a Hugging Face model folder, say), or a PyTorch
    state dict file (``.pt``, ``.pth``, ``.bin``; a folder's ``pytorch_model.bin``) read with
    ``torch.load`` with ``weights_only=True``. When None (and no ``output_dir`` model), the first worker
    to register uploads its own parameters."""

    save_dir: str | None = _flag(
        None, "checkpoint directory; the server resumes from its newest checkpoint"
    )
    """Where checkpoints go; None disables saving. On start the server resumes from the newest
    complete checkpoint found here."""

    from_checkpoint: str | None = _flag(None, "resume from this checkpoint directory")
    """Resume from this checkpoint directory instead (overrides the newest in save_dir)."""

    save_every: int = _flag(0, "save every N rounds (0: on shutdown only)")
    """Save every N rounds (0: only on shutdown and on request)."""

    keep_checkpoints: int = _flag(3, "checkpoints to keep", flag="--keep")
    """How many checkpoints to keep in ``save_dir`` (complete ones, newest by content)."""

    fresh_start: bool = _flag(
        False,
        "start from scratch when --save-dir holds checkpoints of which none loads"
        " (default: refuse to start)",
    )
    """Start from scratch when ``save_dir`` holds checkpoint folders of which none loads (they
    are left in place). Without it the server refuses to start, naming each folder and why."""

    @property
    def momentum(self) -> float:
        """``outer_momentum`` as resolved at construction (never None then)."""
        assert self.outer_momentum is not None
        return self.outer_momentum

    @property
    def quorum_value(self) -> int | float | None:
        """``quorum`` parsed: a count (int), a fraction (float), or None (the full barrier)."""
        return None if self.quorum is None else parse_quorum(self.quorum)

    @property
    def grace_seconds(self) -> float | None:
        """``grace`` parsed: seconds, or None for ``auto`` (and without ``quorum``)."""
        return None if self.grace is None else parse_grace(self.grace)
