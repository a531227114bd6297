"""The global embedding store (mmserve.encoder.embedding_store) against a real `mooncake_master` on 127.0.0.1.

Encoder level: entries round-trip bit-exactly through the store, tampered / forged / foreign-secret entries are
refused and recomputed (and repaired), checkpoints never share entries, audio is shared between an encoder
and an encoder service (whose /metrics counts the hit), and an unreachable, stopped or killed master only
degrades to local encoding within the bounded wait, then recovers. End to end: two monolithic `mmserve serve`
processes (each its own tower) share one master: what server A encoded is a store hit on server B, with HF
`generate`'s tokens (image and video); killing the master loses no request, and its return is picked up.

Mooncake's client `close` takes ~1.7 s (holding the GIL), so clients are few and module-scoped.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import shutil
import signal
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from mmserve.config import EmbeddingStoreConfig, EncoderConfig, MediaConfig
from mmserve.encoder.runner import EncodeTimings, MediaInput, build_encoder
from mmserve.encoder.service import EncoderService, build_encoder_app
from mmserve.encoder.store_entry import EntryRejected, decode_entry, encode_entry, model_fingerprint
from mmserve.models.family import load_family
from mmserve.multimodal.items import MAIN, ItemEmbedding, Modality
from mmserve.multimodal.media import MediaRef
from mmserve.server.encoder_workers import as_args
from mmserve.testing.probes import metric
from mmserve.testing.server_process import free_port, start_server
from mmserve.transport.cluster_auth import ClusterSecret
from tests.conftest import random_image
from tests.engine_helpers import image_case, png_bytes, reference_text, video_case, wav_bytes
from tests.mooncake_helpers import start_master, stop_master

SECRET = "embedding-store-test-secret"
MAX_NEW = 8
MM_KWARGS = '{"video_min_pixels": 3136, "video_max_pixels": 12544}'
TIMEOUT_S = 0.5  # --embedding-store-timeout-s of every client here
RETRY_S = 0.5


def store_cfg(url: str) -> EmbeddingStoreConfig:
    return EmbeddingStoreConfig(url, segment_mb=16, buffer_mb=8, timeout_s=TIMEOUT_S, retry_s=RETRY_S)


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(interval_s)


def encoder(model_dir: str, url: str, secret: str | None = SECRET, wait: bool = True):
    enc = build_encoder(
        load_family(model_dir),
        "float32",
        "cpu",
        64,
        MediaConfig(),
        store_cfg=store_cfg(url),
        model_path=model_dir,
        secret=ClusterSecret(secret.encode()) if secret else None,
    )
    if wait:
        wait_for(lambda: enc.store.connected, 20, "the store to connect")
    return enc


def image(seed: int) -> MediaInput:
    return MediaInput(Modality.IMAGE, MediaRef.from_bytes(png_bytes(random_image(seed))))


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same_bits(a: ItemEmbedding | None, b: ItemEmbedding) -> bool:
    return (
        a is not None
        and (a.modality, bytes(a.content_hash), bytes(a.metadata))
        == (b.modality, bytes(b.content_hash), b.metadata)
        and a.tensors.keys() == b.tensors.keys()
        and all(
            (a.tensors[k].dtype, a.tensors[k].shape) == (b.tensors[k].dtype, b.tensors[k].shape)
            and torch.equal(raw_bytes(a.tensors[k]), raw_bytes(b.tensors[k]))
            for k in a.tensors
        )
    )


def entry_value(key: str, item: ItemEmbedding, mac_key: bytes | None) -> bytes:
    return b"".join(bytes(p) for p in encode_entry(key, item, mac_key))


# -- encoder level -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def master(tmp_path_factory, e2e_starting):
    """The encoder-level tests' master (the end-to-end servers start meanwhile: see `e2e_starting`)."""
    proc, url = start_master(tmp_path_factory.mktemp("mooncake"))
    yield url
    stop_master(proc)


@pytest.fixture(scope="module")
def vl_pair(tiny_qwen2_vl, master):
    """Two encoders ("instances") of the tiny Qwen2-VL sharing the store; entries signed."""
    a, b = encoder(tiny_qwen2_vl, master), encoder(tiny_qwen2_vl, master)
    yield a, b
    a.close()
    b.close()


@pytest.fixture(scope="module")
def raw_client(master):
    """A plain Mooncake client: what anyone reaching the master can do (write any key)."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    address = master.removeprefix("mooncake://")
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 8 << 20, "tcp", "", address) == 0
    yield client
    client.close()


def test_entries_round_trip_bit_exact_through_the_store(raw_client):
    main = torch.randn(7, 16)
    main[0, :4] = torch.tensor([math.nan, -0.0, math.inf, -math.inf])
    tensors = {MAIN: main, "deepstack.0": torch.randn(7, 5).bfloat16(), "x": torch.randn(7, 3).half()}
    item = ItemEmbedding(Modality.VIDEO, bytes(range(16)), tensors, b"\x00family metadata\xff")
    mac_key = ClusterSecret(SECRET.encode()).derive(b"embedding-store")
    for key, signer in (("test/signed", mac_key), ("test/unsigned", None)):
        assert raw_client.put_parts(key, *encode_entry(key, item, signer)) == 0
        value = raw_client.get(key)
        assert same_bits(decode_entry(key, value, signer), item)
        assert same_bits(decode_entry(key, value, None), item)  # without a secret, MACs are not checked
    with pytest.raises(EntryRejected, match="not signed"):
        decode_entry("test/unsigned", raw_client.get("test/unsigned"), mac_key)
    with pytest.raises(EntryRejected, match="MAC"):
        decode_entry("test/other-key", raw_client.get("test/signed"), mac_key)  # the MAC covers the key


def test_a_second_encoder_reuses_the_first_ones_embedding(vl_pair):
    a, b = vl_pair
    t_a, t_b, t_c = EncodeTimings(), EncodeTimings(), EncodeTimings()
    first = a.encode(image(1), t_a)
    assert (t_a.misses, t_a.store_hits) == (1, 0)
    assert a.store.drain(10)
    batches = b.batcher.stats.batches
    second = b.encode(image(1), t_b)
    assert (t_b.misses, t_b.store_hits, t_b.hits) == (0, 1, 0)
    assert b.batcher.stats.batches == batches  # B's tower never ran
    assert same_bits(second, first)
    assert b.encode(image(1), t_c) is second and t_c.hits == 1  # B's local cache now: the store is not asked


def test_tampered_forged_and_foreign_entries_are_refused_and_recomputed(vl_pair, raw_client):
    a, b = vl_pair
    original = a.encode(image(2))
    assert a.store.drain(10)
    key, mac_key = a.store.key(original.content_hash), a.store._mac_key
    tampered = bytearray(entry_value(key, original, mac_key))
    tampered[-40] ^= 1  # one bit of the last tensor (the MAC is the last 32 bytes)
    forged = ItemEmbedding(
        Modality.IMAGE, original.content_hash, {MAIN: torch.zeros_like(original.embedding)}, original.metadata
    )
    foreign_key = ClusterSecret(b"the-secret-of-another-cluster").derive(b"embedding-store")
    wrong_rows = ItemEmbedding(
        Modality.IMAGE, original.content_hash, {MAIN: torch.zeros(1, 64)}, original.metadata
    )
    other_item = ItemEmbedding(Modality.IMAGE, bytes(16), forged.tensors, original.metadata)
    bad_values = {
        "tampered": bytes(tampered),
        "unsigned": entry_value(key, forged, None),
        "foreign secret": entry_value(key, forged, foreign_key),
        "another item's entry": entry_value(a.store.key(bytes(16)), other_item, mac_key),
        "not this model's shape (check_item)": entry_value(key, wrong_rows, mac_key),
        "garbage": b"not an entry at all",
    }
    for what, bad in bad_values.items():
        assert raw_client.upsert(key, bad) == 0
        rejected = b.store.snapshot().rejected
        assert b.store.get(original.content_hash, Modality.IMAGE) is None, what
        assert b.store.snapshot().rejected == rejected + 1, what
    # Through the encoder: refused, recomputed by B's tower (same bits as A's), and the entry repaired.
    rejected, batches = b.store.snapshot().rejected, b.batcher.stats.batches
    recomputed = b.encode(image(2), timings := EncodeTimings())
    assert timings.misses == 1 and b.batcher.stats.batches == batches + 1
    assert b.store.snapshot().rejected == rejected + 1
    assert same_bits(recomputed, original)
    assert b.store.drain(10)
    assert same_bits(a.store.get(original.content_hash, Modality.IMAGE), original)
    stats = b.store.snapshot()  # (independent of the other tests' traffic through the same pair)
    assert stats.rejected >= len(bad_values) + 1 and stats.get_errors == 0 and stats.get_seconds_total > 0
    assert stats.connected == 1 and a.store.snapshot().hits >= 1


def test_checkpoints_never_share_entries(tiny_qwen2_vl, tmp_path):
    from safetensors.torch import load_file, save_file

    widths = {MAIN: 64}

    def fingerprint(path, dtype: str = "torch.float32") -> str:
        return model_fingerprint(str(path), "qwen2_vl", dtype, widths)

    same = shutil.copytree(tiny_qwen2_vl, tmp_path / "copy")
    tuned = shutil.copytree(tiny_qwen2_vl, tmp_path / "tuned")  # same architecture, file names and sizes
    weights = load_file(tuned / "model.safetensors")
    save_file(
        {k: v + 1e-3 for k, v in weights.items()}, tuned / "model.safetensors", metadata={"format": "pt"}
    )
    assert (tuned / "model.safetensors").stat().st_size == (same / "model.safetensors").stat().st_size
    base = fingerprint(tiny_qwen2_vl)
    assert fingerprint(same) == base
    assert fingerprint(tuned) != base
    assert fingerprint(tiny_qwen2_vl, "torch.bfloat16") != base
    assert model_fingerprint(tiny_qwen2_vl, "qwen2_5_vl", "torch.float32", widths) != base


def test_audio_is_shared_with_an_encoder_service_and_its_metrics_count_it(tiny_qwen2_audio, master):
    a = encoder(tiny_qwen2_audio, master)
    cfg = EncoderConfig(model=tiny_qwen2_audio, embedding_store=store_cfg(master), cluster_secret=SECRET)
    service = EncoderService(cfg)
    try:
        wait_for(lambda: service.encoder.store.connected, 20, "the service's store to connect")
        clip = MediaInput(Modality.AUDIO, MediaRef.from_bytes(wav_bytes(5, 0.6)))
        first = a.encode(clip)
        assert a.store.drain(10)
        second = service.encoder.encode(clip, timings := EncodeTimings())
        assert timings.store_hits == 1 and service.batcher.stats.batches == 0
        assert same_bits(second, first)
        text = TestClient(build_encoder_app(service)).get("/metrics").text
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert values["mmserve:encoder_embedding_store_hits"] == 1
        assert values["mmserve:encoder_embedding_store_connected"] == 1
        assert values["mmserve:encoder_embedding_store_get_seconds_total"] > 0
    finally:
        a.close()
        service.close()


def test_outages_degrade_within_the_timeout_and_the_store_comes_back(tiny_qwen2_vl, tmp_path):
    port = free_port()
    enc = encoder(tiny_qwen2_vl, f"mooncake://127.0.0.1:{port}", secret=None, wait=False)
    proc = None
    try:
        # No master yet: requests are served at once, without the store.
        start = time.monotonic()
        enc.encode(image(10), timings := EncodeTimings())
        assert timings.misses == 1 and time.monotonic() - start < 10
        assert enc.store.snapshot().skipped == 1 and not enc.store.connected
        proc, _ = start_master(tmp_path, rpc_port=port)  # picked up in the background
        wait_for(lambda: enc.store.connected, 20, "the store to connect once the master is up")
        enc.encode(image(11))
        assert enc.store.drain(10) and enc.store.snapshot().puts == 1
        # Stopped (a slow store: Mooncake's own calls block for 30 s): given up after the timeout.
        os.kill(proc.pid, signal.SIGSTOP)
        before = enc.store.snapshot()
        enc.encode(image(12), timings := EncodeTimings())
        after = enc.store.snapshot()
        assert timings.misses == 1 and after.get_errors == before.get_errors + 1
        assert after.get_seconds_total - before.get_seconds_total < TIMEOUT_S + 1.0  # bounded (+ slack)
        enc.encode(image(13))  # backing off: the store is not asked at all
        assert enc.store.snapshot().skipped == after.skipped + 1
        # Killed: still served locally.
        os.kill(proc.pid, signal.SIGCONT)
        stop_master(proc)
        time.sleep(RETRY_S)
        enc.encode(image(14), timings := EncodeTimings())
        assert timings.misses == 1
        # Back on the same address (its entries are gone): the same client writes to it again.
        proc, _ = start_master(tmp_path, rpc_port=port)
        seeds = iter(range(100, 200))

        def stored_again() -> bool:
            puts = enc.store.snapshot().puts
            enc.encode(image(next(seeds)))
            return enc.store.drain(10) and enc.store.snapshot().puts > puts

        wait_for(stored_again, 30, "the store to come back", interval_s=0.3)
    finally:
        enc.close()
        if proc is not None:
            stop_master(proc)


def test_flags_become_one_config_that_survives_the_engine_json():
    from mmserve.cli import build_parser, embedding_store_config_from_args
    from mmserve.config import EngineConfig, engine_config_from_json, engine_config_to_json

    argv = "--model m --embedding-store mooncake://10.0.0.9:50051 --embedding-store-timeout-s 0.25".split()
    for command in ("serve", "encoder"):
        cfg = embedding_store_config_from_args(build_parser().parse_args([command, *argv]))
        assert (cfg.address, cfg.timeout_s, cfg.segment_mb) == ("10.0.0.9:50051", 0.25, 512.0)
    engine = EngineConfig(model="m", embedding_store=cfg)
    assert engine_config_from_json(engine_config_to_json(engine)) == engine
    assert embedding_store_config_from_args(build_parser().parse_args(["serve", "--model", "m"])) is None
    for bad in ("mooncake://10.0.0.9", "redis://10.0.0.9:6379", "10.0.0.9:50051"):
        with pytest.raises(SystemExit, match="--embedding-store"):
            embedding_store_config_from_args(
                build_parser().parse_args(["serve", "--model", "m", "--embedding-store", bad])
            )


# -- end to end --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def e2e_starting(tiny_qwen2_vl, tmp_path_factory):
    """Starts the end-to-end master and two monolithic servers (each its own tower; entries signed) before the
    encoder-level tests (their `master` asks for it), so that the servers come up while those run (a server takes 15-40 s to
    start on a small shared machine). Yields the start futures and the master's state."""
    logs = tmp_path_factory.mktemp("store-e2e")
    proc, url = start_master(logs)
    flags = {
        "--kv-cache-mb": "16",
        "--mm-processor-kwargs": MM_KWARGS,
        "--embedding-store": url,
        "--embedding-store-segment-mb": "32",
        "--embedding-store-buffer-mb": "16",
        "--embedding-store-timeout-s": str(TIMEOUT_S),
        "--embedding-store-retry-s": "1",
    }
    args = as_args(flags)
    env = {"MMSERVE_CLUSTER_SECRET": SECRET}
    pool = concurrent.futures.ThreadPoolExecutor(2)
    starts = [pool.submit(start_server, tiny_qwen2_vl, *args, log_dir=str(logs), env=env) for _ in range(2)]
    state = {"master": proc, "url": url, "logs": logs}
    yield starts, state
    concurrent.futures.wait(starts, timeout=300)
    servers = [s.result() for s in starts if s.done() and s.exception() is None]
    codes = list(pool.map(lambda h: h.stop(), servers))
    pool.shutdown()
    stop_master(state["master"])
    assert codes == [0] * len(servers)


@pytest.fixture(scope="module")
def e2e(e2e_starting):
    """(server A, server B, the master's state)."""
    starts, state = e2e_starting
    a, b = (s.result(timeout=300) for s in starts)
    return a, b, state


@pytest.fixture(scope="module")
def expected(tiny_qwen2_vl):
    return reference_text(tiny_qwen2_vl, MAX_NEW, json.loads(MM_KWARGS))


def chat(url: str, case) -> str:
    body = {"messages": case.messages, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def store_metric(url: str, name: str) -> float:
    suffix = "" if name == "connected" or name.endswith("_total") else "_total"  # the server's counters
    return metric(url, f"embedding_store_{name}{suffix}")


def grew(url: str, name: str, before: float, within_s: float) -> bool:
    """Whether the server's store metric `name` rises above `before` within `within_s` (the engine's stats
    reach the API server every 0.25 s)."""
    deadline = time.monotonic() + within_s
    while store_metric(url, name) <= before:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_what_server_a_encoded_is_a_store_hit_on_server_b(e2e, expected):
    a, b, _ = e2e
    for case in (image_case([31], "Describe."), video_case(32, "What happens?")):
        puts, hits = store_metric(a.url, "puts"), store_metric(b.url, "hits")
        assert chat(a.url, case) == expected(case)
        assert grew(a.url, "puts", puts, 20), "server A did not store the item"
        assert chat(b.url, case) == expected(case)
        assert grew(b.url, "hits", hits, 10), "no store hit on server B"
    assert store_metric(b.url, "rejected") == store_metric(b.url, "get_errors") == 0
    assert store_metric(b.url, "connected") == 1 and store_metric(b.url, "get_seconds_total") > 0


def test_killing_the_master_loses_no_request(e2e, expected):
    a, b, state = e2e
    stop_master(state["master"])

    def unavailable() -> float:
        return store_metric(b.url, "get_errors") + store_metric(b.url, "skipped")

    before = unavailable()
    for i, server in enumerate((a, b, a, b)):
        case = image_case([40 + i], "After the kill.")
        assert chat(server.url, case) == expected(case)  # encoded locally: the same tokens
    wait_for(lambda: unavailable() > before, 5, "server B to count the unavailable store", 0.2)
    # The master comes back on its address: both servers use it again without a restart.
    state["master"], _ = start_master(state["logs"], rpc_port=int(state["url"].rsplit(":", 1)[1]))
    seeds = iter(range(50, 100))

    def shared_again() -> bool:
        case = image_case([next(seeds)], "Back.")
        puts, hits = store_metric(a.url, "puts"), store_metric(b.url, "hits")
        assert chat(a.url, case) == expected(case)
        if not grew(a.url, "puts", puts, 3):
            return False
        assert chat(b.url, case) == expected(case)
        return grew(b.url, "hits", hits, 2)

    wait_for(shared_again, 60, "the servers to share embeddings again", interval_s=0.5)
