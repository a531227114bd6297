"""`mmserve bench kv`: how fast a request's KV moves from a prefill engine to a decode engine, per backend,
beside raw ZMQ moving the same bytes.

Two real engines in this process (the model's language side only), each with the engine loop's `Handoffs`,
pumped in turn; their sockets and Mooncake's transfer engine are the real ones, over TCP loopback. For each
prompt length and backend the handoff time is measured from the reservation to the decode engine's commit
(round trips, the copy or write, the decode side's scatter into its pool), as the prefill server reports it.
The raw baseline sends the same number of bytes once over a ZMQ PUSH -> PULL pair (no protocol, no pool).
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid

import zmq

from mmserve.config import EngineConfig
from mmserve.disagg.handoffs import Handoffs
from mmserve.engine.engine import Engine
from mmserve.sampling_params import SamplingParams
from mmserve.transport import messages as m


def _engines(model: str, dtype: str, kv_cache_mb: float, kv_cache_dtype: str) -> tuple[Engine, Engine]:
    def make(mode: str) -> Engine:
        cfg = EngineConfig(
            model=model,
            dtype=dtype,
            kv_cache_mb=kv_cache_mb,
            kv_cache_dtype=kv_cache_dtype,
            disaggregation_mode=mode,
            language_only=True,
            max_num_batched_tokens=8192,
        )
        return Engine(cfg)

    return make("prefill"), make("decode")


def _handoff(
    p: Engine, ph: Handoffs, d: Engine, dh: Handoffs, prompt: list[int], backend: str
) -> m.HandedOffMsg:
    room = uuid.uuid4().hex
    p.add_request(
        room,
        prompt,
        SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
        [],
        handoff=m.KvTarget(room, dh.bootstrap_endpoint, backend),
    )
    dh.adopt(m.AdoptReq(room, 60.0))
    done: m.HandedOffMsg | None = None
    deadline = time.monotonic() + 900  # a long prompt's prefill on 2 cores takes minutes
    while done is None or d.has_work:
        if time.monotonic() > deadline:
            raise TimeoutError("the handoff did not finish in 900 s")
        if p.has_work:
            for out in p.step():
                ph.start(out)
        for msg in ph.drain():
            if isinstance(msg, m.ErrorMsg):
                raise RuntimeError(f"handoff failed: {msg.failure}")
            if isinstance(msg, m.HandedOffMsg):
                done = msg
        dh.drain()
        if d.has_work:
            d.step()
    return done


def raw_zmq_seconds(nbytes: int, repeats: int) -> float:
    """Median seconds to move `nbytes` once over ZMQ tcp loopback (PUSH -> PULL, one frame)."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    payload = bytearray(nbytes)
    times = []
    try:
        for _ in range(repeats + 1):
            got = threading.Event()
            reader = threading.Thread(target=lambda got=got: (pull.recv(copy=False), got.set()))
            reader.start()
            start = time.perf_counter()
            push.send(payload, copy=False)
            got.wait(60)
            times.append(time.perf_counter() - start)
            reader.join()
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()
    return statistics.median(times[1:])  # the first connects


def run(
    model: str,
    prompt_lens: list[int],
    dtype: str = "float32",
    repeats: int = 5,
    kv_cache_mb: float = 1024,
    kv_cache_dtype: str = "auto",
) -> list[dict]:
    """Handoff times per backend; both engines keep their KV in `kv_cache_dtype` (fp8: half of bf16's bytes)."""
    p, d = _engines(model, dtype, kv_cache_mb, kv_cache_dtype)
    ph, dh = Handoffs(p, None), Handoffs(d, None)
    rows = []
    try:
        for n in prompt_lens:
            row: dict = {"prompt_tokens": n}
            for backend in dh.backends:
                times, nbytes = [], 0
                for r in range(repeats + 1):
                    prompt = [
                        20 + (7 * i + 13 * r + n) % 200 for i in range(n)
                    ]  # ids every kit vocabulary has
                    msg = _handoff(p, ph, d, dh, prompt, backend)
                    nbytes = msg.kv_bytes
                    if r:  # the first warms the connection (and Mooncake's handshake)
                        times.append(msg.transfer_s)
                t = statistics.median(times)
                row["kv_mb"] = nbytes / 2**20
                row[f"{backend}_ms"] = 1000 * t
                row[f"{backend}_gbps"] = nbytes / t / 1e9
            t = raw_zmq_seconds(int(row["kv_mb"] * 2**20), repeats)
            row["raw_zmq_ms"], row["raw_zmq_gbps"] = 1000 * t, row["kv_mb"] * 2**20 / t / 1e9
            rows.append(row)
    finally:
        ph.close()
        dh.close()
    return rows


def report(rows: list[dict]) -> str:
    backends = [b for b in ("zmq", "mooncake") if rows and f"{b}_ms" in rows[0]]
    head = [
        "prompt tokens",
        "KV MB",
        *(f"{b} ms" for b in backends),
        *(f"{b} GB/s" for b in backends),
        "raw ZMQ ms",
        "raw ZMQ GB/s",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [str(row["prompt_tokens"]), f"{row['kv_mb']:.2f}"]
        cells += [f"{row[f'{b}_ms']:.2f}" for b in backends] + [f"{row[f'{b}_gbps']:.2f}" for b in backends]
        cells += [f"{row['raw_zmq_ms']:.2f}", f"{row['raw_zmq_gbps']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
