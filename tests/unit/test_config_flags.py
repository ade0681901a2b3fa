"""Each setting is declared once: its flag, default and the worker's keyword all come from the
config dataclasses, and these tests fail when a copy drifts or a field is left out."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
from typing import Any

import pytest

from diloco.cli import flags, server, worker
from diloco.cli.main import build_parser
from diloco.server.config import ServerConfig
from diloco.worker import DiLoCoWorker
from diloco.worker.settings import WorkerSettings, resolve

# The command line as the README documents it: renaming or dropping a flag is a breaking change.
SERVER_FLAGS = {
    "--host", "--port", "-n", "--num-workers", "--min-workers", "--outer-lr", "--outer-momentum",
    "--no-nesterov", "--init", "--save-dir", "--save-every", "--keep", "--from-checkpoint",
    "--fresh-start", "--weighting", "--clip-norm-factor", "--trim-fraction", "--token",
    "--admin-token", "--tls-cert", "--tls-key", "--auth-failure-limit", "--heartbeat-timeout",
    "--stuck-timeout", "--join-timeout", "--poll-timeout", "--body-timeout", "--min-upload-rate",
    "--upload-rate-window", "--header-timeout", "--max-connections", "--max-connections-per-ip",
    "--upload-slots", "--async", "--max-staleness", "--staleness-weighting", "--staleness-cutoff",
    "--delayed-nesterov",
    "--dn-buffer-size", "--dn-activation", "--dylu", "--dylu-min-sync-every",
    "--dylu-base-sync-every", "--num-fragments",
    "--fragment-pattern", "--codecs", "--download-codec", "--allreduce", "--collective-timeout",
    "--swarm", "--stages", "--min-replicas",
    "--no-dashboard", "-o", "--output-dir", "--outer-rule",
    "--upstream", "--upstream-token", "--upstream-tls-ca", "--upstream-codec",
    "--quorum", "--grace", "--grace-floor", "--grace-ceiling", "--max-lateness",
}  # fmt: skip
WORKER_FLAGS = {
    "--server", "--sync-every", "--no-bf16", "--worker-id", "--heartbeat-interval", "--token",
    "--tls-ca", "--dylu", "--num-fragments", "--fragment-pattern", "--overlap-steps",
    "--merge-alpha", "--codec", "--no-error-feedback", "--save-dir", "--ef-decay",
}  # fmt: skip


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("DILOCO_"):
            monkeypatch.delenv(name)


def _subparser(name: str) -> argparse.ArgumentParser:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise AssertionError("no subcommands")


def _options(parser: argparse.ArgumentParser, hidden: bool = False) -> set[str]:
    """The parser's options: shown in --help, or (``hidden``) accepted only to be explained."""
    return {
        s
        for a in parser._actions
        if (a.help == argparse.SUPPRESS) == hidden
        for s in a.option_strings
    } - {"-h", "--help"}


@pytest.mark.parametrize(
    ("cls", "not_exposed"),
    [(ServerConfig, server.NOT_EXPOSED), (WorkerSettings, worker.NOT_EXPOSED)],
)
def test_every_field_has_a_flag_unless_listed_with_a_reason(
    cls: type, not_exposed: dict[str, str]
) -> None:
    fields = {f.name for f in dataclasses.fields(cls)}
    flagged = {flag.field for flag in flags.flags(cls)}
    assert fields - flagged == set(not_exposed), (
        f"give each {cls.__name__} field a flag (help in its metadata) or list it, with the "
        "reason, in the command's NOT_EXPOSED"
    )
    assert all(reason.strip() for reason in not_exposed.values())


def test_the_documented_flags_are_all_there() -> None:
    assert _options(_subparser("server")) == SERVER_FLAGS
    assert _options(_subparser("worker")) == WORKER_FLAGS
    assert _options(_subparser("status")) == {"--server", "--token", "--tls-ca", "--json"}
    # The reference's project options: taken only to say what to write instead.
    forgather = {name for names in worker.FORGATHER_OPTIONS for name in names}
    assert _options(_subparser("worker"), hidden=True) == forgather


def test_server_flag_defaults_are_the_dataclass_defaults(clean_env: None) -> None:
    args = build_parser().parse_args(["server"])
    defaults = ServerConfig()
    parsed = flags.values(ServerConfig, args)
    # The fields' defaults (outer_momentum's None is resolved by the rule at construction).
    declared = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    assert parsed == {name: declared[name] for name in parsed}
    assert ServerConfig(**parsed) == defaults


def test_worker_flags_leave_defaults_to_the_variables_then_the_dataclass(
    clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = build_parser().parse_args(["worker", "--", "true"])
    parsed = flags.values(WorkerSettings, args)
    assert set(parsed.values()) == {None}  # unset, so DILOCO_* variables are not overridden
    assert resolve(parsed) == WorkerSettings()
    monkeypatch.setenv("DILOCO_SYNC_EVERY", "40")
    assert resolve(parsed).sync_every == 40
    given = flags.values(WorkerSettings, build_parser().parse_args(["worker", "--sync-every", "9"]))
    assert resolve(given).sync_every == 9


def test_flags_that_are_not_the_field_name(clean_env: None) -> None:
    def parse(*argv: str) -> dict[str, Any]:
        return flags.values(ServerConfig, build_parser().parse_args(["server", *argv]))

    got = parse("--no-nesterov", "--init", "m.safetensors", "--keep", "5", "-n", "3", "--async")
    assert (got["nesterov"], got["initial_params"], got["keep_checkpoints"]) == (
        False, "m.safetensors", 5,
    )  # fmt: skip
    assert (got["num_workers"], got["mode"]) == (3, "async")
    no_bf16 = build_parser().parse_args(["worker", "--no-bf16", "--dylu"])
    assert (no_bf16.bf16_comm, no_bf16.dylu) == (False, True)
    no_feedback = build_parser().parse_args(["worker", "--no-error-feedback"])
    assert (no_feedback.error_feedback, no_bf16.error_feedback) == (False, None)  # None: unset


def test_token_flags_read_their_variable(monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    monkeypatch.setenv("DILOCO_TOKEN", "from-the-environment")
    monkeypatch.setenv("DILOCO_ADMIN_TOKEN", "")  # empty: unset
    got = flags.values(ServerConfig, build_parser().parse_args(["server"]))
    assert (got["token"], got["admin_token"]) == ("from-the-environment", None)
    got = flags.values(ServerConfig, build_parser().parse_args(["server", "--token", ""]))
    assert got["token"] is None


def test_unknown_flag_metadata_is_an_error() -> None:
    @dataclasses.dataclass(frozen=True)
    class Typo:
        x: int = dataclasses.field(default=1, metadata={"help": "x", "shrot": "-x"})

    with pytest.raises(TypeError, match="shrot"):
        flags.flags(Typo)


def test_worker_keywords_are_the_settings_fields() -> None:
    params = inspect.signature(DiLoCoWorker.__init__).parameters
    # process_group and partitioned describe the process, stages a swarm peer's place in its
    # pipeline, start_state a checkpoint's tensors, not the run: no DILOCO_* variable
    excluded = ("self", "model", "optimizer", "client", "process_group", "partitioned", "stages")
    excluded += ("start_state",)
    keywords = {n: p for n, p in params.items() if n not in excluded}
    assert set(keywords) == {f.name for f in dataclasses.fields(WorkerSettings)}
    # None means "not given": the DILOCO_* variable, then the WorkerSettings default, applies.
    assert {n: p.default for n, p in keywords.items()} == dict.fromkeys(keywords)


def test_worker_keywords_reach_the_settings(clean_env: None) -> None:
    import torch

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert DiLoCoWorker(model, opt).settings == WorkerSettings()
    given = {
        "server_addr": "10.9.8.7:1234",
        "sync_every": 40,
        "bf16_comm": False,
        "worker_id": "w-1",
        "token": "token-123",
        "tls_ca": "ca.pem",
        "heartbeat_interval": 7.0,
        "connect_timeout": 3.0,
        "read_timeout": 99.0,
        "retries": 2,
        "max_barrier_wait": 11.0,
        "num_fragments": 4,
        "fragment_pattern": "strided",
        "overlap_steps": 1,
        "merge_alpha": 0.25,
        "dylu": True,
        "log_level": "WARNING",
        "codec": "int8",
        "error_feedback": False,
        "ef_decay": 0.5,
        "save_dir": "/tmp/run-ckpt",
        "enabled": False,
    }
    assert set(given) == {f.name for f in dataclasses.fields(WorkerSettings)}
    defaults = WorkerSettings()
    assert all(value != getattr(defaults, name) for name, value in given.items())
    settings = DiLoCoWorker(model, opt, **given).settings
    assert {name: getattr(settings, name) for name in given} == given


def test_quorum_flags_are_refused_where_they_make_no_sense() -> None:
    """``--quorum`` and its flags: parsed once in ``ServerConfig``, each misuse a clear
    ``ValueError`` before a server starts; with a quorum the fragmenting is fixed at one unit,
    so a streaming worker is told at registration (409 fragments_mismatch)."""
    ok = ServerConfig(num_workers=4, quorum="3", grace="2.5", max_lateness=2)
    assert (ok.quorum_value, ok.grace_seconds, ok.num_fragments) == (3, 2.5, 1)
    assert ServerConfig(quorum="0.5").quorum_value == 0.5
    assert ServerConfig(quorum="1", grace="auto").grace_seconds is None
    assert ServerConfig().quorum_value is None and ServerConfig().num_fragments is None
    for settings, says in (
        ({"grace": "3"}, "--grace need --quorum"),
        ({"max_lateness": 2}, "--max-lateness need --quorum"),
        ({"grace_ceiling": 10.0}, "--grace-ceiling need --quorum"),
        ({"quorum": "2", "mode": "async"}, "--quorum cannot go with --async"),
        ({"quorum": "2", "allreduce": True}, "--quorum cannot go with --allreduce"),
        ({"quorum": "2", "num_fragments": 2}, "--quorum cannot go with --num-fragments"),
        ({"quorum": "two"}, "a count (an int >= 1) or a fraction"),
        ({"quorum": "1.5"}, "a fractional quorum must be in (0, 1]"),
        ({"quorum": "2", "grace": "soon"}, "grace must be 'auto' or seconds"),
        ({"quorum": "2", "grace": "3", "grace_floor": 0.0}, "bound --grace auto only"),
        ({"quorum": "2", "grace_floor": 5.0, "grace_ceiling": 1.0}, "grace_floor <= grace_ceiling"),
        ({"quorum": "2", "max_lateness": -1}, "max_lateness must be >= 0"),
        ({"quorum": "1", "num_workers": 3, "min_workers": 2}, "below min_workers"),
    ):
        with pytest.raises(ValueError, match=re.escape(says)):
            ServerConfig(**settings)  # type: ignore[arg-type]
