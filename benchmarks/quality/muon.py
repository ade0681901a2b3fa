"""Muon as DiLoCo's inner optimizer (MuLoCo, arXiv 2505.23725): its experiment and its claim.

MuLoCo's finding: with Muon inside, DiLoCo loses less as the number of workers grows than with
AdamW. Here the global batch and the steps are held fixed and the batch is split over the M
workers (equal total tokens for every M, as Streaming DiLoCo's figure 12a does), so a loss rising
with M is the price of more replicas, not of fewer tokens. The experiment does the same at M = 1, 4, 8
(``Scale.muon_workers``, global batch ``Scale.muon_batch``), once with AdamW and once with Muon
on the hidden matrices (``benchmarks/harness/inner.py``), same pretrained start, each at the lr
the sweep chose for its kind (``tuning.lr_kind``: Muon's rows have their own kinds).
"""

from __future__ import annotations

from benchmarks.quality.experiments import Config, Scale, plain
from benchmarks.quality.rules import decide
from benchmarks.quality.stats import Results, fmt, paired

REPRODUCED, NOT_REPRODUCED = "reproduced", "not reproduced"


def name(inner: str, m: int) -> str:
    return f"{'Muon' if inner == 'muon' else 'AdamW'} inner, M={m}"


def split_batch(s: Scale, workers: int) -> int:
    """Each worker's batch: the claim's global batch ``s.muon_batch`` split over ``workers``."""
    if s.muon_batch % workers:
        raise ValueError(f"muon_batch {s.muon_batch} does not split over {workers} workers")
    return s.muon_batch // workers


def muon(s: Scale) -> list[Config]:
    """Claim p (MuLoCo): DiLoCo with AdamW and with Muon (hidden matrices; AdamW for embeddings,
    head, norms and biases) as the inner optimizer at M = 1, 4 and 8 workers, the global batch
    held fixed and split over the workers (equal total tokens), same steps and lr."""
    out = []
    for inner in ("adamw", "muon"):
        for m in s.muon_workers:
            batch = split_batch(s, m)
            out.append(plain(s, name(inner, m), workers=m, inner=inner, batch_size=batch))
    return out


def degradation(r: dict, inner: str, m: int, base: int) -> list[float]:
    """Per seed, loss at ``m`` workers minus loss at ``base`` workers, for ``inner``."""
    return paired(r, name(inner, m), name(inner, base))


def claim_p(results: Results) -> tuple[str, str, str]:
    """Ours, verdict and note of claim p by its rule (``rules.RULES["p"]``)."""
    res = results["muon"]
    counts = sorted({int(r["config"]["workers"]) for r in res["rows"]})
    base, parts = counts[0], []
    for m in counts[1:]:
        adamw, mu = degradation(res, "adamw", m, base), degradation(res, "muon", m, base)
        parts.append(f"M={m}: AdamW {fmt(adamw, signed=True)}, Muon {fmt(mu, signed=True)}")
    top = counts[-1]
    adamw, mu = degradation(res, "adamw", top, base), degradation(res, "muon", top, base)
    # Per seed, Muon's degradation minus AdamW's (both lists are in seed order: ``paired``).
    ok = len(mu) == len(adamw) and decide("p", [[b - a for a, b in zip(adamw, mu, strict=True)]])
    at_one = paired(res, name("muon", base), name("adamw", base))
    note = f"Muon − AdamW at M={base}: {fmt(at_one, signed=True)}"
    text = f"loss at M minus loss at M={base}: " + "; ".join(parts)
    return text, REPRODUCED if ok else NOT_REPRODUCED, note
