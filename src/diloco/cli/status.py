"""``diloco status``: a server's state as a table, or its raw JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from diloco.server.observe.status import Status
from diloco.server.observe.status_json import StatusFormatError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show a server's state")
    p.add_argument(
        "--server", default=os.environ.get("DILOCO_SERVER", "127.0.0.1:8512"), help="host:port"
    )
    p.add_argument("--token", default=os.environ.get("DILOCO_TOKEN"))
    p.add_argument(
        "--tls-ca",
        default=os.environ.get("DILOCO_TLS_CA"),
        help="PEM file of the CA that signed an https:// server's certificate",
    )
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.set_defaults(func=_status)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _opt_bytes(n: int | None) -> str:
    return "-" if n is None else _fmt_bytes(n)


def _num(value: Any, fmt: str, unit: str = "") -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    return f"{value:{fmt}}{unit}"


def _allreduce_head(st: Status) -> list[str]:
    """All-reduce mode: the server holds no parameters and no barrier, so its round is the
    quorums' and what is under way is the open quorum (``server/allreduce/quorum_book.py``)."""
    q = st.quorum
    if q is not None:
        state = f"quorum {q.id} of {len(q.members)} open"
    elif st.rounds_completed or st.rounds_discarded:
        state = "between quorums"
    else:
        state = "waiting for workers"
    model = (
        f"model {_num(st.num_params, ',')} params (the workers' table)"
        if st.num_params
        else "model not known yet (no worker has registered)"
    )
    lines = [
        f"mode allreduce  round {st.round}  {state}  uptime {_num(st.uptime_s, '.0f', 's')}",
        f"workers {len(st.workers)} live, expected {st.num_workers}, min {st.min_workers}"
        f"  deaths {st.worker_deaths}  registrations {st.registrations}",
        model,
        f"quorums: completed {st.rounds_completed}, discarded {st.rounds_discarded}"
        f"  members {', '.join(q.members) if q else '-'}"
        f"  waiting {', '.join(st.pending_quorum) or '-'}",
        f"bytes in {_fmt_bytes(st.bytes_in)}  out {_fmt_bytes(st.bytes_out)} (HTTP only; "
        "the workers average among themselves)",
    ]
    if st.excluded_last:
        lines.append(f"left out of the last checked average: {', '.join(st.excluded_last)}")
    if st.excluded_rounds:
        each = ", ".join(
            f"{e.worker_id} {e.rounds} ({e.in_a_row} in a row)" for e in st.excluded_rounds
        )
        lines.append(f"rounds excluded: {each}")
    for out in st.left_out:
        left = (
            "until it registers again"
            if out.seconds_left is None
            else f"{out.seconds_left:.0f} s more"
        )
        lines.append(f"left out of quorums: {out.worker_id} ({out.reason}; {left})")
    return lines


def _swarm_head(st: Status) -> list[str]:
    """Swarm mode: no round and no parameters on the server; its stages, their replicas and
    the peers' reports instead (``server/swarm/stage_book.py``)."""
    sw = st.swarm
    assert sw is not None
    lines = [
        f"mode swarm  {sw.num_stages} stages, min {sw.min_replicas} replicas each"
        f"  routes v{sw.version}  uptime {_num(st.uptime_s, '.0f', 's')}",
        f"peers {len(st.workers)} live  deaths {st.worker_deaths}"
        f"  registrations {st.registrations}",
    ]
    for k in sw.stages:
        lines.append(
            f"stage {k.stage}: {len(k.ready)}/{len(k.assigned)} ready"
            f"  {_num(k.throughput, '.1f', ' samples/s')}  {_num(k.num_params, ',')} params"
            f"  {', '.join(k.ready) or '-'}"
        )
    for b in sw.boundaries:
        lines.append(
            f"boundary {b.boundary} {b.direction}: {_fmt_bytes(b.bytes)}"
            f"  {_num(b.bytes_per_token, '.1f', ' B/token')}"
        )
    lines.append(f"reroutes {sw.reroutes}  recoveries {sw.recoveries}")
    for x in sw.suspects:
        lines.append(f"suspect: {x.peer_id} (stage {x.stage}, by {x.reporter}: {x.reason})")
    return lines


def render_status(st: Status) -> str:
    """The state of a server at a glance (the same figures as ``/metrics``)."""
    opt, stale, workers = st.outer_optimizer, st.staleness, st.workers
    lr = "-" if opt is None else opt.lr
    momentum = "-" if opt is None or opt.momentum is None else opt.momentum
    submitted = set(st.submitted)
    state = "open" if st.opened else "waiting for workers"
    lines = (
        _allreduce_head(st)
        if st.mode == "allreduce"
        else _swarm_head(st)
        if st.swarm is not None
        else [
            f"mode {st.mode}  round {st.round}  {state}  uptime {_num(st.uptime_s, '.0f', 's')}",
            f"workers {len(workers)} live, expected {st.num_workers}, "
            f"min {st.min_workers}  deaths {st.worker_deaths}  registrations {st.registrations}",
            f"model {_num(st.num_params, ',')} params ({_fmt_bytes(st.model_bytes)})"
            f"  outer lr {lr} momentum {momentum}",
            f"round: expected {len(st.expected)}, submitted {len(submitted)}"
            f"  last round {_num(st.last_round_time_s, '.3f', ' s')}"
            f"  contributions {st.last_round_contributions}",
            f"bytes in {_fmt_bytes(st.bytes_in)}  out {_fmt_bytes(st.bytes_out)}"
            f"  rejected submissions {st.rejected_submissions}",
            f"uploads: {st.upload_slots} slot(s), {st.uploads_waiting} waiting"
            f"  last round's longest wait {_num(st.last_round_upload_wait_max_s, '.3f', ' s')}",
            f"codecs {', '.join(st.codecs) or '-'} (allowed {', '.join(st.allowed_codecs)}),"
            f" download {st.download_codec}"
            f"  last round {_opt_bytes(st.last_round_bytes_in)} up,"
            f" {_opt_bytes(st.last_round_bytes_out)} down",
        ]
    )
    if st.mode not in ("allreduce", "swarm") and (st.mode == "async" or stale.count):
        lines.append(
            f"staleness last {stale.last}  mean {_num(stale.mean, '.2f')}"
            f"  max {stale.max}  ({stale.count} submissions;"
            f" max allowed {st.max_staleness or '-'})"
        )
    if st.fragments:
        rounds = " ".join(str(f.round) for f in st.fragments)
        lines.append(f"fragments ({st.fragment_pattern}): rounds {rounds}")
    if st.quorum_rounds is not None:  # sync quorum rounds (docs/design/server-mode.md)
        q = st.quorum_rounds
        lines.append(
            f"quorum {q.quorum} (this round {q.size}), grace {q.grace}"
            f" (in force {_num(q.grace_s, '.2f', ' s')}), max lateness {q.max_lateness},"
            f" late merges {q.late_merges_total}"
        )
    if st.upstream is not None:  # a regional relay (docs/design/relay.md)
        up = st.upstream
        lines.append(
            f"relay of {up.url} as {up.relay_id}: upstream round {up.round}, {up.uploads} uploads,"
            f" last {_opt_bytes(up.last_upload_bytes)} up, {_opt_bytes(up.last_download_bytes)}"
            f" down" + (f"  ERROR {up.last_error}" if up.last_error else "")
        )
    relays = [w for w in workers if w.region is not None]
    if relays:
        lines.append("relays: " + ", ".join(f"{w.worker_id} ({w.region} workers)" for w in relays))
    if st.last_save_error:
        lines.append(f"last save FAILED: {st.last_save_error}")
    lines += [
        "",
        f"{'worker':<20} {'host':<16} {'round':>5} {'steps/s':>8} {'loss':>8} {'seen':>7}"
        f" {'sent':>10} {'recv':>10}",
    ]
    for w in workers:
        mark = "*" if w.worker_id in submitted else " "
        last = "-" if w.last_round is None else str(w.last_round)
        lines.append(
            f"{w.worker_id[:19] + mark:<20} {w.hostname[:16]:<16}"
            f" {last:>5} {_num(w.steps_per_second, '.2f'):>8}"
            f" {_num(w.loss, '.4f'):>8} {_num(w.last_seen_s_ago, '.1f', 's'):>7}"
            f" {_fmt_bytes(w.bytes_in):>10} {_fmt_bytes(w.bytes_out):>10}"
        )
    if not workers:
        lines.append("(no workers)")
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    from diloco.worker import DiLoCoClient, ServerError, Unreachable

    client = DiLoCoClient(
        args.server, token=args.token, tls_ca=args.tls_ca, retries=0, read_timeout=10
    )
    try:
        st = client.status()
    except Unreachable as exc:
        print(
            f"error: cannot reach {args.server}: {exc.__cause__ or exc}\n"
            f"Is a diloco server running at {args.server}? Start one with `diloco server`",
            file=sys.stderr,
        )
        return 2
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:  # as the server sent it, whatever its version
        print(json.dumps(st, indent=2))
        return 0
    try:
        status = Status.from_json(st)  # raises on a missing field; extra fields are ignored
    except StatusFormatError as exc:
        print(f"error: cannot read the server's status: {exc}; --json shows it", file=sys.stderr)
        return 1
    print(render_status(status))
    return 0
