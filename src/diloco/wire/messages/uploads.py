"""Parameters in and out in server mode: the metadata of a pseudo-gradient's upload
(``UploadMeta``, the ``__metadata__`` string pairs of ``POST /submit_pseudograd``) and its
receipt (``UploadReceipt``), the reply to the initial parameters (``ParamsSeeded``), and the
202 answer of a long poll that ended before its round came (``Pending``, also ``POST
/quorum``'s).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from diloco.wire.messages.codec import MessageError, Reply, spec
from diloco.wire.messages.registration import Plan

# Bounds of a reported weight (weighting='samples', or its tokens under 'tokens'). A weight multiplies an fp32 upload and the
# sum of weights divides the sum: 1e39 is a finite Python float but infinite in fp32, and
# denormal weights make the total ~0. Within these bounds every weight and any total of them is
# a normal fp32 number, which covers any count of samples or tokens one round can see
# (1e12 tokens per worker per round is far past any real run), fractions included.
MIN_WEIGHT = 1e-6
MAX_WEIGHT = 1e12

CODEC_KEY = "codec"
"""The metadata key naming an upload's codec; its options are the keys ``codec_<option>``."""


@dataclass(frozen=True)
class UploadMeta:
    """The ``__metadata__`` of a pseudo-gradient upload: string pairs, since a safetensors
    header holds nothing else (``to_metadata``, ``from_metadata``). Read strictly: an unknown
    key is refused (400 ``bad_metadata``), so is a missing one (``missing_metadata``)."""

    worker_id: str
    """The registered worker."""
    submission_id: str
    """The upload's id: a retry sends the same one, and the server counts it at most once."""
    base_round: int
    """The round (version, in async mode; the fragment's round, streaming) the pseudo-gradient
    was computed against."""
    weight: float = 1.0
    """Its weight when the server weights by samples (``--weighting samples``): the samples
    trained on (what the loop reports; the steps when it reports none). Under ``tokens`` the
    tokens' count. Ignored, and not checked, under equal weighting."""
    fragment: int | None = None
    """Streaming DiLoCo: the fragment whose pieces the body holds (required then)."""
    loss: float | None = None
    """The worker's last reported loss, for the server's loss history (finite)."""
    steps: int | None = None
    """The worker's inner steps so far, for the loss history."""
    codec: dict[str, str] = field(default_factory=dict)
    """``codec`` and its ``codec_<option>`` keys (``codec_metadata(codec)``); empty, or
    ``{"codec": "raw"}``: raw fp32/bf16 tensors, the protocol before codecs."""
    tokens: float | None = None
    """The tokens trained on since the part of the model it holds was last sent, when the loop
    counts them (``DiLoCoWorker.report(tokens=...)``). Required under ``--weighting tokens``,
    where it is the weight, bounded as ``weight``; read under that weighting only."""

    def to_metadata(self) -> dict[str, str]:
        """The string pairs, in the order a worker writes them."""
        meta = {
            "worker_id": self.worker_id,
            "base_round": str(self.base_round),
            "submission_id": self.submission_id,
            "weight": repr(float(self.weight)),
            **self.codec,
        }
        if self.fragment is not None:
            meta["fragment"] = str(self.fragment)
        if self.loss is not None:
            meta["loss"] = repr(float(self.loss))
        if self.steps is not None:
            meta["steps"] = str(int(self.steps))
        if self.tokens is not None:
            meta["tokens"] = repr(float(self.tokens))
        return meta

    @classmethod
    def from_metadata(cls, meta: Mapping[str, str], *, weighting: str) -> UploadMeta:
        """Read an upload's metadata as a server with ``weighting`` (``--weighting``) does:
        ``equal``: the weight is 1, whatever the body says; ``samples``: ``weight``, bounded;
        ``tokens``: ``tokens``, bounded and required (``missing_metadata`` without it).
        ``MessageError`` (400) names the key."""
        unknown = [k for k in meta if k not in _KEYS and not k.startswith(CODEC_KEY + "_")]
        if unknown:
            raise MessageError(
                unknown[0],
                f"unknown __metadata__ key {unknown[0]!r}; an upload's are {', '.join(_KEYS)} "
                "and codec_<option>",
                "bad_metadata",
            )
        worker_id, submission_id = meta.get("worker_id", ""), meta.get("submission_id", "")
        if not worker_id or not submission_id:
            raise MessageError(
                "worker_id" if not worker_id else "submission_id",
                "header __metadata__ needs worker_id and submission_id",
                "missing_metadata",
            )
        base_round = _int(meta, "base_round")
        tokens = _tokens(meta) if weighting == "tokens" else None
        weight = tokens if tokens is not None else _weight(meta) if weighting == "samples" else 1.0
        fragment = _fragment(meta["fragment"]) if "fragment" in meta else None
        loss = _loss(meta)
        steps = _int(meta, "steps") if "steps" in meta else None
        if steps is not None and steps < 0:
            raise MessageError("steps", "__metadata__['steps'] must be >= 0", "bad_metadata")
        codec = {k: v for k, v in meta.items() if k == CODEC_KEY or k.startswith(CODEC_KEY + "_")}
        return cls(
            worker_id, submission_id, base_round, weight, fragment, loss, steps, codec, tokens
        )


_KEYS = (
    "worker_id",
    "submission_id",
    "base_round",
    "weight",
    "fragment",
    "loss",
    "steps",
    "codec",
    "tokens",
)


def _int(meta: Mapping[str, str], key: str) -> int:
    try:
        return int(meta[key])
    except KeyError:
        raise MessageError(key, f"header __metadata__ lacks {key!r}", "missing_metadata") from None
    except ValueError:
        raise MessageError(
            key, f"__metadata__[{key!r}] must be an integer", "bad_metadata"
        ) from None


def _fragment(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise MessageError(
            "fragment", f"fragment must be an integer, got {raw!r}", "bad_fragment"
        ) from None


def _loss(meta: Mapping[str, str]) -> float | None:
    raw = meta.get("loss")
    if raw is None:
        return None
    try:
        loss = float(raw)
    except ValueError:
        loss = math.nan
    if not math.isfinite(loss):
        raise MessageError(
            "loss", f"__metadata__['loss'] must be a finite number, got {raw!r}", "bad_metadata"
        )
    return loss


def _weight(meta: Mapping[str, str], key: str = "weight") -> float:
    raw = meta.get(key, "1")
    try:
        weight = float(raw)
    except ValueError:
        raise MessageError(
            key, f"__metadata__[{key!r}] must be a number, got {raw!r}", "bad_metadata"
        ) from None
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:  # also NaN
        raise MessageError(
            key,
            f"__metadata__[{key!r}] must be a number in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}] "
            f"(a count of samples or tokens), got {raw!r}",
            "bad_metadata",
        )
    return weight


def _tokens(meta: Mapping[str, str]) -> float:
    if "tokens" not in meta:
        raise MessageError(
            "tokens",
            "the server weights uploads by tokens (--weighting tokens) and __metadata__ lacks "
            "'tokens': report them with DiLoCoWorker.report(tokens=n)",
            "missing_metadata",
        )
    return _weight(meta, "tokens")


@dataclass(frozen=True, kw_only=True)
class UploadReceipt(Reply):
    """The reply to an upload the server counted (``accepted``), or counted before under the
    same submission id (``duplicate``: a retry)."""

    status: str
    """``accepted`` or ``duplicate``."""
    round: int
    """The round (async: version) the upload was counted in."""
    version: int | None = spec(default=None, omit=True)
    """Async mode: the version whose parameters hold the upload (``round + 1``)."""
    staleness: int | None = spec(default=None, omit=True)
    """Async mode: updates applied between the upload's base and the version it hit."""
    weight: float | None = spec(default=None, omit=True)
    """Async mode: the weight the update was applied with (0: none was, ``gated``); a sync late
    merge: the weight it was counted with (its own times ``1/sqrt(1 + late)``)."""
    late: int | None = spec(default=None, omit=True)
    """Sync quorum rounds: rounds between the upload's base and ``round``, the round it counted
    in (its base round closed without it: it was merged late, with a staleness weight). Absent
    when it counted in its base round."""
    refused: str | None = spec(default=None, omit=True)
    """Async mode: why this very update was refused (its result would not be finite), the
    upload discarded; absent when it was applied."""
    submission_id: str | None = None
    """The upload's id."""
    instance: str | None = None
    """The server life that counted it."""
    fragment: int | None = spec(default=None, omit=True)
    """Streaming DiLoCo: the fragment."""
    refused_rounds: tuple[int, ...] | None = spec(default=None, omit=True)
    """The unit's last rounds refused for a non-finite result (their uploads discarded),
    once any was."""

    @property
    def gated(self) -> bool:
        """Async mode: the server acknowledged the upload but, past its age gate
        (``--staleness-cutoff``), applied nothing; ``version`` is the current one."""
        return self.weight == 0.0

    @property
    def result_round(self) -> int:
        """The round (async: version) to download to adopt this upload's result."""
        return self.version if self.version is not None else self.round + 1


@dataclass(frozen=True, kw_only=True)
class ParamsSeeded(Reply):
    """The reply to ``POST /initial_params``: the server took these parameters as the run's."""

    status: str = "ok"
    """Always ``ok``."""
    round: int | None = None
    """The parameters' round."""
    num_params: int | None = None
    """Elements in the parameters."""
    fragments: Plan | None = None
    """The fragment plan, now that the parameters are known (None in plain DiLoCo)."""
    fragment_rounds: tuple[int, ...] | None = None
    """Each fragment's round (None in plain DiLoCo)."""


@dataclass(frozen=True, kw_only=True)
class Pending(Reply):
    """202: a long poll (``GET /global_params``, ``POST /quorum``) ended before what it waits
    for; ask again."""

    status: str = "pending"
    """Always ``pending``."""
    round: int
    """The round the server holds now (a download's fragment's, with ``fragment``)."""
    fragment: int | None = spec(default=None, omit=True)
    """The fragment a download asked for."""
