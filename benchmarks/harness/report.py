"""What the benchmarks print and write: round summaries, markdown tables, machine facts, JSON.

The tables are markdown so that a run's output can be pasted into docs/benchmarks.md as it is;
the JSON files under benchmarks/results/ were written with these shapes, so keys stay put.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
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


def print_table(head: list[str], rows: list[list[str]]) -> None:
    """A markdown table: the header, its rule, one line per row of already formatted cells."""
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for row in rows:
        assert len(row) == len(head), (head, row)
        print("| " + " | ".join(row) + " |")


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


def write_json(path: str, doc: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\nwrote {path}")
