"""A wrapped model (DataParallel's ``module.``, torch.compile's ``_orig_mod.``) and a plain one
share one run: wrapper prefixes never reach the wire."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig, load_into
from tests.helpers.threads import in_threads
from tests.helpers.workers import fake_step, make_model


def test_a_wrapped_worker_and_a_plain_one_share_a_run(tmp_path) -> None:
    inner = make_model()
    wrapped = torch.nn.DataParallel(torch.compile(inner))  # compiled lazily: never runs here
    assert {n for n, _ in wrapped.named_parameters()} == {
        "module._orig_mod.weight",
        "module._orig_mod.bias",
    }
    plain = make_model()
    start = {n: p.detach().clone() for n, p in plain.named_parameters()}
    cfg = ServerConfig(
        port=0, num_workers=2, outer_lr=1.0, outer_momentum=0.0, save_dir=str(tmp_path)
    )
    with DiLoCoServer(cfg) as srv:

        def run(model: torch.nn.Module, worker_id: str, delta: float) -> None:
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            with DiLoCoWorker(
                model,
                opt,
                srv.address,
                sync_every=2,
                heartbeat_interval=0,
                worker_id=worker_id,
                bf16_comm=False,
            ) as w:
                fake_step(model, opt, delta)
                fake_step(model, opt, delta)
                assert w.sync_metrics["rounds"] == 1

        runs = [(wrapped, "wrapped", 0.25), (plain, "plain", 0.75)]
        in_threads(2, lambda i: run(*runs[i]), timeout=60)
        got = srv.global_params()
        assert set(got) == {"weight", "bias"}  # the wrapped worker may have seeded them
        for name, t0 in start.items():
            torch.testing.assert_close(got[name], t0 + 1.0)  # mean of 2 x 0.25 and 2 x 0.75
            torch.testing.assert_close(dict(plain.named_parameters())[name].detach(), got[name])
            torch.testing.assert_close(dict(inner.named_parameters())[name].detach(), got[name])
        srv.save_state()
    # The checkpoint loads back into the wrapped model as into the plain one.
    fresh_inner = make_model(1)
    report = load_into(torch.nn.DataParallel(torch.compile(fresh_inner)), tmp_path)
    assert sorted(report.loaded) == ["bias", "weight"] and not report.missing
    torch.testing.assert_close(fresh_inner.weight.detach(), got["weight"])


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)
def test_a_run_from_a_hugging_face_folder_takes_a_wrapped_gpt2(tmp_path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "like")
    cfg = ServerConfig(port=0, num_workers=1, initial_params=str(tmp_path / "like"))
    with DiLoCoServer(cfg) as srv:
        model = GPT2LMHeadModel(config)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with DiLoCoWorker(
            torch.nn.DataParallel(model), opt, srv.address, heartbeat_interval=0
        ):  # the server's names are the folder's; the worker's match once prefixes are out
            torch.testing.assert_close(
                model.transformer.wte.weight.detach(), srv.global_params()["transformer.wte.weight"]
            )
