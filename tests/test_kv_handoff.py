"""The prefill -> decode handoff in one process: a prefill engine and a decode engine (tiny Qwen2-VL), each
with the engine loop's `Handoffs`, talking over their real sockets (ZMQ and Mooncake's transfer engine).

Text prompts only here (the servers' tests send media through the router); what this file pins down is the
protocol and the slot ownership: tokens equal to one engine's (greedy and seeded sampling, so the generator
state travels), back-pressure, timeouts on both sides, aborts, forged messages; every pool integral after.
"""

from __future__ import annotations

import time
import uuid

import msgspec
import pytest
import torch
import zmq

from mmserve.config import EngineConfig, ModelConfig
from mmserve.disagg import kv_messages as k
from mmserve.disagg.handoffs import Handoffs
from mmserve.engine.cache.kv_pool import KVPool, uniform_specs
from mmserve.engine.engine import Engine
from mmserve.models.loader import load_hf_config
from mmserve.sampling_params import SamplingParams
from mmserve.transport import messages as m
from mmserve.transport.cluster_auth import ClusterSecret

PROMPTS = [[3, 17, 29, 41, 5, 9, 11] * 3, [7, 8, 9, 10, 11, 12], list(range(20, 60))]
SECRET = ClusterSecret(b"k" * 32)


def mb_for(model: str, slots: int) -> float:
    """A KV budget of exactly `slots` tokens (fp32)."""
    mc = ModelConfig.from_hf(model, load_hf_config(model))
    specs = uniform_specs(mc.num_layers, mc.num_kv_heads, mc.head_dim)
    return slots * KVPool.bytes_per_token(specs, torch.float32) / 2**20


def engine(model: str, mode: str, **kw) -> Engine:
    kw.setdefault("kv_cache_mb", 4)
    return Engine(EngineConfig(model=model, disaggregation_mode=mode, language_only=True, **kw))


class Pair:
    """A prefill and a decode engine with their handoff sides, pumped by hand like two engine loops."""

    def __init__(self, model: str, secret=None, p_kw=None, d_kw=None) -> None:
        self.p = engine(model, "prefill", **(p_kw or {}))
        self.d = engine(model, "decode", **(d_kw or {}))
        self.ph = Handoffs(self.p, secret)
        self.dh = Handoffs(self.d, secret)
        self.p_msgs: list = []
        self.d_msgs: list = []
        self.d_tokens: dict[str, list[int]] = {}

    def submit(
        self, prompt: list[int], params: SamplingParams, backend: str = "zmq", adopt: bool = True
    ) -> str:
        room = uuid.uuid4().hex
        target = m.KvTarget(room, self.dh.bootstrap_endpoint, backend)
        self.p.add_request(room, prompt, params, [], handoff=target)
        if adopt:
            self.d_msgs += self.dh.adopt(m.AdoptReq(room, 30.0))
        return room

    def pump(self, until, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not until():
            assert time.monotonic() < deadline, "handoff did not settle"
            if self.p.has_work:
                for out in self.p.step():
                    assert out.handoff
                    self.ph.start(out)
            self.p_msgs += self.ph.drain()
            self.d_msgs += self.dh.drain() + self.dh.expire()
            if self.d.has_work:
                for out in self.d.step():
                    self.d_tokens.setdefault(out.request_id, []).append(out.token_id)
            time.sleep(0.001)

    def tokens(self, room: str) -> list[int]:
        first = [
            t
            for msg in self.d_msgs
            if isinstance(msg, m.TokensMsg) and msg.request_id == room
            for t in msg.token_ids
        ]
        return first + self.d_tokens.get(room, [])

    def settled(self) -> bool:
        return (
            not self.p.has_work
            and not self.d.has_work
            and not self.ph.in_flight
            and not self.dh.bootstrap.rooms
        )

    def close(self) -> None:
        self.ph.close()
        self.dh.close()

    def check(self) -> None:
        self.p.check_integrity()
        self.d.check_integrity()
        assert self.d.pool.num_used == 0 and self.d.scheduler.reserved == 0  # nothing held on the decode side
        assert self.d.states is None or self.d.states.num_used == 0


@pytest.fixture(scope="module")
def pair(tiny_qwen2_vl):
    pair = Pair(tiny_qwen2_vl, p_kw={"max_num_batched_tokens": 16})  # chunked prefill on the prefill side
    yield pair
    pair.close()


def reference(model: str, prompts, params, **kw) -> list[list[int]]:
    """Greedy or seeded tokens of `prompts` on one engine (with engine options `kw`)."""
    e = engine(model, "null", **kw)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        e.add_request(str(i), prompt, p, [])
    out: dict[str, list[int]] = {}
    while e.has_work:
        for o in e.step():
            out.setdefault(o.request_id, []).append(o.token_id)
    return [out[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("backend", ["zmq", "mooncake"])
def test_handoff_continues_exactly_as_one_engine(pair, tiny_qwen2_vl, backend):
    params = [
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.0, seed=1234, ignore_eos=True),  # the generator travels
        SamplingParams(max_tokens=5, temperature=0.8, top_k=20, seed=7, ignore_eos=True),
    ]
    expected = reference(tiny_qwen2_vl, PROMPTS, params)
    rooms = [pair.submit(p, s, backend) for p, s in zip(PROMPTS, params, strict=True)]
    pair.pump(pair.settled)
    assert [pair.tokens(r) for r in rooms] == expected
    done = [msg for msg in pair.p_msgs if isinstance(msg, m.HandedOffMsg) and msg.request_id in rooms]
    assert len(done) == 3 and all(msg.kv_bytes > 0 for msg in done)
    row = pair.p.transfer.kv_bytes(1)
    assert sorted(msg.kv_bytes for msg in done) == sorted(len(p) * row for p in PROMPTS)
    # The repeat hits the prefill side's prefix cache (the prompt stayed there after the handoff).
    again = pair.submit(PROMPTS[0], params[0], backend)
    pair.pump(pair.settled)
    assert pair.tokens(again) == expected[0]
    assert [msg for msg in pair.p_msgs if isinstance(msg, m.HandedOffMsg) and msg.request_id == again][
        0
    ].num_cached_tokens > 0
    pair.check()


def test_first_token_that_ends_the_request_moves_no_kv(pair, tiny_qwen2_vl):
    room = pair.submit(PROMPTS[1], SamplingParams(max_tokens=1, temperature=0))
    pair.pump(pair.settled)
    assert len(pair.tokens(room)) == 1
    finished = [msg for msg in pair.d_msgs if isinstance(msg, m.TokensMsg) and msg.request_id == room]
    assert finished[-1].finish_reason == "length"
    assert [
        msg.kv_bytes for msg in pair.p_msgs if isinstance(msg, m.HandedOffMsg) and msg.request_id == room
    ] == [0]
    pair.check()


def test_handoff_parks_until_the_decode_servers_request_arrives(pair):
    room = pair.submit(PROMPTS[1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), adopt=False)
    pair.pump(lambda: any(isinstance(x, m.HandedOffMsg) and x.request_id == room for x in pair.p_msgs))
    assert room in pair.dh.bootstrap.rooms and pair.d.scheduler.reserved == len(PROMPTS[1])  # parked, held
    pair.d_msgs += pair.dh.adopt(m.AdoptReq(room, 30.0))
    pair.pump(pair.settled)
    assert len(pair.tokens(room)) == 3
    pair.check()


def test_decode_side_refuses_what_it_cannot_carry_to_the_end(tiny_qwen2_vl):
    # 64 KV slots on the decode side: a 40-token prompt with 30 new tokens never fits; two of 20 + 20 do not
    # fit together.
    pair = Pair(tiny_qwen2_vl, d_kw={"kv_cache_mb": mb_for(tiny_qwen2_vl, 64)})
    try:
        assert pair.d.pool.num_slots == 64
        too_big = pair.submit(PROMPTS[2], SamplingParams(max_tokens=30, temperature=0))
        pair.pump(lambda: any(isinstance(x, m.ErrorMsg) and x.request_id == too_big for x in pair.p_msgs))
        err = [x for x in pair.p_msgs if isinstance(x, m.ErrorMsg) and x.request_id == too_big][0]
        assert (err.failure.status, err.failure.code) == (503, "decode_at_capacity")
        assert "never fit" in err.failure.message
        pair.dh.abort(too_big)  # what the decode API server does when the router closes its request
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        first = pair.submit(list(range(100, 120)), params)
        pair.pump(lambda: pair.d.scheduler.running)
        second = pair.submit(list(range(200, 220)), params)
        pair.pump(lambda: any(isinstance(x, m.ErrorMsg) and x.request_id == second for x in pair.p_msgs))
        err = [x for x in pair.p_msgs if isinstance(x, m.ErrorMsg) and x.request_id == second][0]
        assert (err.failure.status, err.failure.code) == (503, "decode_at_capacity")
        pair.d.check_integrity()
        pair.p.check_integrity()
        # the refused room still waits on the decode side (its API request would be closed by the router)
        pair.dh.abort(second)
        pair.pump(pair.settled)
        assert len(pair.tokens(first)) == 20
        pair.check()
    finally:
        pair.close()


def test_transfer_timeout_frees_both_sides(tiny_qwen2_vl):
    pair = Pair(tiny_qwen2_vl, p_kw={"kv_transfer_timeout_s": 1.0})
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # a "decode engine" that never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        room = uuid.uuid4().hex
        target = m.KvTarget(room, f"tcp://127.0.0.1:{port}", "zmq")
        pair.p.add_request(room, PROMPTS[0], SamplingParams(max_tokens=4, temperature=0), [], handoff=target)
        start = time.monotonic()
        pair.pump(lambda: any(isinstance(x, m.ErrorMsg) and x.request_id == room for x in pair.p_msgs))
        assert time.monotonic() - start < 5
        err = [x for x in pair.p_msgs if isinstance(x, m.ErrorMsg) and x.request_id == room][0]
        assert (err.failure.status, err.failure.code) == (504, "kv_transfer_timeout")
        assert not pair.ph.in_flight
        pair.p.check_integrity()
        # The decode side: a reservation whose commit never comes is freed at its deadline, and the API
        # server's request gets a 504.
        d = engine(tiny_qwen2_vl, "decode", kv_transfer_timeout_s=0.5)
        dh = Handoffs(d, None)
        try:
            peer = ctx.socket(zmq.DEALER)
            peer.connect(dh.bootstrap_endpoint)
            lone = uuid.uuid4().hex
            dh.adopt(m.AdoptReq(lone, 30.0))
            layout = dh.bootstrap.layout
            peer.send_multipart([k.encoder.encode(k.Reserve(k.KV_PROTOCOL_VERSION, lone, 10, 20, layout, "zmq", time.time())), b""])
            deadline = time.monotonic() + 5
            out: list = []
            while not any(isinstance(x, m.ErrorMsg) for x in out):
                assert time.monotonic() < deadline
                out += dh.drain() + dh.expire()
                time.sleep(0.01)
            assert isinstance(k.from_decode.decode(peer.recv_multipart()[0]), k.Reserved)
            assert [x.failure.code for x in out if isinstance(x, m.ErrorMsg)] == ["kv_transfer_timeout"]
            assert d.scheduler.reserved == 0 and d.pool.num_used == 0
            d.check_integrity()
            peer.close(0)
        finally:
            dh.close()
    finally:
        silent.close(0)
        ctx.term()
        pair.close()


def test_forged_and_unsigned_messages_are_dropped(tiny_qwen2_vl):
    pair = Pair(tiny_qwen2_vl, secret=SECRET)
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    try:
        peer.connect(pair.dh.bootstrap_endpoint)
        layout = pair.dh.bootstrap.layout
        reserve = k.encoder.encode(k.Reserve(k.KV_PROTOCOL_VERSION, "x", 4, 8, layout, "zmq", time.time()))
        peer.send_multipart([reserve, b""])  # unsigned
        peer.send_multipart([reserve, b"", ClusterSecret(b"z" * 32).mac(reserve, b"")])  # wrong secret
        time.sleep(0.2)
        pair.dh.drain()
        assert not pair.dh.bootstrap.rooms and pair.d.pool.num_used == 0
        assert not peer.poll(100)  # no answer to either
        # The real prefill side, with the secret, still works.
        room = pair.submit(PROMPTS[1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        pair.pump(pair.settled)
        assert len(pair.tokens(room)) == 3
        pair.check()
    finally:
        peer.close(0)
        ctx.term()
        pair.close()


def test_abort_on_either_side_frees_everything(pair):
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    room = pair.submit(PROMPTS[2], params)
    pair.pump(lambda: bool(pair.d.scheduler.running))
    pair.d.abort(room)  # the client went away from the decode server mid-generation
    pair.dh.abort(room)
    pair.pump(pair.settled)
    pair.check()
    # Abort on the prefill side while the handoff is on its way: the job is cancelled and reports.
    room = pair.submit(PROMPTS[2], params, adopt=False)
    pair.pump(lambda: bool(pair.ph.in_flight))
    pair.ph.abort(room)
    pair.pump(lambda: not pair.ph.in_flight)
    pair.dh.abort(room)  # what the decode API server does when the router closes its request
    pair.pump(pair.settled)
    pair.check()


def test_a_handoff_with_a_first_token_outside_the_vocabulary_is_refused(pair):
    """Its first token would be the next decode step's input and fail the whole decode batch: the commit is
    refused (the waiting API request told), and the decode engine's running request completes."""
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    good = pair.submit(PROMPTS[2], params)
    pair.pump(lambda: bool(pair.d.scheduler.running))
    vocab = pair.d.model_config.vocab_size
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    try:
        peer.connect(pair.dh.bootstrap_endpoint)
        room, prompt = uuid.uuid4().hex, PROMPTS[1]
        pair.d_msgs += pair.dh.adopt(m.AdoptReq(room, 30.0))
        layout = pair.dh.bootstrap.layout
        rows = len(prompt)
        reserve = k.Reserve(k.KV_PROTOCOL_VERSION, room, rows, rows + 4, layout, "zmq", time.time())
        state = k.HandoffState(prompt, vocab, None, SamplingParams(max_tokens=4, temperature=0), 0, None,
                               len(prompt), 0, 0.0, 0.0, 0.0, 0, 0, [])
        replies = []
        for msg in (reserve, k.Commit(room, state, time.time())):
            peer.send_multipart([k.encoder.encode(msg), b""])
            for _ in range(500):
                pair.d_msgs += pair.dh.drain()
                if peer.poll(10):
                    break
            replies.append(k.from_decode.decode(peer.recv_multipart()[0]))
        assert isinstance(replies[0], k.Reserved)
        assert isinstance(replies[1], k.Refused) and replies[1].failure.code == "bad_handoff"
        assert f"first token {vocab} is outside the vocabulary" in replies[1].failure.message
        assert [x.failure.code for x in pair.d_msgs if isinstance(x, m.ErrorMsg)] == ["kv_transfer_failed"]
        pair.pump(pair.settled)
        assert len(pair.tokens(good)) == 30
        pair.check()
    finally:
        peer.close(0)
        ctx.term()
        pair.d_msgs.clear()


def test_a_request_that_cannot_be_recomputed_fails_instead_of_being_retracted(tiny_qwen2_vl):
    from mmserve.disagg.kv_bootstrap import _request

    d = engine(tiny_qwen2_vl, "decode", kv_cache_mb=mb_for(tiny_qwen2_vl, 40))
    state = k.HandoffState(
        list(range(10, 30)),
        5,
        None,
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
        0,
        None,
        20,
        0,
        0.0,
        0.0,
        0.0,
        0,
        0,
        [],
    )
    held = d.reserve(20, state=False)
    d.adopt(_request("r", state), held)
    dropped = []
    for _ in range(40):
        if not d.has_work:
            break
        d.step()
        dropped += d.take_dropped()
    assert [r.request_id for r in dropped] == ["r"] and dropped[0].finish_reason == "error"
    d.check_integrity()
    assert d.pool.num_used == 0
    assert torch.equal(d.pool.refcount(torch.arange(40)), torch.zeros(40, dtype=torch.int64))


# -- hybrid models: the linear layers' state travels with the KV rows ------------------------------------------
@pytest.mark.parametrize("backend", ["zmq", "mooncake"])
def test_a_hybrid_models_state_travels_with_its_kv(tiny_model, backend):
    model = tiny_model("qwen3_5")
    hybrid = Pair(model, p_kw={"max_num_batched_tokens": 7})
    try:
        params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)] * 2
        params.append(SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True))
        expected = reference(model, PROMPTS, params)
        rooms = [hybrid.submit(p, s, backend) for p, s in zip(PROMPTS, params, strict=True)]
        hybrid.pump(hybrid.settled)
        assert [hybrid.tokens(r) for r in rooms] == expected
        done = [msg for msg in hybrid.p_msgs if isinstance(msg, m.HandedOffMsg) and msg.request_id in rooms]
        state = hybrid.p.transfer.state_bytes
        assert state > 0 and sorted(msg.kv_bytes for msg in done) == sorted(
            hybrid.p.transfer.kv_bytes(len(p)) + state for p in PROMPTS
        )
        hybrid.check()
        assert hybrid.d.states.num_used == 0
    finally:
        hybrid.close()


def test_negative_control_a_handoff_without_its_state_decodes_wrong(tiny_model, monkeypatch):
    model = tiny_model("qwen3_5")
    hybrid = Pair(model)
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        expected = reference(model, [PROMPTS[2]], [params])
        transfer = hybrid.d.transfer
        real = transfer.write

        def stateless(cache, data):  # the rows arrive, the state is left as the slot was
            real(cache, data)
            if cache.state_slot is not None:
                transfer.states.scatter(cache.state_slot, torch.zeros(transfer.state_bytes, dtype=torch.uint8))

        monkeypatch.setattr(transfer, "write", stateless)
        room = hybrid.submit(PROMPTS[2], params)
        hybrid.pump(hybrid.settled)
        assert hybrid.tokens(room)[0] == expected[0][0]  # sampled on the prefill side
        assert hybrid.tokens(room) != expected[0]
    finally:
        hybrid.close()


def test_mismatched_peers_are_refused_with_an_error_naming_the_difference(tiny_model, tiny_qwen2_vl):
    """A hybrid prefill engine and a decode engine of another model: 400 naming the first layer that differs; a
    peer speaking another protocol version: 400 naming both versions."""
    p = engine(tiny_model("qwen3_5"), "prefill")
    d = engine(tiny_qwen2_vl, "decode")
    ph, dh = Handoffs(p, None), Handoffs(d, None)
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    try:
        room = uuid.uuid4().hex
        msgs = dh.adopt(m.AdoptReq(room, 30.0))
        target = m.KvTarget(room, dh.bootstrap_endpoint, "zmq")
        p.add_request(room, PROMPTS[1], SamplingParams(max_tokens=3, temperature=0), [], handoff=target)
        deadline = time.monotonic() + 30
        failures = []
        while not failures:
            assert time.monotonic() < deadline
            for out in p.step() if p.has_work else []:
                ph.start(out)
            failures = [x for x in ph.drain() if isinstance(x, m.ErrorMsg)]
            msgs += dh.drain()
            time.sleep(0.001)
        assert failures[0].failure.code == "kv_layout_mismatch"
        assert "layer 0 is attention" in failures[0].failure.message and "linear state" in failures[0].failure.message
        peer.connect(dh.bootstrap_endpoint)
        old = msgspec.msgpack.encode({"type": "reserve", "room": "old", "rows": 4, "total": 8})  # no version
        peer.send_multipart([old, b""])
        for _ in range(500):
            dh.drain()
            if peer.poll(10):
                break
        reply = k.from_decode.decode(peer.recv_multipart()[0])
        assert isinstance(reply, k.Refused) and reply.failure.code == "kv_protocol_mismatch"
        assert "version None" in reply.failure.message and f"{k.KV_PROTOCOL_VERSION}" in reply.failure.message
        p.check_integrity()
        d.check_integrity()
        assert d.pool.num_used == 0 and p.states.num_used == p.scheduler.prefix_cache.num_states
    finally:
        peer.close(0)
        ctx.term()
        ph.close()
        dh.close()
