"""How requests enter the engine: media encoded in-process, or embedding parts received from encoders.

Monolithic requests (`num_parts == 0`) are encoded on a worker thread through the engine's own encoder.
EPD requests wait in the `PartAssembler` for their parts, pushed by encoders to the embedding socket (or
produced here when the dispatcher asks for a local failover encode). Either way the loop thread admits the
request with `Engine.add_request(encoded=...)`, the one path shared by all modes. Every outcome is a message
for the API server (AcceptedMsg or ErrorMsg), returned by `drain`.
"""

from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import ThreadPoolExecutor

from mmserve.encoder.runner import EncodedItem, EncodeTimings
from mmserve.engine.engine import Engine
from mmserve.engine.receiver import Complete, Failed, PartAssembler
from mmserve.engine.sampling_params import SamplingParams
from mmserve.multimodal.errors import MediaError
from mmserve.multimodal.items import Modality
from mmserve.multimodal.media import MediaRef
from mmserve.transport import messages as m
from mmserve.transport.cluster_auth import ClusterSecret, PartRejected, PartVerifier
from mmserve.transport.embedding_wire import WIRE_VERSION, EmbeddingItem, PartError, PartHeader, WireError
from mmserve.transport.zmq_channel import EmbeddingReceiver

logger = logging.getLogger("mmserve.engine")
IN_PROCESS = "engine (in-process)"
MEDIA_WORKERS = 4


def media_refs(items: list[m.MediaItemMsg]) -> list[tuple[Modality, MediaRef]]:
    return [(Modality(it.modality), MediaRef.from_bytes(it.data) if it.data is not None else MediaRef.parse(it.url or ""))
            for it in items]  # fmt: skip


class Intake:
    def __init__(
        self, engine: Engine, embedding_bind: str = "tcp://127.0.0.1:0", secret: ClusterSecret | None = None
    ) -> None:
        self.engine = engine
        self.receiver = EmbeddingReceiver(embedding_bind, verifier=PartVerifier(secret) if secret else None)
        self.assembler = PartAssembler()
        # Several workers so that one slow download (up to --media-fetch-timeout-s) does not hold up every
        # other request's media; the tower itself stays serialized behind the engine's TowerBatcher.
        self.pool = ThreadPoolExecutor(max_workers=MEDIA_WORKERS, thread_name_prefix="mm-encode")
        self.done: queue.Queue = (
            queue.Queue()
        )  # results of worker-thread encodes, consumed by the loop thread
        self.requests: dict[str, tuple[m.GenerateReq, float]] = {}  # waiting for media, with arrival time
        self.encode_seconds_total = 0.0
        self.parts_malformed = 0
        self.parts_rejected = {"forged": 0, "replayed": 0}  # failed cluster authentication

    @property
    def num_waiting(self) -> int:
        return len(self.requests)

    @property
    def busy(self) -> bool:
        """Worker-thread results are ready to be admitted."""
        return not self.done.empty()

    # -- inputs from the API server ---------------------------------------------------------------
    def generate(self, req: m.GenerateReq) -> list:
        self.requests[req.request_id] = (req, time.perf_counter())
        if req.num_parts == 0:
            self.pool.submit(self._encode_request, req)
            return []
        modalities = [it.modality for it in req.media]
        return self._outcomes(self.assembler.expect(req.request_id, modalities, req.num_parts,
                                                    self.engine.cfg.encode_timeout_s))  # fmt: skip

    def local_encode(self, msg: m.LocalEncodeReq) -> None:
        entry = self.requests.get(msg.request_id)
        if entry is not None:
            self.pool.submit(self._encode_part, entry[0], msg)

    def fail(self, msg: m.FailReq) -> list:
        self.assembler.cancel(msg.request_id)
        if self.requests.pop(msg.request_id, None) is None:
            return []
        return [m.ErrorMsg(msg.request_id, msg.status, msg.code, msg.message)]

    def abort(self, request_id: str) -> None:
        self.assembler.cancel(request_id)
        self.requests.pop(request_id, None)  # a worker result for it is dropped in drain

    # -- worker thread ------------------------------------------------------------------------------
    def _encode_request(self, req: m.GenerateReq) -> None:
        timings = EncodeTimings()
        try:
            result = self.engine.encode(media_refs(req.media), timings)
        except MediaError as e:
            result = m.ErrorMsg(req.request_id, e.status, e.code, str(e))
        except Exception as e:  # a bug or a tower failure: the request fails loudly, the engine lives on
            logger.exception("encoding failed for %s", req.request_id)
            result = m.ErrorMsg(req.request_id, 500, "encode_failed", f"encoding failed: {e}")
        self.done.put(("request", req.request_id, result, timings))

    def _encode_part(self, req: m.GenerateReq, msg: m.LocalEncodeReq) -> None:
        header = PartHeader(
            WIRE_VERSION, msg.request_id, msg.part_index, msg.num_parts, "local (failover)", []
        )
        try:
            refs = media_refs([req.media[i] for i in msg.item_indices])
            encoded = self.engine.encode(refs, EncodeTimings())
            items = [EmbeddingItem(i, e.content_hash, e.modality.value, e.grid_thw, e.second_per_grid_t, e.embedding)
                     for i, e in zip(msg.item_indices, encoded, strict=True)]  # fmt: skip
        except MediaError as e:
            header, items = (
                PartHeader(**{**_fields(header), "error": PartError(e.status, e.code, str(e))}),
                [],
            )
        except Exception as e:
            logger.exception("local encode failed for %s", msg.request_id)
            header, items = (
                PartHeader(**{**_fields(header), "error": PartError(500, "encode_failed", str(e))}),
                [],
            )
        self.done.put(("part", msg.request_id, (header, items), None))

    # -- loop thread --------------------------------------------------------------------------------
    def drain(self) -> list:
        """Admit whatever is ready; returns messages for the API server."""
        out = []
        while True:  # encoder pushes
            try:
                part = self.receiver.recv_part(0)
            except PartRejected as e:
                self.parts_rejected[e.reason] += 1
                logger.warning("dropped an embedding part failing authentication: %s", e)
                continue
            except WireError as e:
                self.parts_malformed += 1
                logger.warning("dropped a malformed embedding part: %s", e)
                continue
            if part is None:
                break
            out += self._outcomes(self.assembler.add(*part))
        while True:  # worker-thread results
            try:
                kind, rid, result, timings = self.done.get_nowait()
            except queue.Empty:
                break
            if kind == "part":
                out += self._outcomes(self.assembler.add(*result))
            elif rid in self.requests:
                self.encode_seconds_total += timings.total_s
                out += self._admit(rid, result, timings, [IN_PROCESS])
        return out + self._outcomes(self.assembler.expire())

    def _outcomes(self, outcomes: list[Complete | Failed]) -> list:
        out = []
        for o in outcomes:
            if isinstance(o, Failed):
                if self.requests.pop(o.request_id, None) is not None:
                    out.append(m.ErrorMsg(o.request_id, o.status, o.code, o.message))
                continue
            encoded = [EncodedItem(Modality(it.modality), it.content_hash, it.embedding, it.grid_thw, it.second_per_grid_t)
                       for it in o.items]  # fmt: skip
            bad = [e for e in encoded if self.engine.processor.num_tokens(e.grid_thw) != e.num_tokens]
            result = m.ErrorMsg(o.request_id, 502, "bad_embedding", "an encoder sent an embedding whose row count "
                                "does not match its grid") if bad else encoded  # fmt: skip
            out += self._admit(o.request_id, result, None, sorted(set(o.encoders)))
        return out

    def _admit(self, rid: str, result, timings: EncodeTimings | None, encoded_by: list[str]) -> list:
        entry = self.requests.pop(rid, None)
        if entry is None:  # aborted meanwhile
            return []
        req, arrived = entry
        if isinstance(result, m.ErrorMsg):
            return [result]
        s = req.sampling
        max_tokens = s.max_tokens
        if max_tokens is None:  # the rest of the context, as far as the KV cache can hold it
            prompt_len = len(req.prompt_token_ids) - len(result) + sum(e.num_tokens for e in result)
            limit = min(self.engine.model_config.max_model_len, self.engine.pool.num_slots)
            max_tokens = max(1, limit - prompt_len)
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                    min_p=s.min_p, seed=s.seed, stop_token_ids=list(s.stop_token_ids),
                                    ignore_eos=s.ignore_eos)  # fmt: skip
            engine_req = self.engine.add_request(rid, list(req.prompt_token_ids), params, encoded=result)
        except ValueError as e:
            return [m.ErrorMsg(rid, 400, "invalid_request", str(e))]
        except MediaError as e:  # per-request media limits
            return [m.ErrorMsg(rid, e.status, e.code, str(e))]
        engine_req.encode_timings = timings
        waited = time.perf_counter() - arrived
        hits = timings.hits if timings is not None else 0
        return [m.AcceptedMsg(rid, engine_req.prompt_len, waited, len(result), hits, encoded_by)]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.receiver.close()


def _fields(header: PartHeader) -> dict:
    return {f: getattr(header, f) for f in header.__struct_fields__}
