"""Engine process main: ZMQ in, scheduler loop, ZMQ out.

Started by the API server as `python -m mmserve.engine.loop --config JSON` (an explicit JSON config, never
a pickled object). Sockets: PULL on `input_addr` for ToEngine messages, PUSH on `output_addr` for
FromEngine messages.

Media encoding runs on a worker thread so the scheduler keeps stepping while an image is fetched and
encoded; finished encodes are handed back through a queue and admitted by the loop thread, which alone
touches the engine. The loop exits when told to, or when its parent process is gone (no orphans).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import msgspec
import zmq

from mmserve.config import EngineConfig, MediaConfig
from mmserve.encoder.runner import EncodeTimings
from mmserve.engine.engine import Engine
from mmserve.engine.kv_pool import KVPool
from mmserve.engine.sampling_params import SamplingParams
from mmserve.models.loader import parse_dtype
from mmserve.multimodal.errors import MediaError
from mmserve.multimodal.items import Modality
from mmserve.multimodal.media import MediaRef
from mmserve.transport import messages as m

logger = logging.getLogger("mmserve.engine")
STATS_INTERVAL_S = 0.25
IDLE_POLL_MS = 20


def engine_config_to_json(cfg: EngineConfig) -> str:
    return json.dumps(asdict(cfg))


def engine_config_from_json(text: str) -> EngineConfig:
    raw = json.loads(text)
    media = raw.pop("media")
    media["allowed_media_domains"] = tuple(media.get("allowed_media_domains") or ())
    raw["mm_processor_kwargs"] = tuple(tuple(kv) for kv in raw.get("mm_processor_kwargs") or ())
    return EngineConfig(media=MediaConfig(**media), **raw)


def _media(req: m.GenerateReq) -> list[tuple[Modality, MediaRef]]:
    out = []
    for item in req.media:
        ref = MediaRef.from_bytes(item.data) if item.data is not None else MediaRef.parse(item.url or "")
        out.append((Modality(item.modality), ref))
    return out


class EngineLoop:
    def __init__(self, engine: Engine, input_addr: str, output_addr: str) -> None:
        self.engine = engine
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(input_addr)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.LINGER, 1000)
        self.output.connect(output_addr)
        self.decoder = msgspec.msgpack.Decoder(m.ToEngine)
        self.encoder = msgspec.msgpack.Encoder()
        self.encode_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mm-encode")
        self.encoded: queue.Queue = queue.Queue()  # (GenerateReq, encoded items | MsgError, timings)
        self.encoding: set[str] = set()  # request ids whose media is being encoded
        self.aborted_while_encoding: set[str] = set()
        self.encode_seconds_total = 0.0
        self.parent_pid = os.getppid()
        self.running = True

    def send(self, msg) -> None:
        self.output.send(self.encoder.encode(msg))

    # -- inputs -------------------------------------------------------------------------------------
    def handle(self, msg) -> None:
        if isinstance(msg, m.GenerateReq):
            self.encoding.add(msg.request_id)
            self.encode_pool.submit(self._encode, msg)
        elif isinstance(msg, m.AbortReq):
            if msg.request_id in self.encoding:
                self.aborted_while_encoding.add(msg.request_id)
            self.engine.abort(msg.request_id)
        elif isinstance(msg, m.PingReq):
            self.send(self.stats(msg.nonce))
        elif isinstance(msg, m.ShutdownReq):
            self.running = False

    def _encode(self, req: m.GenerateReq) -> None:
        """Worker thread: fetch + encode media (cache by content hash). Never touches the scheduler."""
        timings = EncodeTimings()
        try:
            encoded = self.engine.encode(_media(req), timings)
        except MediaError as e:
            self.encoded.put((req, m.ErrorMsg(req.request_id, e.status, e.code, str(e)), timings))
            return
        except Exception as e:  # a bug or a tower failure: the request fails loudly, the engine lives on
            logger.exception("encoding failed for %s", req.request_id)
            self.encoded.put(
                (req, m.ErrorMsg(req.request_id, 500, "encode_failed", f"encoding failed: {e}"), timings)
            )
            return
        self.encoded.put((req, encoded, timings))

    def admit_encoded(self) -> None:
        while True:
            try:
                req, encoded, timings = self.encoded.get_nowait()
            except queue.Empty:
                return
            self.encoding.discard(req.request_id)
            self.encode_seconds_total += timings.fetch_s + timings.compute_s
            if req.request_id in self.aborted_while_encoding:
                self.aborted_while_encoding.discard(req.request_id)
                continue
            if isinstance(encoded, m.ErrorMsg):
                self.send(encoded)
                continue
            try:
                s = req.sampling
                max_tokens = s.max_tokens
                if max_tokens is None:  # the rest of the context, as far as the KV cache can hold it
                    prompt_len = len(req.prompt_token_ids) - len(encoded) + sum(e.num_tokens for e in encoded)
                    limit = min(self.engine.model_config.max_model_len, self.engine.pool.num_slots)
                    max_tokens = max(1, limit - prompt_len)
                params = SamplingParams(
                    max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                    seed=s.seed, stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
                )  # fmt: skip
                engine_req = self.engine.add_request(req.request_id, list(req.prompt_token_ids), params,
                                                     encoded=encoded)  # fmt: skip
            except ValueError as e:
                self.send(m.ErrorMsg(req.request_id, 400, "invalid_request", str(e)))
                continue
            engine_req.encode_timings = timings
            self.send(m.AcceptedMsg(req.request_id, engine_req.prompt_len, timings.fetch_s + timings.compute_s,
                                    len(encoded), timings.hits))  # fmt: skip

    # -- outputs ------------------------------------------------------------------------------------
    def step(self) -> None:
        for out in self.engine.step():
            req = out.request_id
            msg = m.TokensMsg(req, [out.token_id] if out.token_id is not None else [], out.finish_reason)
            r = out.request
            msg.num_cached_tokens = r.num_cached_tokens
            if len(r.output_ids) == 1:  # first token: report where the time went
                msg.queue_s = r.first_scheduled_time - r.arrival_time
                msg.prefill_s = r.first_token_time - r.first_scheduled_time
            self.send(msg)

    def stats(self, nonce: int = 0) -> m.StatsMsg:
        e = self.engine
        cache = e.encoder.cache.stats
        return m.StatsMsg(
            num_running=len(e.scheduler.running), num_waiting=len(e.scheduler.waiting) + len(self.encoding),
            kv_cache_usage=e.pool.usage, prefix_cache_queries=e.scheduler.stats.prefix_queries_tokens,
            prefix_cache_hits=e.scheduler.stats.prefix_hit_tokens, mm_cache_queries=cache.queries,
            mm_cache_hits=cache.hits, encode_seconds_total=self.encode_seconds_total, nonce=nonce,
        )  # fmt: skip

    def run(self) -> None:
        cfg, mc = self.engine.cfg, self.engine.model_config
        per_token = KVPool.bytes_per_token(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, parse_dtype(cfg.dtype)
        )
        pool = self.engine.pool
        self.send(
            m.ReadyMsg(
                m.SCHEMA_VERSION, mc.max_model_len, pool.num_slots, pool.num_slots * per_token, per_token
            )
        )
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        last_stats = 0.0
        while self.running:
            busy = self.engine.has_work or not self.encoded.empty()
            events = dict(poller.poll(0 if busy else IDLE_POLL_MS))
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
            self.admit_encoded()
            if self.engine.has_work:
                self.step()
            now = time.monotonic()
            if now - last_stats > STATS_INTERVAL_S:
                last_stats = now
                self.send(self.stats())
                if os.getppid() != self.parent_pid:
                    logger.error("parent process is gone; engine exiting")
                    break
        self.close()

    def close(self) -> None:
        self.encode_pool.shutdown(wait=False, cancel_futures=True)
        self.input.close(linger=0)
        self.output.close()
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmserve.engine.loop")
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
    loop = EngineLoop(Engine(engine_config_from_json(args.config)), args.input_addr, args.output_addr)
    signal.signal(signal.SIGTERM, lambda *_: setattr(loop, "running", False))
    loop.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
