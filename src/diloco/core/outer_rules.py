"""The outer rule of a run: what the server does with the round's averaged pseudo-gradient, and
what that asks of the workers' error feedback (docs/design/codecs.md, "The SparseLoCo rule").

- ``sgd`` (the default): DiLoCo's outer SGD with momentum (Nesterov by default, momentum 0.9),
  ``OuterSGD``; workers keep plain error feedback (decay 1) for a lossy codec.
- ``sparseloco`` (Sarfi et al. 2025, arXiv 2508.15706): plain averaged descent,
  ``theta -= lr * mean(decoded uploads)``, with no outer momentum; each worker's error-feedback
  residual, decayed by ``beta`` before it is added to the next pseudo-gradient, stands in for
  the momentum the server no longer keeps. That is ``OuterSGD`` with momentum 0 (no buffer is
  made), so the server's step, its finite guard and its checkpoints stay as they are.

Pure: the names, the defaults, and how a setting left unset resolves under each rule.
"""

from __future__ import annotations

SGD = "sgd"
SPARSELOCO = "sparseloco"
OUTER_RULES = (SGD, SPARSELOCO)

SGD_MOMENTUM = 0.9
"""``sgd``'s outer momentum when none is given (the DiLoCo paper's)."""

PLAIN_DECAY = 1.0
"""Error feedback's decay under ``sgd``: none, every dropped value is owed in full."""

SPARSELOCO_DECAY = 0.95
"""Error feedback's decay under ``sparseloco`` when the worker sets none (``beta``). Our
default: not checked against the paper's tables, so a run that follows the paper sets its own."""


def check_rule(rule: str) -> str:
    """``rule`` if it names an outer rule; a ``ValueError`` naming the known ones otherwise."""
    if rule not in OUTER_RULES:
        raise ValueError(f"outer_rule must be one of {', '.join(OUTER_RULES)}, got {rule!r}")
    return rule


def outer_momentum(rule: str, given: float | None) -> float:
    """The outer momentum a server runs with: ``given``, else the rule's (``sgd``: 0.9,
    ``sparseloco``: 0). ``sparseloco`` with a momentum above 0 is a ``ValueError``: the rule's
    point is that the workers' residuals carry the momentum, so a second one on the server
    would count it twice."""
    check_rule(rule)
    if rule == SPARSELOCO:
        if given is not None and given > 0:
            raise ValueError(
                f"outer_rule sparseloco (--outer-rule sparseloco) keeps no outer momentum, but "
                f"outer_momentum {given} (--outer-momentum) was given: drop one of them"
            )
        return 0.0
    return SGD_MOMENTUM if given is None else given


def ef_decay(rule: str | None, given: float | None) -> float:
    """The decay of a worker's error feedback: ``given``, else the server's rule's
    (``sparseloco``: ``SPARSELOCO_DECAY``; ``sgd``, or a server that names no rule: 1)."""
    if given is not None:
        return given
    return SPARSELOCO_DECAY if rule == SPARSELOCO else PLAIN_DECAY
