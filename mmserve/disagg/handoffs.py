"""The engine loop's side of prefill-decode disaggregation, whatever the engine's role.

- prefill: a request that reaches its first token is detached by the engine (`StepOutput.handoff`); `start`
  builds its `HandoffState` and gives it to the `KvSender`; `drain` collects the outcomes, frees the
  request's slots (`Engine.end_handoff`) and tells the API server (`HandedOffMsg` or the error).
- decode: the `KvBootstrap` socket takes handoffs; `adopt` is the API server's AdoptReq.
- null (one server does both): nothing here does anything.
Every method runs on the engine loop's thread.
"""

from __future__ import annotations

import importlib.util
import time

from mmserve.disagg import kv_messages as k
from mmserve.engine.engine import Engine, StepOutput
from mmserve.engine.request import Request
from mmserve.transport import messages as m
from mmserve.transport.cluster_auth import ClusterSecret


class Handoffs:
    def __init__(self, engine: Engine, secret: ClusterSecret | None) -> None:
        cfg = engine.cfg
        self.engine = engine
        self.timeout_s = cfg.kv_transfer_timeout_s
        self.sender = self.bootstrap = None
        if cfg.disaggregation_mode == "prefill":
            from mmserve.disagg.kv_sender import KvSender

            self.sender = KvSender(engine.transfer, cfg.embedding_host, secret)
        elif cfg.disaggregation_mode == "decode":
            from mmserve.disagg.kv_bootstrap import KvBootstrap

            self.bootstrap = KvBootstrap(
                engine, cfg.embedding_host, cfg.kv_bootstrap_port, self.timeout_s, secret
            )
        self.in_flight: dict[str, Request] = {}  # prefill: detached requests whose KV is being sent
        self.handed_off = self.failures = self.kv_bytes = 0

    @property
    def bootstrap_endpoint(self) -> str | None:
        return self.bootstrap.endpoint if self.bootstrap is not None else None

    @property
    def backends(self) -> list[str]:
        if self.bootstrap is not None:
            return self.bootstrap.backends
        if self.sender is not None:
            return ["zmq", "mooncake"] if importlib.util.find_spec("mooncake") is not None else ["zmq"]
        return []

    @property
    def pollables(self) -> list:
        if self.sender is not None:
            return [self.sender.results]
        if self.bootstrap is not None:
            return [self.bootstrap.pollable]
        return []

    # -- prefill ------------------------------------------------------------------------------------
    def start(self, out: StepOutput) -> None:
        req = out.request
        acc = req.accepted
        queue_s = req.first_scheduled_time - req.arrival_time
        state = k.HandoffState(
            prompt_ids=list(req.prompt_ids),
            first_token=out.token_id,
            finish_reason=out.finish_reason,
            sampling=req.params,
            rope_delta=req.rope_delta,
            generator_state=bytes(req.generator.get_state().numpy()) if req.generator is not None else None,
            prompt_tokens=req.prompt_len,
            num_cached_tokens=req.num_cached_tokens,
            queue_s=queue_s,
            prefill_s=req.first_token_time - req.first_scheduled_time,
            encode_s=acc.encode_s if acc else 0.0,
            mm_items=acc.mm_items if acc else 0,
            mm_cache_hits=acc.mm_cache_hits if acc else 0,
            encoded_by=list(acc.encoded_by) if acc else [],
            stop_reason=req.stop_reason,
            stopped_on_token=req.stopped_on_token,
            first_logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs,
        )
        from mmserve.disagg.kv_sender import HandoffJob

        cache = self.engine.handoff_cache(req)
        self.in_flight[req.request_id] = req
        deadline = time.monotonic() + self.timeout_s
        self.sender.submit(HandoffJob(req.request_id, req.handoff, state, cache, deadline))

    def drain(self) -> list:
        if self.bootstrap is not None:
            return self.bootstrap.drain()
        out: list = []
        if self.sender is None:
            return out
        while (result := self.sender.results.get(0)) is not None:
            req = self.in_flight.pop(result.request_id, None)
            self.sender.forget(result.request_id)
            if req is None:
                continue
            self.engine.end_handoff(req, result.failure is None)
            if result.failure is not None:
                self.failures += 1
                out.append(m.ErrorMsg(req.request_id, result.failure))
                continue
            self.handed_off += 1
            self.kv_bytes += result.kv_bytes
            out.append(
                m.HandedOffMsg(
                    req.request_id,
                    req.output_ids[0],
                    result.kv_bytes,
                    result.transfer_s,
                    req.num_cached_tokens,
                    req.first_scheduled_time - req.arrival_time,
                    req.first_token_time - req.first_scheduled_time,
                )
            )
        return out

    # -- decode -------------------------------------------------------------------------------------
    def adopt(self, msg: m.AdoptReq) -> list:
        if self.bootstrap is None:
            failure = m.Failure(400, "not_a_decode_server", "this engine is not a decode engine")
            return [m.ErrorMsg(msg.request_id, failure)]
        return self.bootstrap.expect(msg.request_id, msg.timeout_s)

    def expire(self) -> list:
        return self.bootstrap.expire() if self.bootstrap is not None else []

    # -- both ---------------------------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        if self.bootstrap is not None:
            self.bootstrap.abort(request_id)
        if self.sender is not None and request_id in self.in_flight:
            self.sender.cancel(request_id)  # its job stops and reports; the slots are freed then

    def stats(self) -> dict[str, int]:
        if self.bootstrap is not None:
            b = self.bootstrap
            return {
                "kv_handoffs": b.handoffs,
                "kv_handoff_failures": b.failures,
                "kv_bytes": b.bytes_received,
                "kv_pending": b.num_pending,
            }
        return {
            "kv_handoffs": self.handed_off,
            "kv_handoff_failures": self.failures,
            "kv_bytes": self.kv_bytes,
            "kv_pending": len(self.in_flight),
        }

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.bootstrap is not None:
            self.bootstrap.close()
