"""The server of chaos_allreduce: ``diloco server --allreduce`` that counts what it logs.

A ``harness.server_process.ServerProcess`` (killed with SIGKILL and restarted on its port) whose
log lines are scanned as they come: per life, the workers that registered, the quorums formed
(and whether a restarted life formed one before its workers were back), completed and
discarded (with their reasons), and any member whose state was not the majority's.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.server_process import ServerProcess

COMPLETED = re.compile(r"quorum (\S+) completed: round (\d+)")
FORMED = re.compile(r"quorum (\S+) formed: (.*) at round (\d+)")
REGISTERED = re.compile(r"worker (\S+) (?:re-)?registered from")
DISCARDED = re.compile(r"quorum (\S+) \(round (\d+)\) discarded: (.*)")
MAJORITY_DIFFERS = "ended with another state than the majority's"
EXCLUDED = re.compile(r"quorum \S+ left out (.+?) \(\d+ in a row\)")
LEFT_OUT = re.compile(r"worker (\S+) left out of quorums")
UNAGREED = re.compile(r"worker (\S+) presented a state the run never agreed on")


def short_reason(reason: str) -> str:
    """A discard reason without worker and quorum ids, cut: reasons of one kind count together."""
    reason = re.sub(r"quorum \S+: ", "", reason)
    return re.sub(r"\bw\d+\b", "W", reason)[:60].rstrip()


class Server(ServerProcess):
    """``diloco server --allreduce`` as a child process that can be killed and restarted on its
    port (``cfg``: the run's settings). Counts the quorums each life completed and discarded
    from its log."""

    def __init__(self, cfg: dict[str, Any], log: Path) -> None:
        args = [
            "--allreduce",
            *["--num-workers", str(cfg["workers"])],
            *["--heartbeat-timeout", str(cfg["heartbeat_timeout"])],
            *["--poll-timeout", str(cfg["poll_timeout"])],
            *["--collective-timeout", str(cfg["collective_timeout"])],
            *["--join-timeout", str(cfg["join_timeout"])],
            *["--token", cfg["token"], "--weighting", cfg["weighting"]],
        ]
        if cfg["fragments"] > 1:
            args += ["--num-fragments", str(cfg["fragments"])]
        self.completed = 0
        self.discarded = 0
        self.majority_differs: list[str] = []
        # Issue 26's defences, as the log names them: a member's contribution left out of a
        # round by the checks, a worker left out of quorums, a claim of an unagreed state.
        self.defences = {"excluded": 0, "left_out": 0, "unagreed": 0}
        self.discard_reasons: dict[str, int] = {}
        self.formed_sizes: dict[int, int] = {}  # quorums formed, by their number of members
        self.formed: dict[str, tuple[int, bool]] = {}  # id: start round, formed early
        self.registered: dict[int, set[str]] = {}  # per life
        # A restarted life's quorums formed before as many workers registered as were running
        # when it started (``expected``, set by the driver): the others were still away.
        self.expected: dict[int, int] = {}
        self.early: list[dict[str, Any]] = []
        self.early_rounds = 0
        self.last_status: dict[int, dict[str, Any]] = {}  # per life
        self._lock = threading.Lock()
        super().__init__(
            args,
            log,
            env=cfg["env"],
            timeout=120,
            on_line=self._scan,
            start=False,
            token=cfg["token"],
        )

    def start(self, extra_args: Sequence[str] = ()) -> None:
        self.expected.setdefault(self.starts + 1, 0)
        super().start(extra_args)

    def _scan(self, line: str, life: int) -> None:
        with self._lock:
            if m := REGISTERED.search(line):
                self.registered.setdefault(life, set()).add(m.group(1))
            elif m := FORMED.search(line):
                members = m.group(2).split(", ")
                self.formed_sizes[len(members)] = self.formed_sizes.get(len(members), 0) + 1
                early = life > 1 and len(self.registered.get(life, ())) < self.expected[life]
                self.formed[m.group(1)] = (int(m.group(3)), early)
                if early:
                    self.early.append(
                        {
                            "life": life,
                            "quorum": m.group(1),
                            "members": members,
                            "round": int(m.group(3)),
                            "registered": len(self.registered[life]),
                            "live_workers": self.expected[life],
                        }
                    )
            elif m := COMPLETED.search(line):
                start, early = self.formed.get(m.group(1), (None, False))
                if start is None or int(m.group(2)) > start:  # a join round takes no step
                    self.completed += 1
                    self.early_rounds += early
            elif m := DISCARDED.search(line):
                self.discarded += 1
                reason = short_reason(m.group(3))
                self.discard_reasons[reason] = self.discard_reasons.get(reason, 0) + 1
            for what, pattern in (
                ("excluded", EXCLUDED),
                ("left_out", LEFT_OUT),
                ("unagreed", UNAGREED),
            ):
                self.defences[what] += bool(pattern.search(line))
            if MAJORITY_DIFFERS in line:
                self.majority_differs.append(line.strip())
