"""Render docs/quality.md and its plots from the quality suite's result files.

    python benchmarks/quality/render.py [--results benchmarks/results/quality] [--docs docs]

Reads every experiment's JSON file, writes ``DOCS/quality.md`` and ``DOCS/quality/*.png``.
``run.py`` calls it after a full run; run it alone to re-render without training.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root, for benchmarks

from benchmarks.quality.claims import CLAIMS, NOT_REPRODUCED, claim_rows, seeds_of  # noqa: E402
from benchmarks.quality.gpu import section as gpu_section  # noqa: E402
from benchmarks.quality.notes import EXPERIMENT_NOTES, INTRO, PROTOCOL, REASONS  # noqa: E402
from benchmarks.quality.plots import plot_experiment  # noqa: E402
from benchmarks.quality.protocol import Profile  # noqa: E402
from benchmarks.quality.rules import DEFINITIONS, rule_text  # noqa: E402
from benchmarks.quality.splits import divergence_lines  # noqa: E402
from benchmarks.quality.stats import (  # noqa: E402
    Results,
    fmt,
    fmt_ppl,
    load,
    names,
    paired,
    per_round,
    rows,
    values,
)
from benchmarks.quality.suite import APART, EXPERIMENTS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# Experiments shown in another's section, after it (what else was tried for its claims).
EXTRA = {"sparse": ["sparse_lr"], "sync_every": ["sync_every_lr"], "async": ["async_iid"]}


def suite_time(results: Results) -> float:
    """Seconds the rows cost when computed, each distinct configuration and seed counted once
    (several experiments share rows through the cache); only the default command's experiments
    (the extra tries beside a claim, ``EXTRA``, are not part of it)."""
    seen: dict[str, float] = {}
    for name, res in results.items():
        if name in EXPERIMENTS and not EXPERIMENTS[name].default:
            continue
        for r in res["rows"]:
            settings = {k: v for k, v in r.get("config", {}).items() if k != "name"}
            seen[json.dumps([settings, r["seed"]], sort_keys=True)] = r.get("run_s", 0.0)
    return sum(seen.values())


# Where the suite's sizing is measured (one line: the docs test checks the section exists).
SIZING = 'docs/benchmarks.md, "Quality suite: step time and the size of the default".'


def timing(results: Results, sweep: dict[str, Any] | None) -> list[str]:
    """The suite's time and where it was measured, from the result files."""
    minutes = (suite_time(results) + (sweep or {}).get("run_s", 0.0)) / 60
    hosts = [h for res in results.values() for h in res.get("host", {}).values()]
    where = ""
    if hosts:
        loads = [h["load"] for h in hosts]
        first, last = min(h["utc"] for h in hosts), max(h["utc"] for h in hosts)
        where = (
            f" on {hosts[0]['cores']} cores ({hosts[0]['cpu']}), {first} to {last} UTC, load "
            f"average {min(loads):.1f} to {max(loads):.1f} at the experiments' starts and ends"
        )
    return [
        f"Suite time of these results: {minutes:.0f} min, the sum of every distinct run's time "
        "(the lr sweep, pretrain and evaluation included; a run shared by several experiments "
        f"counted once){where}. `python benchmarks/quality/run.py --plan MS` projects the "
        "default's time from a step time of MS ms; measured step times and the projection: "
        + SIZING
    ]


def sweep_table(sweep: dict[str, Any]) -> list[str]:
    """The inner lr sweep: each kind's validation loss at every lr of the grid, the chosen lr."""
    # The grid's points and those a kind tried beyond it (its best was at an end: run_sweep).
    grid = sorted({lr for k in sweep["kinds"].values() for lr, _ in k["losses"]})
    beyond = [lr for lr in grid if lr not in sweep["grid"]]
    out = [
        f"{sweep['steps']} inner steps per worker (the equal-tokens baseline M times that), "
        f"seed {sweep['seed']}, from the pretrained start; final loss on the validation split, "
        "the lowest in bold. Each row of every experiment trains at its kind's chosen lr (the "
        "tables' lr column)."
        + (
            f" A kind whose best lr was at an end of the grid ({', '.join(f'{x:g}' for x in sweep['grid'])})"
            " tried the next points beyond it until its best was inside ("
            + ", ".join(f"{x:g}" for x in beyond)
            + "; — where a kind did not)."
            if beyond
            else ""
        ),
        "",
        "| kind | " + " | ".join(f"lr {lr:g}" for lr in grid) + " | chosen |",
        "|---|" + "---|" * (len(grid) + 1),
    ]
    for k in sweep["kinds"].values():
        tried = dict(k["losses"])
        cells = [
            "—"
            if lr not in tried
            else f"**{tried[lr]:.4f}**"
            if lr == k["lr"]
            else f"{tried[lr]:.4f}"
            for lr in grid
        ]
        chosen = f"{k['lr']:g}" + (" (the end of what was tried: too narrow)" if k["edge"] else "")
        out.append(f"| {k['what']} | " + " | ".join(cells) + f" | {chosen} |")
    if "async_outer" in sweep:
        out += ["", *outer_table(sweep["async_outer"], sweep["seed"])]
    return out


def outer_table(outer: dict[str, Any], seed: int) -> list[str]:
    """The async outer lr sweep: validation loss at each outer lr, the chosen one."""
    cells = [f"**{x:.4f}**" if lr == outer["lr"] else f"{x:.4f}" for lr, x in outer["losses"]]
    chosen = f"{outer['lr']:g}" + (" (the list's end: too narrow)" if outer["edge"] else "")
    return [
        f"The async experiment's outer lr: {outer['what']} on the simulated clock, seed {seed}, "
        "at the reference M's inner lr; final loss on the validation split. The async DN rows "
        "train at the chosen one.",
        "",
        "| outer lr | " + " | ".join(f"{lr:g}" for lr, _ in outer["losses"]) + " | chosen |",
        "|---|" + "---|" * (len(cells) + 1),
        "| validation loss | " + " | ".join(cells) + f" | {chosen} |",
    ]


def setup_table(results: Results) -> list[str]:
    """Model, data and scale of the runs, from the first result file."""
    res = next(iter(results.values()))
    # Fields a profile no longer has (older result files: ``data``) are left out.
    known = {f.name for f in dataclasses.fields(Profile)}
    profile = Profile(**{k: v for k, v in res["profile"].items() if k in known})
    scale = res["scale"]
    params = sum(p.numel() for p in profile.model(0).parameters())
    items = [
        (
            "model",
            f"byte-level transformer, {profile.layers} layers, width {profile.d_model}, "
            f"{profile.heads} heads, {params:,} parameters",
        ),
        (
            "data",
            "CPython's standard-library sources (`.py` files; tests and bundled tools left out), "
            "UTF-8 bytes, one topic per top-level module or package"
            + (
                f", each cut to its first {profile.topic_bytes:,} bytes"
                if profile.topic_bytes
                else ""
            )
            + "; held out of training: the last 10% of every topic (the test split, every "
            "loss on this page) and the 5% before it (the validation split, the lr sweep only)",
        ),
        (
            "split",
            "non-iid: whole topics per worker, largest first to the smallest shard; iid: "
            "1024-byte pieces dealt round-robin after a fixed shuffle (claim l only)",
        ),
        ("batch", f"{profile.batch_size} sequences of {profile.seq_len} bytes per inner step"),
        (
            "pretrain",
            f"{scale['pretrain_steps']} steps of one-worker AdamW on all training "
            "text, cached per seed; every configuration starts from it",
        ),
        (
            "pretrain lr",
            f"{profile.lr} (fixed; linear warmup over the first tenth of the pretrain)",
        ),
        (
            "inner optimizer",
            f"AdamW at the lr its kind's sweep chose (below), linear warmup {scale['warmup']} "
            "steps, cosine decay to 10% over the run",
        ),
        ("outer optimizer", "SGD, lr 0.7, Nesterov momentum 0.9 (unless varied)"),
        (
            "scale",
            f"{scale['steps']} inner steps per worker, H = {scale['sync_every']} "
            f"({scale['steps'] // scale['sync_every']} outer steps), M = {scale['workers']} "
            f"(unless varied); H sweep: {scale['sweep_steps']} steps "
            f"({scale['sweep_steps'] // max(scale['sweep'])} outer steps at H = {max(scale['sweep'])})",
        ),
        ("uplink", "bf16 pseudo-gradients (the default), fp32 parameters down (unless varied)"),
        (
            "evaluation",
            f"the global model on the same {scale['windows']} evenly spaced {profile.seq_len}-byte "
            "windows of the test split after every outer update (the curves"
            + (
                f": at most {scale['curve_points']} points a run, evenly spread"
                if scale.get("curve_points")
                else ""
            )
            + ") and at the end (the tables): the last curve point is the table's figure",
        ),
        (
            "seeds",
            ", ".join(map(str, seeds_of(results))) + " (model init, batch order, "
            "pretrain; the data split is the same for every seed)",
        ),
        (
            "device",
            f"{profile.device}, one torch thread per worker, workers as threads in one "
            "process with the real HTTP server",
        ),
    ]
    out = ["| | |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in items]
    return out


def _lr(group: list[dict[str, Any]]) -> str:
    """The inner lr the rows trained at (older result files have none)."""
    lr = group[0].get("config", {}).get("lr")
    return "—" if lr is None else f"{lr:g}"


def experiment_table(res: dict[str, Any]) -> list[str]:
    """One line per configuration: final loss, paired difference from the reference, bytes."""
    ref = names(res)[0]
    out = [
        "| configuration | inner lr | eval loss | vs first row (paired) | perplexity vs first row "
        "| MB sent | peak kB per sync | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in names(res):
        group = rows(res, n)
        loss = fmt(list(values(res, n).values()))
        diff = "reference" if n == ref else fmt(paired(res, n, ref), signed=True)
        ppl = "" if n == ref else fmt_ppl(paired(res, n, ref))
        mb = sum(r.get("bytes_up", 0) for r in group) / len(group) / 1e6
        peaks = [r.get("peak_sync_bytes", 0) for r in group]
        peak = f"{sum(peaks) / len(peaks) / 1e3:.0f}" if any(peaks) else "—"
        sent = f"{mb:.1f}" + (" (computed)" if group[0].get("kind") == "dp" else "") if mb else "0"
        wall = fmt([r["wall_s"] for r in group], 1)
        out.append(f"| {n} | {_lr(group)} | {loss} | {diff} | {ppl} | {sent} | {peak} | {wall} |")
    return out


def bytes_table(res: dict[str, Any]) -> list[str]:
    """Claim n's: final loss and paired difference from the reference, and the bytes one worker
    sent and received per round (the join's download left out) with their ratios to the
    reference's."""
    ref = names(res)[0]
    up0, down0 = per_round(res, ref, "up"), per_round(res, ref, "down")
    out = [
        "| configuration | inner lr | eval loss | vs first row (paired) | kB up per round | ÷ up | "
        "kB down per round | ÷ down | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n in names(res):
        up, down = per_round(res, n, "up"), per_round(res, n, "down")
        diff = "reference" if n == ref else fmt(paired(res, n, ref), signed=True)
        out.append(
            f"| {n} | {_lr(rows(res, n))} | {fmt(list(values(res, n).values()))} | {diff} | "
            f"{up / 1e3:.1f} | "
            f"{up0 / up:.1f} | {down / 1e3:.1f} | {down0 / down:.1f} | "
            f"{fmt([r['wall_s'] for r in rows(res, n)], 1)} |"
        )
    return out


# Experiments whose table is not ``experiment_table``.
TABLES = {"sparse": bytes_table, "sparse_lr": bytes_table, "allreduce_codecs": bytes_table}


def section(res: dict[str, Any], docs_dir: Path, letters: str) -> list[str]:
    """One experiment's description, table and plot."""
    exp = res["experiment"]
    # The description of the code as it is now (the file's copy is the one it ran with).
    known = EXPERIMENTS.get(exp)
    doc = (known.configs.__doc__ or "") if known else res["doc"]
    lines = [f"### `{exp}`", "", " ".join(doc.split()), ""]
    lines += [f"Compared at {res['what']}. Command: `{res['command']}`.", ""]
    lines += [*TABLES.get(exp, experiment_table)(res), ""]
    lines += divergence_lines(res)
    png = docs_dir / "quality" / f"{exp}.png"
    clipped = plot_experiment(res, png, f"{exp} (claim {letters})")
    lines += [f"![{exp}](quality/{exp}.png)", ""]
    if clipped:
        lines += [
            "Curves above the plot's top (the pretrained start plus 0.05) are clipped; the "
            "table has their final losses.",
            "",
        ]
    return lines


def render(results_dir: Path, docs_dir: Path) -> Path:
    """Write ``docs_dir/quality.md`` and the PNGs; returns the markdown's path."""
    everything = load(results_dir)
    results = {k: v for k, v in everything.items() if k not in APART}
    if not results:
        raise SystemExit(f"no result files of the CPU suite in {results_dir}")
    sweep_file = results_dir / "lr_sweep.json"
    sweep = json.loads(sweep_file.read_text()) if sweep_file.exists() else None
    claims = claim_rows(results)
    fast = any(r["fast"] for r in results.values())
    lines = [INTRO.strip(), ""]
    if fast:
        lines += ["**These are fast-setting results (a smoke test), not the suite's figures.**", ""]
    lines += [*timing(results, sweep), ""]
    lines += [PROTOCOL.strip(), "", "## Setup", "", *setup_table(results), ""]
    if sweep:
        lines += ["### Inner lr sweep", "", *sweep_table(sweep), ""]
    lines += ["## Claims", "", " ".join(DEFINITIONS.split()), ""]
    lines += [
        "| claim | paper | rule (all checks must hold) | ours (mean ± sd over seeds) | verdict "
        "| command |",
        "|---|---|---|---|---|---|",
    ]
    for c in claims:
        lines.append(
            f"| {c['claim']}. {c['text']} | {c['paper']} | {rule_text(c['claim'])} | "
            f"{c['ours']} | {c['verdict']} | `{c['command']}` |"
        )
    lines.append("")
    by_exp: dict[str, list[dict[str, str]]] = {}
    for c in claims:
        by_exp.setdefault(c["experiment"], []).append(c)
    for exp, group in by_exp.items():
        letters = ", ".join(c["claim"] for c in group)
        lines += [f"## {letters}: {group[0]['text'] if len(group) == 1 else exp}", ""]
        if exp not in results:
            lines += [f"Not run: `python benchmarks/quality/run.py {exp}`.", ""]
            continue
        for name in [exp, *EXTRA.get(exp, [])]:
            if name in results:
                lines += section(results[name], docs_dir, letters)
        for c in group:
            detail = f"**{c['claim']}** — {c['verdict']}: {c['ours']}."
            if c["note"]:
                detail += f" ({c['note']})"
            lines += [detail, ""]
            if c["verdict"] == NOT_REPRODUCED and c["claim"] in REASONS:
                lines += [REASONS[c["claim"]].strip(), ""]
        for name in [exp, *EXTRA.get(exp, [])]:
            if name in EXPERIMENT_NOTES and name in results:
                lines += [EXPERIMENT_NOTES[name].strip(), ""]
    lines += gpu_section(everything)
    path = docs_dir / "quality.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "quality"))
    p.add_argument("--docs", default=str(ROOT / "docs"))
    args = p.parse_args(argv)
    print(f"wrote {render(Path(args.results), Path(args.docs))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["CLAIMS", "render"]
