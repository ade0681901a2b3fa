"""The protocol's message classes (``diloco.wire.messages``): every class survives a round trip
through JSON; requests are read strictly (an unknown, missing or mistyped field is an error
that names it), replies tolerantly (unknown fields ignored, a missing optional field takes its
default)."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest

from diloco.wire import WireError
from diloco.wire.messages import (
    Assignment,
    Deregister,
    Deregistered,
    ErrorBody,
    Heartbeat,
    HeartbeatReply,
    Kicked,
    KickWorker,
    LastSubmission,
    Message,
    MessageError,
    NumWorkersUpdated,
    OptimizerUpdated,
    OutcomeRecorded,
    OuterHparams,
    OuterStep,
    ParamsSeeded,
    Pending,
    QuorumAsk,
    QuorumOutcome,
    Register,
    Registered,
    RegisterInfo,
    Rendezvous,
    Reply,
    Request,
    Saved,
    SaveRequested,
    SaveState,
    Shutdown,
    ShuttingDown,
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
    UpdateNumWorkers,
    UpdateOptimizer,
    UploadMeta,
    UploadReceipt,
    quorum_reply,
)

TABLE = (("w", (3, 4)), ("b", (4,)))
PLAN = ((("w[0:8]", "w", 0, 8),), (("w[8:12]", "w", 8, 12), ("b", "b", 0, 4)))
INFO = RegisterInfo(
    pid=7,
    device="cpu",
    sync_every=50,
    heartbeat_interval=0.5,
    num_fragments=2,
    fragment_pattern="strided",
    codec={"codec": "int8", "codec_block": "64"},
    params=TABLE,
)
SERVER_MODE = Registered(
    worker_id="w-1",
    round=3,
    mode="sync",
    instance="abc",
    has_params=True,
    num_workers=2,
    poll_timeout=30.0,
    codecs=("fp32", "bf16"),
    fragments=PLAN,
    fragment_rounds=(3, 2),
    recommended_sync_every=40,
    last_submission=LastSubmission(counted_in=2, in_params=True),
    params=TABLE,
)
ALLREDUCE = dataclasses.replace(
    SERVER_MODE,
    mode="allreduce",
    has_params=False,
    fragments=None,
    fragment_rounds=None,
    last_submission=LastSubmission(counted_in=None, in_params=False),
    rendezvous=Rendezvous(path="/rendezvous"),
    collective_timeout=10.0,
    weighting="samples",
    outer=OuterStep(lr=0.7, momentum=0.9, nesterov=True),
)
ASSIGNMENT = Assignment(
    quorum_id="i-3",
    rank=1,
    size=2,
    members=("a", "b"),
    round=4,
    hash="h4",
    source=0,
    resync=(1,),
    rendezvous=Rendezvous(path="/rendezvous"),
    timeout=30.0,
    save=True,
    made_by="i-2",
    comm="bf16",
)

#: One instance of every JSON message class, with every field set (and some left out).
EXAMPLES: list[Message] = [
    INFO,
    RegisterInfo(),
    Register(worker_id="w-1", hostname="box", info=INFO, last_submission_id="s-9"),
    Register(),
    SERVER_MODE,
    ALLREDUCE,
    LastSubmission(counted_in=None, in_params=False),
    Rendezvous(path="/r"),
    OuterStep(lr=0.5, momentum=0.0, nesterov=False),
    Heartbeat("w-1", 12.5, 2.25, 0.1, True),
    Heartbeat("w-1"),
    HeartbeatReply(round=2, recommended_sync_every=9),
    HeartbeatReply(round=2),
    Deregister("w-1"),
    Deregistered(round=5),
    UploadReceipt(status="accepted", round=3, submission_id="s", instance="i"),
    UploadReceipt(
        status="accepted",
        round=3,
        version=4,
        staleness=1,
        weight=0.5,
        refused="non-finite",
        submission_id="s",
        instance="i",
        fragment=1,
        refused_rounds=(1, 2),
    ),
    ParamsSeeded(round=0, num_params=16, fragments=PLAN, fragment_rounds=(0, 0)),
    ParamsSeeded(round=0, num_params=16, fragments=None, fragment_rounds=None),
    Pending(round=2),
    Pending(round=2, fragment=1),
    QuorumAsk("w-1", 3, "h3", True),
    QuorumAsk("w-1", 0, "", False),
    ASSIGNMENT,
    QuorumOutcome("w-1", "i-3", True, 5, "h5"),
    QuorumOutcome("w-1", "i-3", False, error="a member died"),
    OutcomeRecorded(status="recorded", quorum_id="i-3", round=5),
    OutcomeRecorded(status="discarded", quorum_id="i-3", round=4, detail="b failed"),
    SaveState(),
    Saved(path="/tmp/ckpt/round-3", round=3),
    SaveRequested(round=3),
    KickWorker("w-2"),
    Kicked(round=1, kicked="w-2"),
    UpdateOptimizer(lr=0.5, momentum=0.8),
    UpdateOptimizer(momentum=0.8),
    OuterHparams(lr=0.5),
    OptimizerUpdated(outer_optimizer=OuterHparams(lr=0.5, momentum=0.8)),
    UpdateNumWorkers(4),
    NumWorkersUpdated(num_workers=4),
    Shutdown(save=False),
    StoreSet("w-1", "i-3", "0/1", "AAEC"),
    StoreGet("w-1", "i-3", "0/1", 2.5),
    StoreGet("w-1", "i-3", "0/1"),
    StoreAdd("w-1", "i-3", "n", -3),
    StoreCompareSet("w-1", "i-3", "k", "", "eA=="),
    StoreWait("w-1", "i-3", ("0/0", "0/1"), 1.0),
    StoreDelete("w-1", "i-3", "k"),
    StoreCount("w-1", "i-3"),
    StoreCount("w-1", "i-3", position=5),
    StoreWait("w-1", "i-3", ("0/0",), position=255),
    StoreDone(),
    StoreValue(found=True, value="eA=="),
    StoreValue(found=False),
    StoreNumber(value=4),
    StoreReady(ready=False),
    StoreDeleted(deleted=True),
    ShuttingDown(save=True, round=2),
    ErrorBody(error="bad_field", detail="'x' must be a string"),
    ErrorBody(
        error="stale_round",
        detail="rebase",
        round=3,
        action="rebase",
        staleness=4,
        fragment=1,
        fragments=2,
        fragment_pattern="sequential",
        allowed=("fp32",),
    ),
]
CLASSES = sorted({type(m) for m in EXAMPLES}, key=lambda c: c.__name__)


def _all_message_classes() -> set[type]:
    import diloco.wire.messages as messages

    return {
        c
        for c in vars(messages).values()
        if isinstance(c, type) and issubclass(c, Message) and c not in (Message, Request, Reply)
    }


def test_every_message_class_has_an_example() -> None:
    assert set(CLASSES) == _all_message_classes()


def test_every_class_and_field_has_a_docstring() -> None:
    """Fields are documented by the string that follows them in the class body."""
    import ast
    import inspect

    for cls in [*_all_message_classes(), UploadMeta]:
        assert cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("), cls
        tree = ast.parse(inspect.getsource(cls))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                after = body[i + 1] if i + 1 < len(body) else None
                documented = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                assert documented, f"{cls.__name__}.{ast.unparse(node.target)}"


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_through_json(message: Message) -> None:
    data = json.loads(json.dumps(message.to_json()))
    assert type(message).from_json(data) == message
    assert json.loads(json.dumps(type(message).from_json(data).to_json())) == data


def test_fields_left_out_and_written() -> None:
    assert Register().to_json() == {"info": {}}
    assert Heartbeat("a").to_json() == {"worker_id": "a"}
    assert QuorumOutcome("a", "q", False, error="x").to_json() == {
        "worker_id": "a",
        "quorum_id": "q",
        "ok": False,
        "error": "x",
    }
    plain = SERVER_MODE.to_json()
    assert "rendezvous" not in plain and "outer" not in plain
    assert dataclasses.replace(SERVER_MODE, instance=None).to_json()["instance"] is None
    assert ALLREDUCE.to_json()["outer"] == {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    assert INFO.to_json()["params"] == [["w", [3, 4]], ["b", [4]]]
    # A rendezvous call at position 0 is today's body; another position is named.
    assert StoreSet("w", "q", "k", "", position=0).to_json() == {
        "worker_id": "w",
        "quorum_id": "q",
        "key": "k",
        "value": "",
    }
    assert StoreCount("w", "q", position=3).to_json() == {
        "worker_id": "w",
        "quorum_id": "q",
        "position": 3,
    }


def test_upload_metadata_round_trip() -> None:
    meta = UploadMeta("w", "s", 3, 2.5, 1, 0.25, 40, {"codec": "int8", "codec_block": "64"})
    pairs = meta.to_metadata()
    assert all(isinstance(v, str) for v in pairs.values())
    assert pairs["weight"] == "2.5" and pairs["codec_block"] == "64"
    assert UploadMeta.from_metadata(pairs, weighting="samples") == meta
    plain = UploadMeta("w", "s", 0)
    assert plain.to_metadata() == {
        "worker_id": "w",
        "base_round": "0",
        "submission_id": "s",
        "weight": "1.0",
    }
    assert UploadMeta.from_metadata(plain.to_metadata(), weighting="equal") == plain


# --- requests: strict ---------------------------------------------------------------------------

REQUESTS: list[tuple[type[Request], dict[str, Any]]] = [
    (Register, {"worker_id": "w", "info": {"num_fragments": 1}}),
    (RegisterInfo, {"sync_every": 5}),
    (Heartbeat, {"worker_id": "w", "loss": 1.0}),
    (Deregister, {"worker_id": "w"}),
    (QuorumAsk, {"worker_id": "w", "round": 0, "hash": ""}),
    (QuorumOutcome, {"worker_id": "w", "quorum_id": "q", "ok": True, "round": 1, "hash": "h"}),
    (SaveState, {}),
    (KickWorker, {"worker_id": "w"}),
    (UpdateOptimizer, {"lr": 0.1}),
    (UpdateNumWorkers, {"num_workers": 3}),
    (Shutdown, {"save": True}),
]


def _error(cls: type[Message], data: object) -> MessageError:
    with pytest.raises(MessageError) as info:
        cls.from_json(data)
    err = info.value
    assert isinstance(err, WireError) and (err.status, err.code) == (400, "bad_field")
    return err


@pytest.mark.parametrize(("cls", "good"), REQUESTS, ids=lambda v: getattr(v, "__name__", ""))
def test_a_request_refuses_an_unknown_field(cls: type[Request], good: dict[str, Any]) -> None:
    cls.from_json(good)
    err = _error(cls, {**good, "colour": "blue"})
    assert err.field == "colour" and "'colour'" in err.detail


@pytest.mark.parametrize(("cls", "good"), REQUESTS, ids=lambda v: getattr(v, "__name__", ""))
def test_a_request_refuses_a_missing_field(cls: type[Request], good: dict[str, Any]) -> None:
    required = [
        f.name
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    for name in required:
        err = _error(cls, {k: v for k, v in good.items() if k != name})
        assert err.field == name and repr(name) in err.detail


@pytest.mark.parametrize(("cls", "good"), REQUESTS, ids=lambda v: getattr(v, "__name__", ""))
def test_a_request_refuses_a_field_of_the_wrong_type(
    cls: type[Request], good: dict[str, Any]
) -> None:
    for name in good:
        wrong: object = [] if not isinstance(good[name], list) else "x"
        err = _error(cls, {**good, name: wrong})
        assert err.field.startswith(name) and repr(err.field) in err.detail


@pytest.mark.parametrize(
    ("cls", "body", "field", "says"),
    [
        (Register, {"worker_id": 7}, "worker_id", "non-empty string of at most 256"),
        (Register, {"worker_id": ""}, "worker_id", "non-empty"),
        (Register, {"worker_id": "x" * 257}, "worker_id", "256"),
        (Register, {"info": []}, "info", "JSON object"),
        (Register, {"info": {"num_fragments": 0}}, "info.num_fragments", "integer >= 1"),
        (Register, {"info": {"num_fragments": True}}, "info.num_fragments", "integer >= 1"),
        (Register, {"info": {"fragment_pattern": "x"}}, "info.fragment_pattern", "'strided'"),
        (Register, {"info": {"codec": "int8"}}, "info.codec", "'codec' key"),
        (Register, {"info": {"codec": {"codec_block": "64"}}}, "info.codec", "'codec' key"),
        (Register, {"info": {"params": []}}, "info.params", "non-empty"),
        (Register, {"info": {"params": [["b", ["4"]]]}}, "info.params", "dims >= 0"),
        (Register, {"info": {"params": [["b", [4]], ["b", [4]]]}}, "info.params", "distinct"),
        (Register, {"info": {"x": 1}}, "info.x", "unknown field 'info.x'"),
        (Heartbeat, {"worker_id": "a", "loss": math.nan}, "loss", "finite number"),
        (Heartbeat, {"worker_id": "a", "loss": "low"}, "loss", "finite number"),
        (Heartbeat, {"worker_id": "a", "steps_per_second": True}, "steps_per_second", "number"),
        (Heartbeat, {"worker_id": "a", "syncing": 1}, "syncing", "boolean"),
        (QuorumAsk, {"worker_id": "a", "round": -1}, "round", "integer >= 0"),
        (QuorumAsk, {"worker_id": "a", "round": 1.0}, "round", "integer >= 0"),
        (QuorumAsk, {"worker_id": "a", "round": 0, "hash": "h" * 257}, "hash", "256"),
        (QuorumOutcome, {"worker_id": "a", "quorum_id": "q", "ok": True, "hash": "h"}, "round", ""),
        (QuorumOutcome, {"worker_id": "a", "quorum_id": "q", "ok": True, "round": 1}, "hash", ""),
        (QuorumOutcome, {"worker_id": "a", "quorum_id": "q", "ok": False, "error": 3}, "error", ""),
        (UpdateOptimizer, {}, "lr", "give 'lr', 'momentum' or both"),
        (UpdateOptimizer, {"lr": math.inf}, "lr", "finite"),
        (UpdateNumWorkers, {"num_workers": 2.5}, "num_workers", "integer"),
        (StoreCount, {"worker_id": "a", "quorum_id": "q", "position": -1}, "position", "[0, 256)"),
        (StoreCount, {"worker_id": "a", "quorum_id": "q", "position": 256}, "position", "[0, 256)"),
        (StoreCount, {"worker_id": "a", "quorum_id": "q", "position": True}, "position", "integer"),
        (StoreCount, {"worker_id": "a", "quorum_id": "q", "position": 1.0}, "position", "integer"),
    ],
)
def test_request_errors_name_the_field(
    cls: type[Request], body: dict[str, Any], field: str, says: str
) -> None:
    err = _error(cls, body)
    assert err.field == field and says in err.detail, err.detail


def test_request_defaults_and_normalizing() -> None:
    assert Register.from_json({}).info == RegisterInfo()
    assert RegisterInfo().fragmenting == (1, "sequential")
    assert INFO.fragmenting == (2, "strided")
    assert QuorumAsk.from_json({"worker_id": "a", "round": 2, "hash": "h"}) == QuorumAsk(
        "a", 2, "h", True
    )
    assert not QuorumAsk.from_json({"worker_id": "a", "round": 0}).holds
    assert not QuorumAsk("a", 0, "h", False).holds
    failed = QuorumOutcome.from_json({"worker_id": "a", "quorum_id": "q", "ok": False,
                                      "error": "x" * 900})  # fmt: skip
    assert failed.round is None and len(failed.error) == 500  # cut, not refused
    assert UpdateOptimizer.from_json({"lr": 1}).lr == 1.0  # an integer is a number
    assert Shutdown.from_json({}).save is True
    with pytest.raises(MessageError, match="the body must be a JSON object"):
        Register.from_json([])


@pytest.mark.parametrize(
    ("meta", "code", "named"),
    [
        ({}, "missing_metadata", "worker_id"),
        ({"worker_id": "", "submission_id": "s", "base_round": "0"}, "missing_metadata", "worker_id"),
        ({"worker_id": "w", "base_round": "0"}, "missing_metadata", "submission_id"),
        ({"worker_id": "w", "submission_id": "s"}, "missing_metadata", "base_round"),
        ({"worker_id": "w", "submission_id": "s", "base_round": "0.5"}, "bad_metadata", "base_round"),
        ({"worker_id": "w", "submission_id": "s", "base_round": "0", "weight": "x"}, "bad_metadata",
         "weight"),
        ({"worker_id": "w", "submission_id": "s", "base_round": "0", "weight": "1e13"},
         "bad_metadata", "weight"),
        ({"worker_id": "w", "submission_id": "s", "base_round": "0", "loss": "nan"}, "bad_metadata",
         "loss"),
        ({"worker_id": "w", "submission_id": "s", "base_round": "0", "steps": "-1"}, "bad_metadata",
         "steps"),
        ({"worker_id": "w", "submission_id": "s", "base_round": "0", "fragment": "x"},
         "bad_fragment", "fragment"),
        ({"worker_id": "w", "submission_id": "s", "base_round": "0", "format": "pt"},
         "bad_metadata", "format"),
    ],
)  # fmt: skip
def test_upload_metadata_is_read_strictly(meta: dict[str, str], code: str, named: str) -> None:
    with pytest.raises(MessageError) as info:
        UploadMeta.from_metadata(meta, weighting="samples")
    assert (info.value.code, info.value.field) == (code, named)
    assert named in info.value.detail


def test_an_upload_weight_counts_only_when_the_server_weights_by_samples() -> None:
    meta = {"worker_id": "w", "submission_id": "s", "base_round": "0", "weight": "not-a-number"}
    assert UploadMeta.from_metadata(meta, weighting="equal").weight == 1.0


# --- replies: tolerant --------------------------------------------------------------------------

REPLIES = [m for m in EXAMPLES if isinstance(m, Reply)]


@pytest.mark.parametrize("message", REPLIES, ids=lambda m: type(m).__name__)
def test_a_reply_ignores_unknown_fields(message: Reply) -> None:
    data = {**message.to_json(), "from_a_newer_server": {"anything": [1, 2]}}
    assert type(message).from_json(data) == message


@pytest.mark.parametrize("message", REPLIES, ids=lambda m: type(m).__name__)
def test_a_reply_missing_an_optional_field_takes_its_default(message: Reply) -> None:
    data = message.to_json()
    for f in dataclasses.fields(message):  # type: ignore[arg-type]
        if f.name not in data or f.default is dataclasses.MISSING:
            continue
        less = {k: v for k, v in data.items() if k != f.name}
        assert getattr(type(message).from_json(less), f.name) == f.default


def test_a_reply_still_refuses_what_it_cannot_use() -> None:
    err = _error(Assignment, {k: v for k, v in ASSIGNMENT.to_json().items() if k != "rank"})
    assert err.field == "rank"
    err = _error(Assignment, {**ASSIGNMENT.to_json(), "rendezvous": {"host": "h"}})
    assert err.field == "rendezvous.path"
    err = _error(Registered, {**SERVER_MODE.to_json(), "fragment_rounds": ["1"]})
    assert err.field == "fragment_rounds"


def test_reply_helpers() -> None:
    assert quorum_reply({"status": "pending", "round": 3}) == Pending(round=3)
    assert quorum_reply(ASSIGNMENT.to_json()) == ASSIGNMENT
    assert ASSIGNMENT.receiving and not dataclasses.replace(ASSIGNMENT, rank=0).receiving
    assert ALLREDUCE.allreduce and not SERVER_MODE.allreduce
    sync = UploadReceipt(status="accepted", round=3, submission_id="s", instance="i")
    assert sync.result_round == 4
    assert dataclasses.replace(sync, version=9).result_round == 9


def test_an_error_body_is_read_as_far_as_it_can_be() -> None:
    assert ErrorBody.of({"error": "x", "detail": "d", "round": "3"}) == ErrorBody(
        error="x", detail="d"
    )
    assert ErrorBody.of(["not", "an", "object"]) == ErrorBody(error="http_error")
    assert ErrorBody.of({"error": "x"}).detail == ""
    conflict = ErrorBody.of({"error": "stale_round", "detail": "d", "round": 2, "action": "rebase"})
    assert (conflict.round, conflict.action) == (2, "rebase")
