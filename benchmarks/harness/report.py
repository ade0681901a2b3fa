"""What the benchmarks print and write: round summaries, the one table printer and the cells
the round tables share, machine facts, a run's heading, the one JSON writer.

Every results table of every benchmark goes through ``print_table``: markdown, so that a run's
output can be pasted into docs/benchmarks.md as it is. The JSON files under benchmarks/results/
were written with the shapes the scripts build, so keys stay put; ``run_head`` gives the keys
every process-level benchmark's file starts with.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil

MB = 1e6  # the benchmarks' MB: 10**6 bytes


def fmt_mb(b: float) -> str:
    return f"{b / MB:,.0f}"


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def cpu_median(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """Median CPU seconds per measured round: the server's, the clients' together, and both."""
    measured = [r["cpu_s"] for r in rounds if not r["warmup"]]
    return {
        "server": statistics.median(c["server"] for c in measured),
        "workers": statistics.median(c["workers"] for c in measured),
        "total": statistics.median(c["server"] + c["workers"] for c in measured),
    }


def print_table(head: list[str], rows: list[list[str]], file: Any = None) -> None:
    """A markdown table: the header, its rule, one line per row of already formatted cells."""
    print("\n".join(table_lines(head, rows)), file=file, flush=True)


def table_lines(head: list[str], rows: list[list[str]]) -> list[str]:
    """``print_table``'s lines, for a report that is also written to a file."""
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for row in rows:
        assert len(row) == len(head), (head, row)
        lines.append("| " + " | ".join(row) + " |")
    return lines


def spread(s: dict[str, float]) -> str:
    """A ``summary`` of seconds as a cell: ``median (min-max)``."""
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def times_model(b: float, model_bytes: int) -> str:
    """Bytes as a cell: MB and how many models that is, ``806 (2.00x)``."""
    return f"{fmt_mb(b)} ({b / model_bytes:.2f}x)"


def above_base(mem: dict[str, Any], model_bytes: int) -> str:
    """A process's peak RSS above its RSS after importing torch (``maxrss``, ``base_rss``), in
    models: ``1.02x``."""
    return f"{(mem['maxrss'] - mem['base_rss']) / model_bytes:.2f}x"


def seconds(x: float | None) -> str:
    """Seconds as a cell, ``-`` for none."""
    return "-" if x is None else f"{x:.2f}"


def ok(flag: bool) -> str:
    """A check as a cell: ``yes``, or a ``NO`` that stands out."""
    return "yes" if flag else "NO"


def now() -> str:
    """The local time as the benchmarks stamp a run: ``2026-11-26 15:25:30 UTC``."""
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")


def run_head(benchmark: str, date: str, machine: dict[str, Any]) -> dict[str, Any]:
    """The keys a results file starts with: the benchmark, when it ran (``now()``), the command
    line, the machine (``machine_info()``)."""
    return {
        "benchmark": benchmark,
        "date": date,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": machine,
    }


def print_machine(info: dict[str, Any]) -> None:
    """The machine line under a run's heading."""
    print(f"machine: {info['nproc']} CPUs, {info['ram_gib']} GiB RAM, {info['cpu']}", flush=True)


def machine_info() -> dict[str, Any]:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "cpu": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def write_json(path: str | Path, doc: Any) -> None:
    """``doc`` as indented JSON at ``path`` (its folder made if missing); values JSON cannot
    hold are written as their ``str``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"\nwrote {out}")
