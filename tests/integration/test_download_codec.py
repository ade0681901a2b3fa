"""A compressed downlink through a real server on loopback (``--download-codec``, issue 18):
a replica that starts from a full download and applies each round's update body with
``apply_update`` stays bit-identical to the server's published parameters and matches every
checksum; the server's true copy follows the exact outer step while the published one stays
within one round's quantization of it; stale or absent ``have_round`` gets full parameters; a
restart from a checkpoint goes on bit for bit; readers streaming an older round keep its bytes;
and the configurations it cannot serve are refused clearly. Uploads are raw fp32/bf16 bodies
built here, so the worker's code is not involved."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import requests
import safetensors.torch
import torch

from diloco.core.codecs import codec_by_name, codec_from_metadata
from diloco.core.codecs.downlink import apply_update
from diloco.persistence import TRUE_FILE, list_checkpoints
from diloco.server.config import DOWNLOAD_CODECS, ServerConfig
from diloco.server.observe.status import Status
from diloco.server.params.store import ParamStore
from diloco.server.server import DiLoCoServer
from diloco.wire import encode
from diloco.wire.checksum import checksum
from tests.helpers.codecs import SHAPES, grads, model, wait_status
from tests.helpers.http import (
    EXACT,
    TIMEOUT,
    accept,
    assert_error,
    assert_params_equal,
    assert_unchanged,
    body,
    expected_exact,
    post_json,
    post_raw,
    register,
    state,
    url,
    wait_round,
)
from tests.helpers.servers import ServerFactory
from tests.helpers.status import assert_keys

LOSSY = ["int8", "int4", "bf16"]
#: What one round's quantization leaves between true and published, relative to the largest
#: element of the round's update: half a step of the block (scales rounded up to bf16), or
#: half a bf16 ulp.
GAP = {"int8": 0.51 / 127, "int4": 0.51 / 7, "bf16": 2.0**-8}


# --- helpers -------------------------------------------------------------------------------------


def split(data: bytes) -> tuple[dict[str, Any], memoryview]:
    """A body's header (JSON) and its payload."""
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), memoryview(data)[8 + n :]


def download(
    server: DiLoCoServer, min_round: int, have_round: int | str | None = None, worker: str = "a"
) -> tuple[dict[str, str], bytes]:
    query = f"/global_params?worker_id={worker}&min_round={min_round}"
    if have_round is not None:
        query += f"&have_round={have_round}"
    resp = requests.get(url(server, query), timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text
    header, _ = split(resp.content)
    return header["__metadata__"], resp.content


def full(server: DiLoCoServer, min_round: int) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A full download: its metadata and tensors, after checking its checksum is its payload's."""
    meta, data = download(server, min_round)
    assert meta["kind"] == "global_params" and meta["round"] == str(min_round)
    _, payload = split(data)
    assert meta["checksum"] == checksum([payload])
    return meta, safetensors.torch.load(data)


def replica_checksum(replica: dict[str, torch.Tensor]) -> str:
    """The checksum a worker computes: its parameters' bytes in payload order (the order of the
    initial tensors: every one is fp32)."""
    return checksum(memoryview(replica[n].contiguous().numpy()).cast("B") for n in SHAPES)


def apply_body(replica: dict[str, torch.Tensor], data: bytes) -> dict[str, str]:
    """What a worker does with an update body: decode it, then ``apply_update`` per parameter
    with its parts in ``codec.parts`` order. Returns its metadata."""
    header, _ = split(data)
    meta = header["__metadata__"]
    codec = codec_from_metadata(meta)
    tensors = safetensors.torch.load(data)
    assert set(tensors) == {n + p.suffix for n, s in SHAPES.items() for p in codec.parts(s)}
    for name, shape in SHAPES.items():
        apply_update(codec, replica[name], [tensors[name + p.suffix] for p in codec.parts(shape)])
    return meta


def two_workers(make_server: ServerFactory, codec: str, **config: Any) -> DiLoCoServer:
    server = make_server(model(), num_workers=2, download_codec=codec, **config)
    register(server, "a")
    register(server, "b")
    return server


def play_round(server: DiLoCoServer, r: int) -> list[dict[str, torch.Tensor]]:
    """a uploads fp32, b bf16 (raw bodies), against round r; returns the values counted."""
    ga = grads(10 * r + 1)
    gb = {n: t.to(torch.bfloat16) for n, t in grads(10 * r + 2).items()}
    accept(server, body("a", r, f"a-{r}", ga))
    accept(server, body("b", r, f"b-{r}", gb))
    wait_round(server, r + 1)
    return [ga, {n: t.float() for n, t in gb.items()}]


def pinned(server: DiLoCoServer, have_round: int | None) -> Any:
    """Pin (as a download streaming it does) the full payload, or the update from
    ``have_round``."""

    async def pin() -> Any:
        coord = server.front
        if have_round is None:
            return await coord.model.require_store().open_snapshot()
        assert coord.model.downlink is not None
        return await coord.model.downlink.open_update(have_round)

    return server._call(pin())


def unpin(server: DiLoCoServer, snap: Any) -> None:
    async def close() -> None:
        ParamStore.close_snapshot(snap)

    server._call(close())


# --- replicas ------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", LOSSY)
def test_a_replica_applying_updates_stays_bit_identical(
    make_server: ServerFactory, codec: str
) -> None:
    server = two_workers(make_server, codec)
    meta, replica = full(server, 0)
    assert meta["download_codec"] == codec
    assert replica_checksum(replica) == meta["checksum"]
    full_size = len(download(server, 0)[1])
    for r in range(4):
        play_round(server, r)
        umeta, data = download(server, r + 1, have_round=r)
        assert umeta["kind"] == "update"
        assert (umeta["round"], umeta["base_round"]) == (str(r + 1), str(r))
        assert umeta["instance"] == server.status()["instance"]
        assert umeta["codec"] == codec
        assert apply_body(replica, data) == umeta
        fmeta, params = full(server, r + 1)
        assert_params_equal(replica, params)  # bit for bit
        assert replica_checksum(replica) == umeta["checksum"] == fmeta["checksum"]
        assert fmeta["download_codec"] == codec
        if codec != "bf16":
            assert len(data) < full_size / 3  # int8: about a quarter; int4: about an eighth
    assert_params_equal(replica, server.global_params())
    st = server.status()
    assert (st["update_downloads"], st["full_downloads"]) == (4, 6)
    assert st["download_codec"] == codec and st["checksum"] == umeta["checksum"]
    assert st["last_round_bytes_out"] == len(data) + full_size
    assert_keys(Status, st)
    assert Status.from_json(st).to_json() == st
    metrics = requests.get(url(server, "/metrics"), timeout=TIMEOUT).text
    assert 'diloco_downloads_total{kind="update"} 4' in metrics
    assert 'diloco_downloads_total{kind="full"} 6' in metrics
    assert f'diloco_download_codec{{codec="{codec}"}} 1' in metrics


@pytest.mark.parametrize("codec", LOSSY)
def test_true_follows_the_exact_step_and_published_stays_within_a_round(
    make_server: ServerFactory, codec: str
) -> None:
    server = two_workers(make_server, codec, **EXACT)
    true = server.global_params(true=True)
    assert_params_equal(true, server.global_params())  # equal at the start
    for r in range(4):
        before = server.global_params()
        counted = play_round(server, r)
        want = expected_exact(true, *counted)  # new = old - mean(pg), as without compression
        true = server.global_params(true=True)
        assert_params_equal(true, want)
        published = server.global_params()
        for name in SHAPES:
            step = (true[name] - before[name]).abs().max()  # the update this round encoded
            ulp = 4 * torch.finfo(torch.float32).eps * published[name].abs().max()
            gap = (true[name] - published[name]).abs().max()
            assert gap <= GAP[codec] * step + ulp, (r, name, gap, step)
            assert gap > 0 or codec == "bf16"  # a lossy codec does leave a gap


def test_a_refused_round_publishes_the_gap_and_stays_exact(make_server: ServerFactory) -> None:
    """A round whose step would not be finite leaves true as it was; its update still carries
    the gap left by the round before, and replicas follow."""
    server = two_workers(make_server, "int8", **EXACT)
    _, replica = full(server, 0)
    play_round(server, 0)
    apply_body(replica, download(server, 1, have_round=0)[1])
    true = server.global_params(true=True)
    huge = {n: torch.full(s, 3e38) for n, s in SHAPES.items()}
    accept(server, body("a", 1, "a-1", huge))
    accept(server, body("b", 1, "b-1", huge))
    assert wait_round(server, 2)["refused_updates"] == 1
    assert_params_equal(server.global_params(true=True), true)
    apply_body(replica, download(server, 2, have_round=1)[1])
    assert_params_equal(replica, full(server, 2)[1])


def test_initial_parameters_from_a_worker_get_a_true_copy() -> None:
    server = DiLoCoServer(ServerConfig(port=0, num_workers=2, download_codec="int8")).start()
    try:
        register(server, "a")
        register(server, "b")
        resp = post_raw(server, "/initial_params?worker_id=a", encode(model()))
        assert resp.status_code == 200, resp.text
        assert_params_equal(server.global_params(true=True), model())
        _, replica = full(server, 0)
        play_round(server, 0)
        apply_body(replica, download(server, 1, have_round=0)[1])
        assert_params_equal(replica, full(server, 1)[1])
    finally:
        server.stop()


# --- which body -----------------------------------------------------------------------------------


def test_stale_or_absent_have_round_gets_full_parameters(make_server: ServerFactory) -> None:
    server = two_workers(make_server, "int8")
    play_round(server, 0)
    assert download(server, 0, have_round=0)[0]["kind"] == "update"  # round 1 is published
    play_round(server, 1)
    assert download(server, 2, have_round=1)[0]["kind"] == "update"
    assert download(server, 2, have_round=0)[0]["kind"] == "global_params"  # missed a round
    assert download(server, 2)[0]["kind"] == "global_params"  # a joiner
    assert download(server, 2, have_round=2)[0]["kind"] == "global_params"  # holds it already
    assert download(server, 1, have_round=5)[0]["kind"] == "global_params"
    st = server.status()
    assert (st["update_downloads"], st["full_downloads"]) == (2, 4)


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", ""])
def test_400_bad_have_round(make_server: ServerFactory, value: str) -> None:
    server = two_workers(make_server, "int8")
    before = state(server)
    query = f"/global_params?worker_id=a&min_round=0&have_round={value}"
    reply = assert_error(requests.get(url(server, query), timeout=TIMEOUT), 400, "bad_query")
    assert "have_round" in reply["detail"]
    assert_unchanged(before, server)
    assert server.status()["full_downloads"] == 0


def test_fp32_changes_nothing_and_full_headers_carry_the_checksum(
    make_server: ServerFactory,
) -> None:
    server = make_server(model(), num_workers=2, **EXACT)
    register(server, "a")
    register(server, "b")
    old = server.global_params()
    counted = play_round(server, 0)
    assert_params_equal(server.global_params(), expected_exact(old, *counted))
    assert_params_equal(server.global_params(true=True), server.global_params())
    # The checksum is computed beside the downloads after each round; once known, every full
    # download carries it (one streamed while its step ran, before it existed, does not).
    wait_status(server, lambda st: st["checksum"] is not None)
    st = server.status()
    meta, params = full(server, 1)
    assert meta["checksum"] == st["checksum"] and meta["download_codec"] == "fp32"
    assert replica_checksum(params) == meta["checksum"]
    # have_round means nothing here: full parameters.
    assert download(server, 1, have_round=0)[0]["kind"] == "global_params"
    assert st["download_codec"] == "fp32" and st["update_downloads"] == 0


# --- copy-on-write ---------------------------------------------------------------------------------


def test_readers_of_an_older_round_keep_its_bytes(make_server: ServerFactory) -> None:
    server = two_workers(make_server, "int8")
    play_round(server, 0)
    snap_full = pinned(server, None)
    snap_update = pinned(server, 0)
    assert (snap_full.round, snap_update.round) == (1, 1)
    full_bytes, update_bytes = bytes(snap_full.payload), bytes(snap_update.payload)
    play_round(server, 1)  # its step and its update run while both are pinned
    assert bytes(snap_full.payload) == full_bytes
    assert bytes(snap_update.payload) == update_bytes
    assert server.status()["copies_on_write"] == 1
    unpin(server, snap_full)
    unpin(server, snap_update)
    # Round 2's update is a body of its own, applied on top of round 1's.
    _, data = download(server, 2, have_round=1)
    _, payload = split(data)
    assert bytes(payload) != update_bytes
    downlink = server.front.model.downlink
    assert downlink is not None and downlink.current is not None
    kept = downlink.current.buffer
    assert kept is not snap_update._buffer  # round 1's body was still pinned: a fresh one
    play_round(server, 2)  # nobody pins now: the buffers are reused in place
    assert server.status()["copies_on_write"] == 1
    assert downlink.current.buffer is kept


# --- restart ---------------------------------------------------------------------------------------


def test_restart_restores_true_and_published(make_server: ServerFactory, tmp_path: Path) -> None:
    save = {"save_dir": str(tmp_path), "save_every": 1}
    server = two_workers(make_server, "int8", **save)
    _, replica = full(server, 0)
    for r in range(2):
        play_round(server, r)
        apply_body(replica, download(server, r + 1, have_round=r)[1])
    true = server.global_params(true=True)
    published = server.global_params()
    assert not torch.equal(true["w"], published["w"])
    newest = list_checkpoints(tmp_path)[-1]
    assert (newest / TRUE_FILE).exists()
    server.stop()

    again = two_workers(make_server, "int8", **save)
    assert again.status()["resumed_from"] is not None
    assert_params_equal(again.global_params(true=True), true)
    assert_params_equal(again.global_params(), published)
    meta, params = full(again, 2)  # before any round: the checksum is computed first
    assert_params_equal(params, replica)
    assert meta["checksum"] == replica_checksum(replica)
    # The update is not kept across a restart; the next round's is, on top of what workers hold.
    assert download(again, 2, have_round=1)[0]["kind"] == "global_params"
    play_round(again, 2)
    umeta = apply_body(replica, download(again, 3, have_round=2)[1])
    assert umeta["kind"] == "update"
    fmeta, params = full(again, 3)
    assert_params_equal(replica, params)
    assert replica_checksum(replica) == umeta["checksum"] == fmeta["checksum"]


def test_a_checkpoint_without_true_restores_true_as_published(
    make_server: ServerFactory, tmp_path: Path
) -> None:
    save = {"save_dir": str(tmp_path), "save_every": 1}
    server = two_workers(make_server, "fp32", **save)
    play_round(server, 0)
    published = server.global_params()
    server.stop()
    assert not (list_checkpoints(tmp_path)[-1] / TRUE_FILE).exists()
    again = two_workers(make_server, "int4", **save)
    assert_params_equal(again.global_params(true=True), published)
    assert_params_equal(again.global_params(), published)
    replica = {n: t.clone() for n, t in published.items()}
    play_round(again, 1)
    apply_body(replica, download(again, 2, have_round=1)[1])
    assert_params_equal(replica, full(again, 2)[1])


# --- refusals -------------------------------------------------------------------------------------


def test_configurations_a_lossy_downlink_cannot_serve_are_refused() -> None:
    assert DOWNLOAD_CODECS == ("fp32", "bf16", "int8", "int4", "sparse")
    with pytest.raises(ValueError, match=r"--download-codec.*needs sync mode.*async"):
        ServerConfig(download_codec="int8", mode="async")
    with pytest.raises(ValueError, match=r"--download-codec.*fragments"):
        ServerConfig(download_codec="int4", num_fragments=2)
    for name in ("lowrank", "zstd"):
        with pytest.raises(ValueError, match=r"--download-codec.*one of fp32, bf16, int8, int4"):
            ServerConfig(download_codec=name)
    ServerConfig(download_codec="fp32", mode="async")  # full parameters go anywhere
    assert codec_by_name("int8").lossy


def test_a_streaming_registration_is_refused(make_server: ServerFactory) -> None:
    server = make_server(model(), num_workers=2, download_codec="int8")
    register(server, "a")
    before = state(server)
    info = {"num_fragments": 2, "fragment_pattern": "sequential"}
    resp = post_json(server, "/register", {"worker_id": "b", "info": info})
    reply = assert_error(resp, 422, "fragments_refused")
    assert "--download-codec int8" in reply["detail"] and "num_fragments=1" in reply["detail"]
    assert_unchanged(before, server)
    fresh = make_server(model(), num_workers=1, download_codec="int8")
    resp = post_json(fresh, "/register", {"worker_id": "c", "info": info})
    assert_error(resp, 422, "fragments_refused")
    assert fresh.status()["fragment_pattern"] is None  # the first worker set nothing
