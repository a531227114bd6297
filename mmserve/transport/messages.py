"""API server <-> engine process messages: msgspec Structs encoded as msgpack (tagged unions).

One family per direction. Every message is a tagged Struct so a decoder rejects anything unknown instead of
guessing; nothing here can carry code (no pickle).
"""

from __future__ import annotations

from typing import Any

import msgspec

from mmserve.logprobs import TokenLogprobs
from mmserve.sampling_params import SamplingParams

SCHEMA_VERSION = 5


class Failure(msgspec.Struct, frozen=True):
    """Why something failed, as the client will see it: the one error shape on every boundary (engine
    messages, embedding parts, the receiver, the dispatcher); the API server turns it into an HTTP error."""

    status: int  # HTTP status: 400 bad media, 413 too large, 500 internal, 502/503/504 upstream trouble
    code: str
    message: str


class TensorData(msgspec.Struct, frozen=True):
    name: str  # "main" or an extra's name (e.g. "deepstack.0")
    dtype: str  # "float32" | "bfloat16" | "float16"
    shape: tuple[int, ...]
    data: bytes  # raw C-order bytes


class PrecomputedEmbedding(msgspec.Struct, frozen=True):
    """An item embedding the client supplied (--enable-mm-embeds), already checked against the model family
    by the API server (mmserve.multimodal.precomputed): the engine admits it as is; no encoder sees it."""

    content_hash: bytes  # 16 bytes
    metadata: bytes  # the family's
    tensors: list[TensorData]


class MediaItemMsg(msgspec.Struct, frozen=True):
    modality: str  # "image" | "video" | "audio"
    url: str | None = None  # http(s) / data: / file://
    data: bytes | None = None  # raw bytes given in-process
    # Per-item processing settings the model family derives from the whole request (e.g. LLaVA-OneVision
    # tiles an image only when it is the request's only image); they enter the item's content hash.
    settings: dict[str, Any] = {}
    embedding: PrecomputedEmbedding | None = None  # set: a precomputed item (no url / data)
    # The caller's identity for the item, hashed instead of its bytes; with no url / data, a reference to the
    # item encoded earlier with it (mmserve.multimodal.media_options).
    uuid: str | None = None
    options: dict[str, Any] = {}  # media options (detail, video sampling): they enter the content hash


class KvTarget(msgspec.Struct, frozen=True):
    """Where a prefill engine sends a request's KV (mmserve.disagg): chosen by the router."""

    room: str
    bootstrap: str  # the decode engine's handoff socket, tcp://HOST:PORT
    backend: str  # "zmq" | "mooncake"


# -- API server -> engine ------------------------------------------------------------------------
class GenerateReq(msgspec.Struct, tag="generate"):
    request_id: str
    prompt_token_ids: list[int]  # one placeholder token per media item
    media: list[MediaItemMsg]
    sampling: SamplingParams  # max_tokens None: up to the context length (and the KV capacity)
    num_parts: int = 0  # > 0: embeddings arrive from encoders in this many parts; 0: encode in-process
    # Tenant scope of the prefix cache and of every item's content hash (mmserve.engine.cache_salt).
    cache_salt: str | None = None
    # Prefill server: prefill, sample the first token, hand the request (KV and state) to this decode engine.
    handoff: KvTarget | None = None
    return_prompt_ids: bool = False  # the AcceptedMsg carries the expanded prompt (return_token_ids)


class AdoptReq(msgspec.Struct, tag="adopt"):
    """Decode server: this request (`request_id` = the router's room) arrives from a prefill engine; stream
    its tokens. It fails with 504 if the handoff has not arrived within `timeout_s`."""

    request_id: str
    timeout_s: float


class LocalEncodeReq(msgspec.Struct, tag="local_encode"):
    """Failover: encode one part of an EPD request with the engine's own (local) encoder."""

    request_id: str
    part_index: int
    num_parts: int
    item_indices: list[int]


class FailReq(msgspec.Struct, tag="fail"):
    """The dispatcher gave up on a request's encoding: end it with this error."""

    request_id: str
    failure: Failure


class AbortReq(msgspec.Struct, tag="abort"):
    request_id: str


class PingReq(msgspec.Struct, tag="ping"):
    nonce: int
    check_integrity: bool = False  # also verify the KV pool, prefix cache and embedding cache invariants


class ShutdownReq(msgspec.Struct, tag="shutdown"):
    pass


ToEngine = GenerateReq | AdoptReq | LocalEncodeReq | FailReq | AbortReq | PingReq | ShutdownReq


# -- engine -> API server ------------------------------------------------------------------------
class ReadyMsg(msgspec.Struct, tag="ready"):
    schema_version: int
    max_model_len: int
    kv_cache_tokens: int
    kv_cache_bytes: int
    kv_bytes_per_token: int
    embedding_endpoints: dict[str, str]  # transport scheme -> where encoders push embedding parts
    has_tower: bool  # the engine can encode media itself (monolithic / local failover)
    kv_bootstrap: str | None = (
        None  # decode engine: where prefill engines hand requests over (mmserve.disagg)
    )
    kv_backends: list[str] = []  # KV transfer backends this engine can use ("zmq", "mooncake")
    state_slots: int = 0  # a hybrid model's request states (running and prefix-cache checkpoints); 0: none
    state_cache_bytes: int = 0
    window_rows: int = 0  # sliding-window layers' rows (a pool of their own, freed behind the window); 0: none
    window_cache_bytes: int = 0
    window: int = 0


class AcceptedMsg(msgspec.Struct, tag="accepted"):
    """The request's media is encoded and it is queued: errors after this are engine errors."""

    request_id: str
    prompt_tokens: int  # expanded: image tokens counted
    encode_s: float
    mm_items: int
    mm_cache_hits: int
    encoded_by: list[str] = []  # "engine (in-process)", "local (failover)", or encoder URLs
    item_encoders: list[str] = []  # one of the above per media item the engine encoded or received, in order
    transfer_s: float = 0.0  # EPD: the last part's send to its arrival at the engine (part of encode_s)
    # Decode server: the prompt's last text tokens, the detokenizer's context (its API server renders no prompt)
    prompt_tail: list[int] = []
    prompt_ids: list[int] | None = None  # the expanded prompt, HF's ids, when the request asked for it


class TokensMsg(msgspec.Struct, tag="tokens"):
    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    queue_s: float = 0.0  # set on the first message of a request
    prefill_s: float = 0.0
    index: int = 0  # the choice (n > 1)
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the params ask for logprobs
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the first message, when asked for
    stop_reason: int | None = None  # the stop token id that ended the choice
    eos: bool = False  # the last token is EOS or a stop token id: not part of the text


class HandedOffMsg(msgspec.Struct, tag="handed_off"):
    """Prefill server: the request's KV and state reached its decode engine (the request ends here)."""

    request_id: str
    first_token: int
    kv_bytes: int
    transfer_s: float  # from the reservation to the decode engine's commit
    num_cached_tokens: int
    queue_s: float
    prefill_s: float


class ErrorMsg(msgspec.Struct, tag="error"):
    request_id: str
    failure: Failure


class StatsMsg(msgspec.Struct, tag="stats"):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int
    mm_cache_queries: int
    mm_cache_hits: int
    encode_seconds_total: float
    nonce: int = 0  # echo of a PingReq, 0 for periodic stats
    parts_received: int = 0
    parts_dropped: int = 0  # stale + unknown + invalid + duplicate + malformed + forged + replayed
    parts_forged: int = 0  # missing or wrong HMAC (cluster secret set)
    parts_replayed: int = 0  # valid HMAC seen before, or outside the freshness window
    kv_slots_used: int = 0
    transfer_held_bytes: int = (
        0  # transport pool bytes (shm, Mooncake) that tensors of live requests still view
    )
    num_preemptions: int = 0  # running requests retracted (KV freed, recomputed later) since start
    # The local encoder's global embedding store: StoreStats field -> value (mmserve.encoder.embedding_store);
    # empty without a store.
    embedding_store: dict[str, float] = {}
    kv_handoffs: int = 0  # requests handed to a decode engine (prefill) or adopted from one (decode)
    kv_handoff_failures: int = 0
    kv_bytes: int = 0  # KV bytes sent (prefill) or received (decode)
    kv_pending: int = 0  # handoffs in progress (their slots held)
    integrity_error: str | None = None  # set when a PingReq asked for a check and it failed ("" = passed)
    prefix_cache_tokens: int = 0  # tokens the prefix cache holds (kv_cache_usage counts only requests' slots)
    overlap_stages: int = 0  # encode-prefill overlap: prefill stages run while their request's media encoded
    overlap_tokens: int = 0  # ... and the prompt tokens they computed
    state_cache_usage: float = 0.0  # hybrid models: state pool slots in use (requests' and checkpoints'), 0..1
    state_checkpoints: int = 0  # ... of which prefix-cache checkpoints
    # Tokens per engine step since start: per-bucket counts (mmserve.engine.step_output.TokenHistogram), sum
    iteration_token_counts: list[int] = []
    iteration_tokens_sum: int = 0


FromEngine = ReadyMsg | AcceptedMsg | TokensMsg | HandedOffMsg | ErrorMsg | StatsMsg
