"""Every JSON body the server and the workers exchange, typed: the protocol's only contract,
imported by both sides (docs/design.md, "Protocol", names the class of each request and reply).

Frozen dataclasses with ``to_json()``/``from_json()`` (``codec.py``: the mapping, strict reading
of requests, tolerant reading of replies, ``MessageError`` naming the field that does not fit).
What the server decides travels in its replies (the mode, the fragment plan, the long polls'
length, all-reduce mode's outer step and collective timeout...); a worker never restates it.

- ``registration.py``: registration, heartbeats, deregistration;
- ``uploads.py``: an upload's metadata (safetensors string pairs) and receipt, the initial
  parameters' reply, a long poll's 202;
- ``quorums.py``: all-reduce mode's quorum asks, assignments and outcomes;
- ``rendezvous.py``: all-reduce mode's rendezvous store calls (a quorum's members only);
- ``swarm.py``: swarm mode's stage readiness, route table and suspect reports (its heartbeat
  and registration fields are ``registration.py``'s);
- ``operator.py``: the operator's ``/control/*`` requests;
- ``error_body.py``: the body of every error reply.
"""

from diloco.wire.messages.codec import Message, MessageError, Reply, Request
from diloco.wire.messages.error_body import ACTIONS, ErrorBody
from diloco.wire.messages.operator import (
    Kicked,
    KickWorker,
    NumWorkersUpdated,
    OptimizerUpdated,
    OuterHparams,
    Saved,
    SaveRequested,
    SaveState,
    Shutdown,
    ShuttingDown,
    UpdateNumWorkers,
    UpdateOptimizer,
)
from diloco.wire.messages.quorums import (
    Assignment,
    OutcomeRecorded,
    QuorumAsk,
    QuorumOutcome,
    quorum_prefix,
    quorum_reply,
)
from diloco.wire.messages.registration import (
    Deregister,
    Deregistered,
    Heartbeat,
    HeartbeatReply,
    LastSubmission,
    OuterStep,
    Plan,
    Register,
    Registered,
    RegisterInfo,
    Rendezvous,
    Table,
)
from diloco.wire.messages.rendezvous import (
    StoreAdd,
    StoreCompareSet,
    StoreCount,
    StoreDelete,
    StoreDeleted,
    StoreDone,
    StoreGet,
    StoreNumber,
    StoreReady,
    StoreSet,
    StoreValue,
    StoreWait,
)
from diloco.wire.messages.uploads import ParamsSeeded, Pending, UploadMeta, UploadReceipt

__all__ = [
    "ACTIONS",
    "Assignment",
    "Deregister",
    "Deregistered",
    "ErrorBody",
    "Heartbeat",
    "HeartbeatReply",
    "KickWorker",
    "Kicked",
    "LastSubmission",
    "Message",
    "MessageError",
    "NumWorkersUpdated",
    "OptimizerUpdated",
    "OutcomeRecorded",
    "OuterHparams",
    "OuterStep",
    "ParamsSeeded",
    "Pending",
    "Plan",
    "QuorumAsk",
    "QuorumOutcome",
    "Register",
    "RegisterInfo",
    "Registered",
    "Rendezvous",
    "Reply",
    "Request",
    "SaveRequested",
    "SaveState",
    "Saved",
    "Shutdown",
    "StoreAdd",
    "StoreCompareSet",
    "StoreCount",
    "StoreDelete",
    "StoreDeleted",
    "StoreDone",
    "StoreGet",
    "StoreNumber",
    "StoreReady",
    "StoreSet",
    "StoreValue",
    "StoreWait",
    "ShuttingDown",
    "Table",
    "UpdateNumWorkers",
    "UpdateOptimizer",
    "UploadMeta",
    "UploadReceipt",
    "quorum_prefix",
    "quorum_reply",
]
