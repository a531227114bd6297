"""How requests enter the engine: media encoded by the local encoder, or embedding parts from encoders.

The intake owns the engine process's local encoder (a peer of the engine: None with --language-only), the
embedding receivers (one per transport the engine offers: mmserve.transport.channel) and the part
assembler. Monolithic requests (`num_parts == 0`) are encoded on a worker
thread by the local encoder. EPD requests wait in the `PartAssembler` for their parts, pushed by encoders to
the embedding socket (or produced here when the dispatcher asks for a local failover encode). Either way the
loop thread admits the request with `Engine.add_request(..., items)`, the one entrance shared by all modes,
which validates every item against the model family first (an embedding from an encoder serving another
model ends only its own request). Every outcome is a message for the API server (AcceptedMsg or ErrorMsg),
returned by `drain`.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from mmserve.encoder.runner import EncodeTimings, MediaInput, MultimodalEncoder
from mmserve.engine.engine import Engine
from mmserve.models.family import EmbeddingMismatch
from mmserve.multimodal.errors import EncoderUnavailableError, MediaError
from mmserve.multimodal.items import ItemEmbedding, Modality
from mmserve.multimodal.media import MediaRef
from mmserve.multimodal.precomputed import merge, merge_prefix, to_encode
from mmserve.omp_pools import released
from mmserve.runtime.receiver import Complete, Failed, PartAssembler, Progress
from mmserve.transport import messages as m
from mmserve.transport.channel import PartReceiver
from mmserve.transport.cluster_auth import PartRejected
from mmserve.transport.embedding_wire import WIRE_VERSION, EmbeddingItem, PartHeader, WireError
from mmserve.transport.messages import Failure

logger = logging.getLogger("mmserve.engine")
IN_PROCESS = "engine (in-process)"
LOCAL_FAILOVER = "local (failover)"
MEDIA_WORKERS = 4


def media_inputs(items: list[m.MediaItemMsg], cache_salt: str | None) -> list[MediaInput]:
    return [
        MediaInput(Modality(it.modality), _ref(it), it.settings, cache_salt, it.uuid, it.options)
        for it in items
    ]


def _ref(item: m.MediaItemMsg) -> MediaRef | None:
    """None: a reference by uuid (the encoder refuses an item with neither media nor uuid)."""
    if item.data is not None:
        return MediaRef.from_bytes(item.data)
    return None if item.url is None else MediaRef.parse(item.url)


@dataclass
class _RequestEncoded:
    """A worker thread encoded a monolithic request's media (or failed to)."""

    request_id: str
    result: list[ItemEmbedding] | Failure
    timings: EncodeTimings


@dataclass
class _ItemsEncoded:
    """A worker thread encoded a monolithic request's first items, not yet all (encode-prefill overlap)."""

    request_id: str
    items: list[ItemEmbedding]


@dataclass
class _PartEncoded:
    """A worker thread encoded one EPD part locally (dispatcher failover), as if an encoder had sent it."""

    header: PartHeader
    items: list[EmbeddingItem]


_WorkerResult = _RequestEncoded | _ItemsEncoded | _PartEncoded


class Intake:
    def __init__(
        self,
        engine: Engine,
        encoder: MultimodalEncoder | None,
        receivers: Sequence[PartReceiver] = (),
    ) -> None:
        self.engine = engine
        self.encoder = encoder
        self.receivers = list(receivers)  # owned: closed with the intake
        self.assembler = PartAssembler()
        # Several workers so that one slow download (up to --media-fetch-timeout-s) does not hold up every
        # other request's media; the tower itself stays serialized behind the encoder's TowerBatcher.
        self.pool = ThreadPoolExecutor(max_workers=MEDIA_WORKERS, thread_name_prefix="mm-encode")
        self.done: queue.Queue[_WorkerResult] = queue.Queue()  # for the loop thread
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
        self._progress(req.request_id, [])  # its text before the first item, while the media encode / travel
        if req.num_parts == 0:
            if to_encode(req.media) and self.encoder is None:
                self.requests.pop(req.request_id)
                error = EncoderUnavailableError(
                    "no encoder is available for this request and this engine has no tower"
                )
                return [m.ErrorMsg(req.request_id, error.failure)]
            self.pool.submit(self._encode_request, req)
            return []
        modalities = [it.modality for it in to_encode(req.media)]  # parts carry only these (not precomputed)
        return self._outcomes(self.assembler.expect(req.request_id, modalities, req.num_parts,
                                                    self.engine.cfg.encode_timeout_s))  # fmt: skip

    def local_encode(self, msg: m.LocalEncodeReq) -> None:
        entry = self.requests.get(msg.request_id)
        if entry is not None and self.encoder is not None:
            self.pool.submit(self._encode_part, entry[0], msg)

    def fail(self, msg: m.FailReq) -> list:
        self.assembler.cancel(msg.request_id)
        if self.requests.pop(msg.request_id, None) is None:
            return []
        self.engine.overlap.drop(msg.request_id)  # its overlap stages, if any
        return [m.ErrorMsg(msg.request_id, msg.failure)]

    def abort(self, request_id: str) -> None:
        self.assembler.cancel(request_id)
        self.requests.pop(request_id, None)  # a worker result for it is dropped in drain

    # -- worker threads -----------------------------------------------------------------------------
    def _encode(
        self, media: list[MediaInput], timings: EncodeTimings, what: str, on_item=None
    ) -> list[ItemEmbedding] | Failure:
        if not media:  # text only: nothing to encode (and maybe no local encoder at all)
            return []
        try:
            return self.encoder.encode_all(media, timings, self.engine.cfg.max_mm_pixels_per_prompt, on_item)
        except MediaError as e:
            return e.failure
        except Exception as e:  # a bug or a tower failure: the request fails loudly, the engine lives on
            logger.exception("encoding failed for %s", what)
            return Failure(500, "encode_failed", f"encoding failed: {e}")

    # Each worker hands back its OpenMP pool when done: kept, it would slow every decode step (omp_pools.py).
    @released
    def _encode_request(self, req: m.GenerateReq) -> None:
        timings = EncodeTimings()
        rid = req.request_id
        on_item = (lambda items: self.done.put(_ItemsEncoded(rid, items))) if self._overlaps(req) else None
        result = self._encode(media_inputs(to_encode(req.media), req.cache_salt), timings, rid, on_item)
        self.done.put(_RequestEncoded(rid, result, timings))

    @released
    def _encode_part(self, req: m.GenerateReq, msg: m.LocalEncodeReq) -> None:
        media = media_inputs([to_encode(req.media)[i] for i in msg.item_indices], req.cache_salt)
        result = self._encode(media, EncodeTimings(), f"{msg.request_id} part {msg.part_index}")
        failed = isinstance(result, Failure)
        items = [] if failed else [EmbeddingItem(i, e) for i, e in zip(msg.item_indices, result, strict=True)]
        header = PartHeader(
            WIRE_VERSION,
            msg.request_id,
            msg.part_index,
            msg.num_parts,
            LOCAL_FAILOVER,
            [],
            error=result if failed else None,
        )
        self.done.put(_PartEncoded(header, items))

    # -- loop thread --------------------------------------------------------------------------------
    def drain(self) -> list:
        """Admit whatever is ready; returns messages for the API server."""
        out = []
        for receiver in self.receivers:
            out += self._receive(receiver)
        while True:  # worker-thread results
            try:
                done = self.done.get_nowait()
            except queue.Empty:
                break
            if isinstance(done, _PartEncoded):
                out += self._outcomes(self.assembler.add(done.header, done.items))
            elif isinstance(done, _ItemsEncoded):
                self._progress(done.request_id, done.items)
            elif done.request_id in self.requests:
                self.encode_seconds_total += done.timings.total_s
                out += self._admit(done.request_id, done.result, done.timings, [IN_PROCESS])
        return out + self._outcomes(self.assembler.expire())

    def _receive(self, receiver: PartReceiver) -> list:
        """Every part waiting at one transport (encoder pushes)."""
        out = []
        while True:
            try:
                part = receiver.recv_part(0)
            except PartRejected as e:
                self.parts_rejected[e.reason] += 1
                logger.warning("dropped an embedding part failing authentication: %s", e)
                continue
            except WireError as e:
                self.parts_malformed += 1
                logger.warning("dropped a malformed embedding part: %s", e)
                continue
            if part is None:
                return out
            out += self._outcomes(self.assembler.add(*part))

    @property
    def held_bytes(self) -> int:
        """Bytes of transport pools (shm, Mooncake) that tensors of requests here still view."""
        stats = [r.stats() for r in self.receivers]
        return int(sum(v for s in stats for k, v in s.items() if k.endswith("_held_bytes")))

    def _overlaps(self, req: m.GenerateReq) -> bool:
        """Whether the request's prompt is prefilled in stages while its media encode: it has media to
        encode, and somebody to encode them (prompt logprobs need the whole prompt in one request)."""
        encodes = to_encode(req.media) and (req.num_parts > 0 or self.encoder is not None)
        return bool(
            self.engine.cfg.encode_prefill_overlap and encodes and req.sampling.prompt_logprobs is None
        )

    def _progress(self, rid: str, encoded: list[ItemEmbedding]) -> None:
        """The request's first `encoded` items (of those to encode) are here: prefill its prompt up to the
        next item still missing (mmserve.engine.overlap)."""
        entry = self.requests.get(rid)
        if entry is None or not self._overlaps(entry[0]):
            return
        req = entry[0]
        try:
            items = merge_prefix(req.media, encoded)
        except (ValueError, MediaError):  # a bad precomputed item: its admission will say so
            return
        self.engine.overlap.prefill_before(rid, list(req.prompt_token_ids), items, req.cache_salt)

    def _outcomes(self, outcomes: list[Complete | Progress | Failed]) -> list:
        out = []
        for o in outcomes:
            if isinstance(o, Progress):
                self._progress(o.request_id, o.items)
                continue
            if isinstance(o, Failed):
                if self.requests.pop(o.request_id, None) is not None:
                    self.engine.overlap.drop(o.request_id)  # its overlap stages, if any
                    out.append(m.ErrorMsg(o.request_id, o.failure))
                continue
            encoders = sorted(set(o.encoders))
            out += self._admit(
                o.request_id, o.items, None, encoders, o.cache_hits, o.item_encoders, o.transfer_s
            )
        return out

    def _admit(
        self,
        rid: str,
        result: list[ItemEmbedding] | Failure,
        timings: EncodeTimings | None,
        encoded_by: list[str],
        part_hits: int = 0,
        item_encoders: list[str] | None = None,  # EPD: per item to encode; else all `encoded_by[0]`
        transfer_s: float = 0.0,
    ) -> list:
        entry = self.requests.pop(rid, None)
        if entry is None:  # aborted meanwhile
            return []
        req, arrived = entry
        if isinstance(result, Failure):
            self.engine.overlap.drop(rid)  # its overlap stages, if any
            return [m.ErrorMsg(rid, result)]
        try:
            items = merge(req.media, result)  # the client's precomputed embeddings back in prompt order
            engine_req = self.engine.add_request(
                rid,
                list(req.prompt_token_ids),
                req.sampling,
                items,
                cache_salt=req.cache_salt,
                handoff=req.handoff,
            )
        except EmbeddingMismatch as e:  # an encoder serving another model: this request only
            self.engine.overlap.drop(rid)  # its overlap stages, if any; likewise below
            sources = ", ".join(encoded_by)
            logger.warning("request %s: embedding from %s rejected: %s", rid, sources, e)
            message = f"{sources} sent an embedding that does not fit this model: {e}"
            return [m.ErrorMsg(rid, Failure(502, "bad_embedding", message))]
        except MediaError as e:  # per-request media limits
            self.engine.overlap.drop(rid)
            return [m.ErrorMsg(rid, e.failure)]
        except ValueError as e:
            self.engine.overlap.drop(rid)
            return [m.ErrorMsg(rid, Failure(400, "invalid_request", str(e)))]
        except Exception as e:  # a bug met by this request: it alone fails, as a failed batch does (loop.py)
            logger.exception("request %s: admission failed", rid)
            self.engine.abort(rid, "error")  # whatever it got to hold (its overlap stages too)
            self.engine.check_integrity()  # nothing half-admitted may stay behind: else crash, never corrupt
            return [m.ErrorMsg(rid, Failure(500, "internal_error", f"admission failed: {e}"))]
        engine_req.encode_timings = timings
        waited = time.perf_counter() - arrived
        hits = timings.hits if timings is not None else part_hits
        per_item = item_encoders if item_encoders is not None else encoded_by[:1] * len(result)
        engine_req.accepted = m.AcceptedMsg(
            rid,
            engine_req.prompt_len,
            waited,
            len(items),
            hits,
            encoded_by,
            per_item,
            transfer_s,
            prompt_ids=engine_req.hf_prompt_ids if req.return_prompt_ids else None,
        )
        return [engine_req.accepted]

    def check_integrity(self) -> None:
        if self.encoder is not None:
            self.encoder.check_integrity()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for receiver in self.receivers:
            receiver.close()
        if self.encoder is not None:
            self.encoder.close()
