"""How a server setting is declared: ``_flag`` (a field that carries its command-line flag), the
``--help`` sections, and the values and bounds some settings share with their validation."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from diloco.core.codecs import codec_by_name, codec_names
from diloco.core.codecs.downlink import check_download_codec
from diloco.core.codecs.sparse_update import SPARSE_UPDATE


def _flag(default: Any, help: str, **cli: Any) -> Any:
    """A field with a command-line flag: ``help`` and the keys that ``diloco.cli.flags``
    documents go in its metadata, so the flag is declared on the setting's own field."""
    return field(default=default, metadata={"help": help, **cli})


def _carries_updates(name: str) -> bool:
    try:
        check_download_codec(codec_by_name(name))
    except ValueError:
        return False
    return True


#: ``fp32`` (full parameters every round), the codecs that can carry a published update, and
#: ``sparse`` (plain averaged descent's changed positions, ``core/codecs/sparse_update.py``).
DOWNLOAD_CODECS = ("fp32", *(n for n in codec_names() if _carries_updates(n)), SPARSE_UPDATE)

# Sections of ``diloco server --help``.
_ASYNC = "async mode (arXiv 2401.09135)"
_DYNAMIC = "dynamic local updates and streaming fragments"
_ALLREDUCE = "all-reduce mode (issue 19)"
_SWARM = "pipeline swarm (issue 29)"
_RELAY = "regional relay (issue 31)"
#: The codecs a relay may upload with: raw tensors, whose mean the upstream adds as sent (a lossy
#: codec's error feedback would need a residual kept across relay restarts).
RELAY_CODECS = ("fp32", "bf16")
_QUORUM = "sync quorum rounds and late merges (issue 31)"
GRACE_FLOOR = 1.0
GRACE_CEILING = 60.0
ALLREDUCE_NORM_BOUND = 10.0
"""All-reduce mode's ``--clip-norm-factor`` when unset: a member is left out of a round when its
pseudo-gradient norm is above 10 x the quorum's median. Honest members' norms differ by a few
times (data, speed), a diverged member's by orders of magnitude; and unlike the server mode's
clipping, which scales an upload down, leaving out drops a member's whole round, so the default
errs wide."""
