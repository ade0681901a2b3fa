"""Hugging Face ``Trainer``: M DiLoCo workers against 1 plain worker at equal steps.

The demo's claim (the global model of M workers reaches a lower held-out loss than one worker
after the same number of inner steps), measured through ``transformers.Trainer`` and
``DiLoCoCallback`` instead of the demo's own loop.

* Text: the demo's corpus (``diloco.demo.data.build_corpus(M)``): the bytes of
  ``pydoc_data.topics`` with repeated paragraphs kept once, the tail 10% of every topic held out,
  the topics' training parts dealt to the M workers (non-iid by topic). Nothing is downloaded.
* Model (``--model``): ``char``, the default, is the demo's own ``CharTransformer`` (137k
  parameters, no dropout) behind the ``forward(input_ids, labels)`` that ``Trainer`` calls;
  ``gpt2`` is a GPT-2 built from ``GPT2Config(vocab_size=256, n_positions=128, n_embd=64,
  n_layer=2, n_head=4)`` (about 125k parameters; dropout ``--dropout``, input and output
  embeddings tied unless ``--untied``). The same seed in every process.
* Training: windows of ``--seq-len`` bytes at stride ``seq_len // 2`` of each process's text,
  shuffled by the Trainer's sampler (``seed`` fixed), batch ``--batch-size``, AdamW at
  ``--lr`` with a constant schedule, gradient clipping at ``--max-grad-norm`` (Trainer's 1.0),
  ``--steps`` optimizer steps in every process.
* DiLoCo: a ``DiLoCoServer`` in this process on 127.0.0.1 port 0 (``num_workers=M``, the
  server's default outer optimizer), started from the same initial parameters; M spawned
  processes (``--workers``, default 2) each run ``Trainer`` with
  ``DiLoCoCallback(sync_every=--sync-every)`` on their share.
* Baseline: one more spawned process runs a plain ``Trainer`` (no callback) on all the training
  text for the same steps. All processes run at the same time, one torch thread each.
* Measure: the held-out loss (nats per byte, the demo's ``evaluate``: 256 evenly spaced windows
  of the held-out text) of the server's global model after the last round and of the baseline
  after its last step; also at each round (global) and every ``sync_every`` steps (baseline).

Usage: ``.venv/bin/python -m benchmarks.training.trainer_quality [--model char|gpt2]
[--workers 2] [--steps 500] [--sync-every 50] [--seed 0]
[--out benchmarks/results/trainer_quality.json]``; ``--smoke``: one worker beside the baseline, 20 steps, 2 rounds, checked.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import queue
import tempfile
import time
from datetime import UTC, datetime
from typing import Any

import torch

from benchmarks.harness import smoke
from benchmarks.harness.report import print_table, write_json


def build_gpt2(seed: int, n_positions: int, dropout: float = 0.1, tied: bool = True) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = GPT2Config(
            vocab_size=256,
            n_positions=n_positions,
            n_embd=64,
            n_layer=2,
            n_head=4,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            tie_word_embeddings=tied,
        )
        return GPT2LMHeadModel(config)


class Windows(torch.utils.data.Dataset):
    """Windows of ``seq_len`` tokens at stride ``seq_len // 2``; labels are the inputs (GPT-2
    shifts them itself)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        self.starts = torch.arange(0, len(tokens) - seq_len, seq_len // 2)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        w = self.tokens[int(self.starts[i]) : int(self.starts[i]) + self.seq_len]
        return {"input_ids": w, "labels": w}


class CharLM(torch.nn.Module):
    """The demo's own model (``diloco.demo.model.CharTransformer``) with the interface
    ``Trainer`` calls: ``forward(input_ids, labels)`` returns the next-byte loss and the logits."""

    def __init__(self, seed: int, context: int) -> None:
        super().__init__()
        from diloco.demo.model import build_model

        self.net = build_model(seed, context)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        from transformers.modeling_outputs import CausalLMOutput

        logits = self.net(input_ids)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
            )
        return CausalLMOutput(loss=loss, logits=logits)


def build(cfg: dict[str, Any]) -> Any:
    """The model ``--model`` names, the same parameters in every process."""
    if cfg["model"] == "char":
        return CharLM(cfg["seed"], cfg["seq_len"])
    return build_gpt2(cfg["seed"], cfg["n_positions"], cfg["dropout"], not cfg["untied"])


class _GPT2Logits(torch.nn.Module):
    """Adapts GPT-2 to the demo's ``evaluate`` (which wants a module returning logits)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x).logits


def held_out_loss(model: Any, tokens: torch.Tensor, seq_len: int) -> float:
    from diloco.demo.model import evaluate

    return evaluate(_GPT2Logits(model), tokens, seq_len)


def _train(rank: int, cfg: dict[str, Any], address: str | None, events: Any) -> None:
    """A DiLoCo worker (``address`` set) on shard ``rank``, or the baseline on all the text."""
    import logging

    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from diloco.demo.data import build_corpus

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("diloco").setLevel(logging.WARNING)
    corpus = build_corpus(cfg["workers"])
    tokens = corpus.shards[rank] if address else corpus.train
    model = build(cfg)
    callbacks: list[Any] = []
    if address is not None:
        from diloco.integrations.transformers import DiLoCoCallback

        callbacks.append(
            DiLoCoCallback(address, sync_every=cfg["sync_every"], worker_id=f"worker-{rank}")
        )
    else:

        class Evaluate(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if state.global_step % cfg["sync_every"] == 0:
                    loss = held_out_loss(model, corpus.eval, cfg["seq_len"])
                    events.put(("eval", rank, state.global_step, loss))

        callbacks.append(Evaluate())
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            model=model,
            args=TrainingArguments(
                output_dir=out,
                max_steps=cfg["steps"],
                per_device_train_batch_size=cfg["batch_size"],
                learning_rate=cfg["lr"],
                lr_scheduler_type="constant",
                max_grad_norm=cfg["max_grad_norm"],
                logging_steps=cfg["sync_every"],
                save_strategy="no",
                report_to=[],
                use_cpu=True,
                disable_tqdm=True,
                dataloader_num_workers=0,
                seed=cfg["seed"] * 1000 + rank,
            ),
            train_dataset=Windows(tokens, cfg["seq_len"]),
            callbacks=callbacks,
        )
        trainer.remove_callback(PrinterCallback)  # the parent prints the table
        t0 = time.monotonic()
        trainer.train()
        wall = time.monotonic() - t0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    final = held_out_loss(model, corpus.eval, cfg["seq_len"]) if address is None else None
    events.put(("done", rank, {"train_time_s": wall, "train_losses": losses}, final))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=500, help="optimizer steps per process")
    p.add_argument("--sync-every", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--model",
        choices=("char", "gpt2"),
        default="char",
        help="gpt2: a small GPT-2 from a config; char: the demo's own CharTransformer",
    )
    p.add_argument(
        "--untied", action="store_true", help="gpt2: a separate output head (GPT-2 ties it)"
    )
    p.add_argument("--workers", type=int, default=2, help="DiLoCo workers (M)")
    p.add_argument("--dropout", type=float, default=0.1, help="GPT-2 dropout (its default 0.1)")
    p.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="Trainer gradient clipping (0: off)"
    )
    p.add_argument("--out", default="benchmarks/results/trainer_quality.json")
    smoke.add_flag(p)
    args = p.parse_args(argv)
    if args.smoke:  # 1 worker and the baseline, 20 steps, 2 rounds; no results file
        args.steps, args.sync_every, args.workers, args.out = 20, 10, 1, None

    from diloco.demo.data import build_corpus
    from diloco.server import DiLoCoServer, ServerConfig

    cfg = {
        "steps": args.steps,
        "sync_every": args.sync_every,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "n_positions": 128,
        "lr": args.lr,
        "seed": args.seed,
        "workers": args.workers,
        "model": args.model,
        "untied": args.untied,
        "dropout": args.dropout,
        "max_grad_norm": args.max_grad_norm,
    }
    torch.set_num_threads(1)
    workers = args.workers
    corpus = build_corpus(workers)
    eval_model = build(cfg)
    n_params = sum(p.numel() for p in eval_model.parameters())
    init_loss = held_out_loss(eval_model, corpus.eval, args.seq_len)
    t0 = time.monotonic()
    server = DiLoCoServer(
        ServerConfig(port=0, num_workers=workers),
        initial_params={n: p.detach().clone() for n, p in eval_model.named_parameters()},
    ).start()
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    procs = [
        ctx.Process(target=_train, args=(r, cfg, server.address, events), daemon=True)
        for r in range(workers)
    ]
    procs.append(ctx.Process(target=_train, args=(workers, cfg, None, events), daemon=True))
    for proc in procs:
        proc.start()
    finished: dict[int, Any] = {}
    baseline_loss = float("nan")
    global_curve: list[tuple[int, float]] = [(0, init_loss)]
    baseline_curve: list[tuple[int, float]] = [(0, init_loss)]
    wall_done: dict[int, float] = {}
    seen_round = 0
    try:
        while len(finished) < len(procs):
            try:
                ev = events.get(timeout=0.5)
            except queue.Empty:
                ev = None
                dead = [i for i, pr in enumerate(procs) if not pr.is_alive() and i not in finished]
                if dead:
                    raise SystemExit(
                        f"process {dead[0]} exited: {procs[dead[0]].exitcode}"
                    ) from None
            if ev is not None and ev[0] == "eval":
                baseline_curve.append((ev[2], ev[3]))
            elif ev is not None and ev[0] == "done":
                finished[ev[1]] = ev[2]
                wall_done[ev[1]] = time.monotonic() - t0
                if ev[3] is not None:
                    baseline_loss = ev[3]
            rnd = server.status()["round"]
            if rnd != seen_round:
                seen_round = rnd
                eval_model.load_state_dict(server.global_params(), strict=False)
                loss = held_out_loss(eval_model, corpus.eval, args.seq_len)
                global_curve.append((rnd * args.sync_every, loss))
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
    status = server.status()
    eval_model.load_state_dict(server.global_params(), strict=False)
    global_loss = held_out_loss(eval_model, corpus.eval, args.seq_len)
    if global_curve[-1][0] != status["round"] * args.sync_every:
        global_curve.append((status["round"] * args.sync_every, global_loss))
    server.stop()
    wall = time.monotonic() - t0
    report = {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "config": cfg,
        "parameters": n_params,
        "initial_eval_loss": init_loss,
        "diloco": {
            "workers": workers,
            "steps_per_worker": args.steps,
            "rounds": status["round"],
            "eval_loss": global_loss,
            "wall_time_s": round(max(wall_done[r] for r in range(workers)), 1),
            "train_time_s": [round(finished[r]["train_time_s"], 1) for r in range(workers)],
            "eval_curve": global_curve,
            "train_losses": [finished[r]["train_losses"] for r in range(workers)],
        },
        "single": {
            "workers": 1,
            "steps": args.steps,
            "rounds": 0,
            "eval_loss": baseline_loss,
            "wall_time_s": round(wall_done[workers], 1),
            "train_time_s": round(finished[workers]["train_time_s"], 1),
            "eval_curve": baseline_curve,
            "train_losses": finished[workers]["train_losses"],
        },
        "total_wall_time_s": round(wall, 1),
        "lower": global_loss < baseline_loss,
    }
    if args.out:
        write_json(args.out, report)
    d, s = report["diloco"], report["single"]
    label = "CharTransformer" if args.model == "char" else "GPT-2"
    print(f"{label} {n_params:,} parameters, initial held-out loss {init_loss:.3f} nats/byte")
    print_table(
        ["", "held-out loss", "steps", "rounds", "wall s"],
        [
            [
                f"DiLoCo, {workers} workers (global)",
                f"{global_loss:.3f}",
                str(args.steps),
                str(status["round"]),
                f"{d['wall_time_s']:.1f}",
            ],
            [
                "1 worker, plain Trainer",
                f"{baseline_loss:.3f}",
                str(args.steps),
                "0",
                f"{s['wall_time_s']:.1f}",
            ],
        ],
    )
    single_at = dict(baseline_curve)
    print_table(
        ["step", "global", "single"],
        [  # rounds the parent saw (it may miss one while evaluating)
            [str(step), f"{g:.3f}", f"{single_at[step]:.3f}"]
            for step, g in global_curve
            if step in single_at
        ],
    )
    if args.smoke:
        smoke.require(status["round"] == args.steps // args.sync_every, "every round closed")
        for what, loss in (("global", global_loss), ("single", baseline_loss)):
            smoke.require(math.isfinite(loss) and 0 < loss < init_loss, f"{what} loss fell")
        smoke.passed("trainer_quality")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
