"""Engine process main: ZMQ in, scheduler loop, ZMQ out.

Started by the API server as `python -m mmserve.runtime.loop --config JSON` (an explicit JSON config, never
a pickled object). Sockets: PULL on `input_addr` for ToEngine messages, PUSH on `output_addr` for
FromEngine messages.

The Intake's embedding receivers (one per transport in `embedding_transports`) take parts pushed by encoder
services. How requests get
their embeddings (in-process encode on a worker thread, or parts from encoders) is `intake.py`'s concern;
this loop only moves messages and steps the engine, and it alone touches the engine. It exits when told to,
or when its parent process is gone (no orphans).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time

import msgspec
import zmq

from mmserve.config import engine_config_from_json
from mmserve.disagg.handoffs import Handoffs
from mmserve.encoder.runner import build_encoder
from mmserve.engine.engine import BatchFailed, Engine
from mmserve.glibc_heap import IdleTrim
from mmserve.runtime.intake import Intake
from mmserve.transport import messages as m
from mmserve.transport.channel import TransferConfig, bind_address, open_receiver, scheme_of
from mmserve.transport.cluster_auth import ClusterSecret, resolve_secret

logger = logging.getLogger("mmserve.engine")
STATS_INTERVAL_S = 0.25
IDLE_POLL_MS = 20
WAITING_POLL_MS = 2


class EngineLoop:
    def __init__(
        self, engine: Engine, input_addr: str, output_addr: str, secret: ClusterSecret | None = None
    ) -> None:
        self.engine = engine
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(input_addr)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.LINGER, 1000)
        self.output.connect(output_addr)
        self.decoder = msgspec.msgpack.Decoder(m.ToEngine)
        self.encoder = msgspec.msgpack.Encoder()
        cfg = engine.cfg
        local = (
            None
            if cfg.language_only or cfg.disaggregation_mode == "decode"
            else build_encoder(
                engine.family,
                cfg.dtype,
                cfg.device,
                cfg.embedding_cache_mb,
                cfg.media,
                store_cfg=cfg.embedding_store,
                model_path=cfg.model,
                secret=secret,
                pack_weights=cfg.pack_weights,
                fp32_gemm=cfg.fp32_gemm,
                cpu_kernels=cfg.cpu_kernels,
                quantization=cfg.quantization if cfg.quantize_tower else None,
            )
        )
        transfer = TransferConfig(mooncake_pool_mb=cfg.mooncake_pool_mb, host=cfg.embedding_host)
        receivers = [
            open_receiver(bind_address(scheme, cfg.embedding_host), transfer, secret)
            for scheme in cfg.embedding_transports
        ]
        self.intake = Intake(engine, local, receivers)
        self.handoffs = Handoffs(engine, secret)
        self.parent_pid = os.getppid()
        self.running = True

    def send(self, msg) -> None:
        self.output.send(self.encoder.encode(msg))

    # -- inputs -------------------------------------------------------------------------------------
    def handle(self, msg) -> None:
        if isinstance(msg, m.GenerateReq):
            if msg.handoff is not None and self.handoffs.sender is None:
                failure = m.Failure(400, "not_a_prefill_server", "this engine is not a prefill engine")
                self.send(m.ErrorMsg(msg.request_id, failure))
                return
            self._send_all(self.intake.generate(msg))
        elif isinstance(msg, m.AdoptReq):
            self._send_all(self.handoffs.adopt(msg))
        elif isinstance(msg, m.LocalEncodeReq):
            self.intake.local_encode(msg)
        elif isinstance(msg, m.FailReq):
            self._send_all(self.intake.fail(msg))
        elif isinstance(msg, m.AbortReq):
            self.intake.abort(msg.request_id)
            self.engine.abort(msg.request_id)
            self.handoffs.abort(msg.request_id)
        elif isinstance(msg, m.PingReq):
            stats = self.stats(msg.nonce)
            if msg.check_integrity:
                try:
                    self.engine.check_integrity()
                    self.intake.check_integrity()
                    stats.integrity_error = ""
                except AssertionError as e:
                    stats.integrity_error = str(e) or "integrity check failed"
            self.send(stats)
        elif isinstance(msg, m.ShutdownReq):
            self.running = False

    def _send_all(self, msgs: list) -> None:
        for msg in msgs:
            self.send(msg)

    # -- outputs ------------------------------------------------------------------------------------
    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except BatchFailed as e:
            # The batch's requests are ended (500); everyone else goes on. If the failure left the pools or
            # caches inconsistent, continuing would corrupt other requests: crash, and the server exits 1.
            logger.exception("%s", e)
            self.engine.check_integrity()
            failure = m.Failure(500, "internal_error", f"the engine failed on this request's batch: {e}")
            for rid in e.request_ids:
                self.send(m.ErrorMsg(rid, failure))
            return
        for req in self.engine.take_dropped():
            self.send(
                m.ErrorMsg(
                    req.request_id,
                    m.Failure(
                        503,
                        "kv_cache_exhausted",
                        "the decode server ran out of KV cache and cannot recompute this request",
                    ),
                )
            )
        for out in outputs:
            if out.handoff:
                self.handoffs.start(out)
                continue
            r = out.request
            msg = m.TokensMsg(
                r.group_id, [out.token_id] if out.token_id is not None else [], out.finish_reason
            )
            msg.index, msg.stop_reason = r.index, r.stop_reason
            msg.eos = out.finish_reason == "stop" and r.stopped_on_token
            msg.logprobs = [out.logprobs] if out.logprobs is not None else None
            msg.prompt_logprobs = out.prompt_logprobs
            msg.num_cached_tokens = r.num_cached_tokens
            if len(r.output_ids) == 1:  # first token: report where the time went
                msg.queue_s = r.first_scheduled_time - r.arrival_time
                msg.prefill_s = r.first_token_time - r.first_scheduled_time
            self.send(msg)

    def stats(self, nonce: int = 0) -> m.StatsMsg:
        e, intake = self.engine.stats(), self.intake
        cache = intake.encoder.cache.stats if intake.encoder is not None else None
        store = intake.encoder.store if intake.encoder is not None else None
        r = intake.assembler.stats
        dropped = (
            r.dropped_stale
            + r.dropped_unknown
            + r.dropped_invalid
            + r.dropped_duplicate
            + intake.parts_malformed
            + sum(intake.parts_rejected.values())
        )
        return m.StatsMsg(
            num_running=e.num_running,
            num_waiting=e.num_waiting + intake.num_waiting,
            kv_cache_usage=e.kv_slots_held / e.kv_slots,
            prefix_cache_queries=e.prefix_queries_tokens,
            prefix_cache_hits=e.prefix_hit_tokens,
            mm_cache_queries=cache.queries if cache else 0,
            mm_cache_hits=cache.hits if cache else 0,
            encode_seconds_total=intake.encode_seconds_total,
            nonce=nonce,
            parts_received=r.parts,
            parts_dropped=dropped,
            kv_slots_used=e.kv_slots_used,
            transfer_held_bytes=intake.held_bytes,
            num_preemptions=e.retractions,
            parts_forged=intake.parts_rejected["forged"],
            parts_replayed=intake.parts_rejected["replayed"],
            embedding_store=store.snapshot().as_dict() if store is not None else {},
            prefix_cache_tokens=e.prefix_cache_tokens,
            overlap_stages=e.overlap_stages,
            overlap_tokens=e.overlap_tokens,
            state_cache_usage=e.state_slots_used / e.state_slots if e.state_slots else 0.0,
            state_checkpoints=e.state_checkpoints,
            iteration_token_counts=list(e.iteration_token_counts),
            iteration_tokens_sum=e.iteration_tokens_sum,
            **self.handoffs.stats(),
        )

    def run(self) -> None:
        mc = self.engine.model_config
        per_token = self.engine.kv_bytes_per_token
        pool = self.engine.pool
        endpoints = {scheme_of(r.endpoint): r.endpoint for r in self.intake.receivers}
        has_tower = self.intake.encoder is not None
        ready = m.ReadyMsg(
            m.SCHEMA_VERSION,
            mc.max_model_len,
            pool.num_slots,
            pool.num_slots * per_token,
            per_token,
            endpoints,
            has_tower,
            self.handoffs.bootstrap_endpoint,
            self.handoffs.backends,
        )
        if states := self.engine.states:
            ready.state_slots = states.num_slots
            ready.state_cache_bytes = states.num_slots * states.slot_bytes
        if rows := self.engine.window_pool:
            ready.window_rows, ready.window = rows.num_slots, self.engine.window
            ready.window_cache_bytes = rows.num_slots * rows.token_bytes
        self.send(ready)
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        for receiver in self.intake.receivers:
            poller.register(receiver.pollable, zmq.POLLIN)
        for pollable in self.handoffs.pollables:
            poller.register(pollable, zmq.POLLIN)
        last_stats = 0.0
        trim = IdleTrim()  # a burst's large temporaries go back to the OS once the engine is idle (glibc_heap)
        while self.running:
            # Encoder parts and API messages wake the poller; in-process encodes finish on a worker thread, so
            # poll briefly while one is outstanding.
            timeout = (
                0
                if self.engine.has_work or self.intake.busy
                else WAITING_POLL_MS
                if self.intake.num_waiting
                else IDLE_POLL_MS
            )
            events = dict(poller.poll(timeout))
            if self.input in events:
                while True:
                    try:
                        raw = self.input.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self.handle(self.decoder.decode(raw))
                    except msgspec.DecodeError:
                        logger.warning("dropped an undecodable message (%d bytes)", len(raw))
            self._send_all(self.intake.drain())
            self._send_all(self.handoffs.drain())
            if self.engine.has_work:
                self.step()
                trim.worked()
            elif not (self.intake.busy or self.intake.num_waiting):
                trim.idle(time.monotonic())
            now = time.monotonic()
            if now - last_stats > STATS_INTERVAL_S:
                last_stats = now
                self._send_all(self.handoffs.expire())
                self.send(self.stats())
                if os.getppid() != self.parent_pid:
                    logger.error("parent process is gone; engine exiting")
                    break
        self.close()

    def close(self) -> None:
        self.handoffs.close()
        self.intake.close()
        self.input.close(linger=0)
        self.output.close()
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmserve.runtime.loop")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--input-addr", required=True)
    parser.add_argument("--output-addr", required=True)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s engine: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # The API server owns shutdown: it sends ShutdownReq or SIGTERM; Ctrl-C in the terminal reaches the whole
    # process group, so the engine ignores SIGINT and lets the server stop it in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The cluster secret comes through the environment: argv is visible to every user of the machine.
    secret = resolve_secret(None)
    try:
        engine = Engine(engine_config_from_json(args.config))
    except (ValueError, OSError) as e:  # a model it cannot run, a budget that holds nothing: say so, once
        logger.error("cannot start: %s", e)
        _tell_start_failure(args.output_addr, str(e))
        return 1
    loop = EngineLoop(engine, args.input_addr, args.output_addr, secret)
    signal.signal(signal.SIGTERM, lambda *_: setattr(loop, "running", False))
    loop.run()
    return 0


def _tell_start_failure(output_addr: str, message: str) -> None:
    """An ErrorMsg without a request id to the API server, which waits for ReadyMsg: its start-up ends with this
    message (one line) instead of "exited with code 1"."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)  # delivered before the process exits
    sock.connect(output_addr)
    sock.send(msgspec.msgpack.encode(m.ErrorMsg("", m.Failure(500, "engine_start_failed", message))))
    sock.close()
    ctx.term()


if __name__ == "__main__":
    from mmserve.fast_exit import exit_now

    exit_now(main())
