"""Which stage a joining peer hosts: a pure policy over the stages' replicas now.

1. Fill every stage to ``min_replicas``: among the stages that fit the peer and are below it,
   the one with the fewest replicas, the lowest index on a tie. Fewest first (not stage 0 to
   ``min_replicas``, then stage 1...) makes the pipeline complete, one replica per stage, as
   soon as ``num_stages`` peers joined, and redundant next.
2. Then feed the bottleneck: the fitting stage whose replicas together reported the least
   throughput (samples per second). A replica that reported nothing yet counts as its stage's
   mean reported one; a fitting stage where none reported is unknown, and while any is, the
   fewest-replicas rule of 1 decides (a guess would be no better than the count).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence


def fitting(num_stages: int, fits: Collection[int] | None) -> list[int]:
    """The stages a peer can host, in order; ``fits`` None: all. A ``ValueError`` (the
    registration's 400) when none of ``fits`` is a stage of this pipeline."""
    stages = list(range(num_stages)) if fits is None else sorted(s for s in fits if s < num_stages)
    if not stages:
        raise ValueError(
            f"none of the stages the peer fits ({sorted(fits or ())}) is one of this "
            f"pipeline's 0..{num_stages - 1}"
        )
    return stages


def stage_throughput(reported: Sequence[float | None]) -> float | None:
    """A stage's throughput from its replicas' reports (None: none reported, or no replica:
    unknown; a stage without replicas is fed by rule 1 first anyway)."""
    known = [r for r in reported if r is not None]
    if not known:
        return None
    mean = sum(known) / len(known)
    return sum(known) + mean * (len(reported) - len(known))


def choose_stage(
    num_stages: int,
    min_replicas: int,
    replicas: Mapping[int, Sequence[float | None]],
    fits: Collection[int] | None = None,
) -> int:
    """The stage a joining peer is assigned. ``replicas``: per stage, the throughput each of
    its current replicas reported (None: not yet); a stage missing from it has none."""
    stages = fitting(num_stages, fits)

    def count(stage: int) -> int:
        return len(replicas.get(stage, ()))

    def fewest(among: list[int]) -> int:
        return min(among, key=lambda s: (count(s), s))

    below = [s for s in stages if count(s) < min_replicas]
    if below:
        return fewest(below)
    measured = {s: stage_throughput(replicas.get(s, ())) for s in stages}
    if any(t is None for t in measured.values()):
        return fewest(stages)
    return min(stages, key=lambda s: (measured[s] or 0.0, count(s), s))


def choose_move(
    num_stages: int,
    assigned: Mapping[str, int],
    fits: Mapping[str, Collection[int] | None],
    throughput: Mapping[str, float | None],
    movable: Collection[str] | None = None,
) -> tuple[str, int] | None:
    """A peer to move, and where, when a stage served by replicas (1..S-1) has none left while
    another stage has more than one; None when no move is due or none fits. ``assigned``:
    peer -> stage; ``fits``: what each peer said fits it (None: any); ``throughput``: what
    each reported (None: nothing yet, which counts as the lowest); ``movable``: the peers that
    may be moved (None: all; the coordinator's: those that served, since a plain stage-sync
    worker cannot change its module).

    The head stage is never a target: its replicas are the drivers, which hold the data; with
    no head left nothing calls the others anyway. The empty stage with the lowest index is
    filled first. The peer comes from the stage with the most replicas, a stage other than the
    head's preferred on a tie (a head is a driver: moving it takes a feeder of data away), then
    the lowest throughput (the least work lost), then the id."""
    counts: dict[int, int] = {}
    for k in assigned.values():
        counts[k] = counts.get(k, 0) + 1
    for target in range(1, num_stages):
        if counts.get(target, 0):
            continue
        donors = [
            p
            for p, k in assigned.items()
            if counts[k] > 1
            and (movable is None or p in movable)
            and target in fitting(num_stages, fits.get(p))
        ]
        if donors:
            peer = min(
                donors,
                key=lambda p: (
                    -counts[assigned[p]],
                    assigned[p] == 0,
                    throughput.get(p) or 0.0,
                    p,
                ),
            )
            return peer, target
    return None
