"""Server configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Interface to bind. Loopback by default: binding wider is a deliberate choice."""

    port: int = 8512
    """TCP port; 0 picks a free one (read it back from ``DiLoCoServer.address``)."""

    num_workers: int = 1
    """Workers that must register before round 0 opens."""

    min_workers: int = 1
    """A round never closes with fewer contributions than this."""

    outer_lr: float = 0.7
    """Learning rate of the default outer optimizer (SGD with Nesterov momentum)."""

    outer_momentum: float = 0.9
    """Momentum of the default outer optimizer."""

    nesterov: bool = True
    """Use Nesterov momentum in the default outer optimizer."""

    initial_params: str | None = None
    """A safetensors file or a directory of them (a Hugging Face model folder, say). When None,
    the first worker to register uploads its own parameters."""

    save_dir: str | None = None
    """Where checkpoints go; None disables saving. On start the server resumes from the newest
    complete checkpoint found here."""

    from_checkpoint: str | None = None
    """Resume from this checkpoint directory instead (overrides the newest in save_dir)."""

    save_every: int = 0
    """Save every N rounds (0: only on shutdown and on request)."""

    keep_checkpoints: int = 3
    """How many checkpoints to keep in ``save_dir``."""

    token: str | None = None
    """Shared secret required as ``Authorization: Bearer`` on every endpoint except /healthz."""

    weighting: str = "equal"
    """How contributions are averaged: ``equal`` or ``samples`` (by the samples or tokens each
    worker reports with its submission)."""

    heartbeat_timeout: float = 120.0
    """A worker silent for this long is evicted and every barrier re-evaluated (0 disables)."""

    stuck_timeout: float = 1800.0
    """A worker whose heartbeats say its training loop took no optimizer step for this long
    (while not syncing) is evicted although its heartbeat thread still runs (0 disables). Raise
    it if your loop runs long evaluations between steps."""

    poll_timeout: float = 30.0
    """Longest a ``GET /global_params?min_round=`` waits before answering 202 (poll again).
    Workers' read timeouts must exceed it."""

    upload_slots: int = 1
    """Uploads received at once. Each holds one upload-sized buffer until it is added to the
    round's sum; the server's own link is the shared bottleneck, so 1 costs little time."""

    max_initial_bytes: int = 64 * 1024**3
    """Largest parameter upload accepted before the model is known."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if not 1 <= self.min_workers <= self.num_workers:
            raise ValueError(f"min_workers must be in [1, num_workers], got {self.min_workers}")
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ValueError(f"outer_lr must be a finite positive number, got {self.outer_lr}")
        if not (math.isfinite(self.outer_momentum) and 0 <= self.outer_momentum < 1):
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.weighting not in ("equal", "samples"):
            raise ValueError(f"weighting must be 'equal' or 'samples', got {self.weighting!r}")
        if self.save_every < 0 or self.keep_checkpoints < 1:
            raise ValueError("save_every must be >= 0 and keep_checkpoints >= 1")
        for name in ("heartbeat_timeout", "stuck_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not self.poll_timeout > 0:
            raise ValueError("poll_timeout must be positive")
        if self.upload_slots < 1:
            raise ValueError("upload_slots must be >= 1")
        if self.token is not None and len(self.token) < 8:
            raise ValueError("token must be at least 8 characters")
