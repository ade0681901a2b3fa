"""The inner optimizer a trial's workers use: AdamW, or Muon on the hidden matrices with AdamW on
the rest (MuLoCo, arXiv 2505.23725), as one ``torch.optim.Optimizer`` that ``DiLoCoWorker`` hooks
like any other.

Muon orthogonalises each update matrix (Newton-Schulz), which only means something for the 2-D
weights inside the network: ``torch.optim.Muon`` refuses any other shape, and the embeddings, the
output head (a matrix, but one row per token, as an embedding is), learned positions, norms and
biases go to AdamW, as MuLoCo and Muon's reference do. Muon runs with ``match_rms_adamw`` (its
update scaled to AdamW's RMS), so both groups take the same learning rate and weight decay and a
trial's ``lr`` means the same thing for either choice. The demo model's attention keeps q, k and
v in one stacked ``in_proj_weight``: Muon orthogonalises it as one matrix, not as three.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

INNER = ("adamw", "muon")
# Parameter names (prefixes) that are matrices but not hidden layers: token embedding, learned
# positions, output head (the demo model's ``CharTransformer``).
NOT_HIDDEN = ("embed", "pos", "head")
WEIGHT_DECAY = 0.01  # torch's AdamW default, kept for both groups


def muon_groups(
    named: Iterable[tuple[str, torch.nn.Parameter]], not_hidden: tuple[str, ...] = NOT_HIDDEN
) -> tuple[list[str], list[str]]:
    """Names of the parameters for Muon (2-D, not under a ``not_hidden`` prefix) and for AdamW
    (everything else), each in model order."""
    muon: list[str] = []
    adamw: list[str] = []
    for name, p in named:
        top = name.split(".", 1)[0]
        (muon if p.ndim == 2 and top not in not_hidden else adamw).append(name)
    return muon, adamw


class MuonAdamW(torch.optim.Optimizer):
    """Muon on ``hidden`` and AdamW on ``rest``, stepped together. Its ``param_groups`` are the two
    optimizers' own group dicts, so setting ``group["lr"]`` (a schedule) reaches both."""

    def __init__(
        self,
        hidden: list[torch.nn.Parameter],
        rest: list[torch.nn.Parameter],
        lr: float,
        weight_decay: float = WEIGHT_DECAY,
    ) -> None:
        if not hidden:
            raise ValueError("MuonAdamW needs at least one hidden 2-D parameter for Muon")
        self.muon = torch.optim.Muon(
            hidden, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw"
        )
        self.adamw = torch.optim.AdamW(rest, lr=lr, weight_decay=weight_decay)
        groups = [*self.muon.param_groups, *self.adamw.param_groups]
        super().__init__(groups, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of each: Muon on the hidden matrices, AdamW on the rest."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss


def make_inner(kind: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """The inner optimizer ``kind`` (one of ``INNER``) over ``model``'s parameters."""
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    if kind == "muon":
        params = dict(model.named_parameters())
        hidden, rest = muon_groups(params.items())
        return MuonAdamW([params[n] for n in hidden], [params[n] for n in rest], lr)
    raise ValueError(f"unknown inner optimizer {kind!r}; known: {', '.join(INNER)}")
