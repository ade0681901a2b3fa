"""Reading the Prometheus text of ``GET /metrics``."""

from __future__ import annotations

import re

SAMPLE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?P<labels>[a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*"'
    r'(,[a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*")*)\})? (?P<value>-?[0-9.e+-]+|NaN|[+-]Inf)$'
)


def parse(text: str) -> dict[str, list[tuple[str, float]]]:
    """Checks the format line by line; returns samples by metric name."""
    assert text.endswith("\n")
    samples: dict[str, list[tuple[str, float]]] = {}
    declared: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("gauge", "counter"), line
            assert name not in declared, f"{name} declared twice"
            declared[name] = kind
            continue
        m = SAMPLE.match(line)
        assert m, f"malformed sample line: {line!r}"
        name = m["name"]
        assert name in declared, f"{name} has no TYPE line before it"
        samples.setdefault(name, []).append((m["labels"] or "", float(m["value"])))
    for name, kind in declared.items():
        assert name in samples, f"{name} declared without samples"
        if kind == "counter":
            assert name.endswith("_total"), name
    return samples


def value(samples: dict[str, list[tuple[str, float]]], name: str, labels: str = "") -> float:
    return dict(samples[name])[labels]
