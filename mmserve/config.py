"""Frozen configuration dataclasses, built once (from the CLI or the Python API) and passed down.

Units are in the field names. Derived values are properties. Hugging Face config quirks are handled in
`ModelConfig.from_hf` only.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

# fp32's GEMM on a CPU (mmserve.engine.packed_linear): "mkl" is torch's own (F.linear), "onednn" packs the
# weights as for bf16, "auto" picks by the CPU's maker.
FP32_GEMMS = ("auto", "mkl", "onednn")


QUANTIZATIONS = ("int8", "int4")


def check_quantization(value: str | None) -> None:
    if value is not None and value not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {value!r}")


# The KV cache's storage (vLLM's `--kv-cache-dtype` names): "auto" is the model's dtype; "fp8" = "fp8_e4m3";
# "int8": codes with a scale per (token, KV head) row (mmserve.engine.cache.kv_dtype).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")


def check_kv_cache_dtype(value: str) -> None:
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {value!r}")


def check_fp32_gemm(value: str) -> None:
    if value not in FP32_GEMMS:
        raise ValueError(f"fp32_gemm must be one of {', '.join(FP32_GEMMS)}, not {value!r}")


@dataclass(frozen=True)
class MediaConfig:
    """Limits and policy for fetching and decoding client media.

    These guard the server: every limit is checked before the expensive step it protects (bytes before
    decoding, pixels before decompressing, frame count before decoding frames).
    """

    max_media_bytes: int = 32 * 1024 * 1024  # per item, after base64 decoding / download
    max_image_pixels: int = 16_777_216  # 4096 x 4096; larger declared sizes are refused (decompression bombs)
    max_image_aspect_ratio: float = 200.0  # the Qwen2-VL resize rule cannot handle more extreme shapes
    fetch_timeout_s: float = 10.0  # whole download, connect to last byte
    max_redirects: int = 5
    max_video_frames: int = 32  # frames kept after sampling
    video_fps: float | None = 2.0  # sampling rate; None samples max_video_frames uniformly
    max_video_seconds: float = 600.0  # declared duration above this is refused before decoding
    max_audio_seconds: float = 30.0
    audio_sample_rate_hz: int = 16_000
    # file:// references are only read below this directory (None: file:// refused).
    allowed_local_media_path: str | None = None
    # If non-empty, http(s) media may only come from these host names.
    allowed_media_domains: tuple[str, ...] = ()
    # Loopback / private / link-local / reserved destinations are refused unless this is set.
    allow_private_urls: bool = False
    # Narrower than allow_private_urls: these CIDR networks are allowed even though they are private
    # (e.g. an intranet media store at 10.20.0.0/16); every other refused class stays refused.
    allowed_media_networks: tuple[str, ...] = ()
    # Static host -> IP answers consulted before DNS (like curl --resolve): pins a media host to an address.
    # The address is still checked against the refused classes, so this cannot open a hole by itself.
    media_host_overrides: tuple[tuple[str, str], ...] = ()

    def hash_settings(self, modality: str) -> dict[str, object]:
        """The sampling settings that change what the model sees of an item of `modality` (the frames kept):
        they enter the content hash, so the same video bytes sampled to another frame count get another hash
        and pad value. Limits that only refuse media are not here; the audio rate is the family's (it
        hashes it with its feature settings)."""
        if modality == "video":
            return {"video_fps": self.video_fps, "max_video_frames": self.max_video_frames}
        return {}


@dataclass(frozen=True)
class EmbeddingStoreConfig:
    """`--embedding-store`: a global embedding store (mmserve.encoder.embedding_store) shared by every
    instance pointed at the same master, consulted after the local embedding cache and before the tower."""

    url: str  # mooncake://HOST:PORT, the Mooncake master's RPC address
    local_host: str = "127.0.0.1"  # where other instances reach this process's segment
    segment_mb: float = 512.0  # memory this process contributes to the store; its entries live there
    buffer_mb: float = 64.0  # this process's transfer buffer: bounds the size of one entry
    timeout_s: float = 1.0  # one get or put; past it the item is encoded locally (counted as an error)
    retry_s: float = 10.0  # after a failed setup or call, the store is left alone this long
    put_queue_items: int = 64  # entries waiting to be written in the background; more are dropped

    def __post_init__(self) -> None:
        from urllib.parse import urlsplit

        parts = urlsplit(self.url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.scheme or not parts.hostname or port is None or parts.path not in ("", "/"):
            raise ValueError(f"embedding store URL must look like mooncake://HOST:PORT, got {self.url!r}")
        for name in ("segment_mb", "buffer_mb", "timeout_s", "retry_s", "put_queue_items"):
            if getattr(self, name) <= 0:
                raise ValueError(f"embedding store {name} must be > 0")

    @property
    def scheme(self) -> str:
        return self.url.split("://", 1)[0]

    @property
    def address(self) -> str:
        """HOST:PORT of the master."""
        return self.url.split("://", 1)[1].rstrip("/")


@dataclass(frozen=True)
class ModelConfig:
    """What the serving code needs to know about a checkpoint, read once from its HF config."""

    model_path: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, model_path: str, hf_config, max_model_len: int | None = None) -> ModelConfig:
        from mmserve.models.layer_specs import head_shape

        text = hf_config.get_text_config()
        kv_heads, head_dim = head_shape(text, 0)  # the first layer's: layers may differ (the specs say how)
        eos = getattr(text, "eos_token_id", None) or getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else ((eos,) if eos is not None else ())
        return cls(
            model_path=model_path,
            model_type=hf_config.model_type,
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            num_layers=text.num_hidden_layers,
            num_heads=text.num_attention_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_model_len=min(max_model_len or text.max_position_embeddings, text.max_position_embeddings),
            eos_token_ids=eos_ids,
        )


@dataclass(frozen=True)
class EngineConfig:
    """Language-engine settings; field names mirror the CLI flags (`--max-num-batched-tokens` ...)."""

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048  # tokens computed per forward (prefill chunks + decodes)
    max_num_seqs: int = 64  # cap on running requests
    kv_cache_mb: float | None = (
        None  # KV pool budget; None: max_num_seqs x max_model_len tokens, capped below
    )
    kv_cache_memory_fraction: float = 0.2  # of the memory available at start: the default budget's cap
    # Hybrid models (linear-attention layers): the state pool, running requests' states and prefix-cache
    # checkpoints; None: 2 x max_num_seqs states, capped at kv_cache_memory_fraction of the memory available.
    state_cache_mb: float | None = None
    disable_prefix_cache: bool = False
    # Prefill a request's text before its first item while the item encodes (mmserve.engine.engine)
    encode_prefill_overlap: bool = True
    # bf16/fp16 on a CPU: linear weights packed once into oneDNN's layout (mmserve.engine.packed_linear)
    pack_weights: bool = True
    fp32_gemm: str = "auto"  # fp32 on a CPU: "mkl", "onednn" (packed), or auto (oneDNN on non-Intel x86)
    # Qwen2-shaped decoder layers run as fused layers with fewer ops (mmserve.engine.fused_layers)
    fuse_layers: bool = True
    # On a CPU: norms, RoPE and decode attention in mmserve's own kernels (mmserve.engine.cpu_kernels)
    cpu_kernels: bool = True
    # Weight-only quantization on load of a bf16/fp32 checkpoint (mmserve.quant.quantize): None, int8 or int4
    quantization: str | None = None
    quantize_lm_head: bool = True  # with `quantization`: lm_head too (False keeps it in the model dtype)
    quantize_tower: bool = False  # with `quantization`: the local tower's linear layers too
    # K and V rows stored in fp8 or int8 (mmserve.engine.cache.kv_dtype): about half bf16's bytes
    kv_cache_dtype: str = "auto"
    embedding_cache_mb: float = 512.0
    mm_processor_kwargs: tuple[tuple[str, object], ...] = ()
    media: MediaConfig = MediaConfig()
    language_only: bool = False  # load no vision weights; media must come from encoder services
    encode_timeout_s: float = 60.0  # a request waiting for embedding parts fails (504) after this
    # Per-request limits, checked when the request is admitted (after media expansion), in every mode.
    max_prompt_tokens: int | None = None  # prompt length with media tokens; None: the context length
    max_mm_pixels_per_prompt: int | None = None  # model-input pixels over all items (after resizing)
    # Transports the engine receives embedding parts on (mmserve.transport.channel): "tcp" always, "shm" for
    # encoders on this host, "mooncake" for Mooncake's transfer engine. Receivers bind on embedding_host.
    embedding_transports: tuple[str, ...] = ("tcp",)
    embedding_host: str = "127.0.0.1"
    mooncake_pool_mb: float = 256.0  # the engine's landing pool for Mooncake transfers
    embedding_store: EmbeddingStoreConfig | None = None  # global embedding store of the local encoder
    # Prefill-decode disaggregation (mmserve.disagg): "null" (both, one server), "prefill" or "decode".
    disaggregation_mode: str = "null"
    kv_transfer_timeout_s: float = 30.0  # every wait of a KV handoff (reserve, transfer, commit, adoption)
    kv_bootstrap_port: int = 0  # decode engine's handoff socket on embedding_host; 0: any free port

    def __post_init__(self) -> None:
        if self.disaggregation_mode not in ("null", "prefill", "decode"):
            raise ValueError("disaggregation_mode must be null, prefill or decode")
        check_fp32_gemm(self.fp32_gemm)
        check_quantization(self.quantization)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError("kv_transfer_timeout_s must be > 0")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.kv_cache_mb is not None and self.kv_cache_mb <= 0:
            raise ValueError("kv_cache_mb must be > 0")
        if self.state_cache_mb is not None and self.state_cache_mb <= 0:
            raise ValueError("state_cache_mb must be > 0")
        if not 0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError("kv_cache_memory_fraction must be in (0, 0.95]")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be >= 1")
        if self.max_mm_pixels_per_prompt is not None and self.max_mm_pixels_per_prompt < 1:
            raise ValueError("max_mm_pixels_per_prompt must be >= 1")


@dataclass(frozen=True)
class ServerConfig:
    """API server settings; names mirror `mmserve serve` flags."""

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.served_model_aliases)

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = ""
    # More names the model answers to (`--served-model-name A B C`: A is the name responses report).
    served_model_aliases: tuple[str, ...] = ()
    # Tool calling like vLLM's `--enable-auto-tool-choice --tool-call-parser NAME`: without the flag,
    # `tool_choice: "auto"` is a 400 (named and "required" choices are grammar-enforced and always allowed).
    enable_auto_tool_choice: bool = False
    # How the model writes tool calls (mmserve.server.tool_parsers.PARSERS). None: the model family's own
    # format when the chat template renders tools, else hermes (the format mmserve then writes tools in).
    tool_call_parser: str | None = None
    # vLLM's `--reasoning-parser` (mmserve.server.reasoning): a thinking model's reasoning goes into the chat
    # message's `reasoning` field, output constraints and tool calls apply to the answer after it. None: off.
    reasoning_parser: str | None = None
    api_key: str | None = None
    limit_mm_per_prompt: tuple[tuple[str, int], ...] = (("image", 8), ("video", 1), ("audio", 4))
    max_waiting_requests: int = 256  # beyond running + this many queued, new requests get 503
    max_request_body_bytes: int = 64 * 1024 * 1024
    # Refuse (400) chat / completion requests without a `cache_salt`, so that no request can share a cache
    # hit outside its tenant's scope (mmserve.engine.cache_salt).
    cache_salt_required: bool = False
    # Accept precomputed embeddings as content parts (`image_embeds` ...; mmserve.multimodal.precomputed). Off
    # by default: the client then chooses what the language model sees; every part is checked either way.
    enable_mm_embeds: bool = False
    max_mm_embeds_bytes: int = 32 * 1024 * 1024  # per precomputed item, decoded (set from --max-media-mb)
    engine_start_timeout_s: float = 600.0
    log_level: str = "info"
    log_stats_interval_s: float = 10.0  # the periodic one-line stats log (0: off)
    encoder_urls: tuple[str, ...] = ()  # static encoder services (EPD)
    encoder_workers: int = 0  # local encoder processes to spawn (EPD on one machine)
    encoder_routing: str = "cache_affinity"  # cache_affinity | round_robin | least_loaded
    encoder_probe_interval_s: float = 5.0
    encoder_probe_timeout_s: float = 2.0
    encoder_failure_threshold: int = 3
    encoder_drop_after_s: float = 300.0
    # How encoders send parts to this engine: "auto" (shared memory for --encoder-workers, tcp for the rest),
    # or one of "tcp", "shm" (every encoder on this host), "mooncake".
    encoder_transport: str = "auto"
    # Requests with fewer media items than this are encoded by the engine's own tower, when it has one: for
    # one small item the round trip to an encoder costs more than it saves (measured: docs/benchmarks.md).
    encoder_dispatch_min_items: int = 0
    # Shared with encoders (see mmserve.transport.cluster_auth). With it, the control plane
    # (/register_encoder, /unregister_encoder, /encoders) requires its token; without it, the control plane
    # is closed unless `enable_anonymous_registration`: anyone reaching the port could otherwise send other
    # users' media to an encoder of their choosing, or read the internal endpoints.
    cluster_secret: str | None = field(default=None, repr=False)
    enable_anonymous_registration: bool = False  # ignored when a cluster secret is set
    # Prefill-decode disaggregation (mmserve.disagg): "null" = this server prefills and decodes; "prefill" and
    # "decode" servers take requests only from `mmserve router` (with `kv_transfer_params`).
    disaggregation_mode: str = "null"
    kv_adopt_timeout_s: float = 300.0  # decode server: longest wait for a request's prefill and KV handoff
    disable_ui: bool = False  # no playground (/), dashboard (/dashboard) nor /ui/* (server/routes_ui.py)

    def __post_init__(self) -> None:
        from mmserve.server.tool_parsers import check_tool_call_parser

        check_tool_call_parser(self.tool_call_parser)
        # A prefill or decode server answers only the router, whose every handoff carries the cluster token:
        # without a secret that route is closed (403), so the server would come up healthy and serve nothing.
        p_or_d = self.disaggregation_mode != "null"
        if p_or_d and not self.cluster_secret and not self.anonymous_control_plane:
            raise ValueError(
                f"--disaggregation-mode {self.disaggregation_mode} needs a cluster secret: set --cluster-secret "
                "(or $MMSERVE_CLUSTER_SECRET) to the router's, or pass --enable-anonymous-registration on a "
                "trusted network; without either, every handoff from `mmserve router` would be refused (403)"
            )

    @property
    def mm_limits(self) -> dict[str, int]:
        return dict(self.limit_mm_per_prompt)

    @property
    def anonymous_control_plane(self) -> bool:
        """The control-plane routes answer callers without a token (no secret, and the operator opted in)."""
        return self.enable_anonymous_registration and not self.cluster_secret


@dataclass(frozen=True)
class EncoderConfig:
    """`mmserve encoder` settings: a standalone vision encoder service (vision weights only)."""

    model: str
    host: str = "127.0.0.1"
    port: int = 9000
    dtype: str = "float32"
    device: str = "cpu"
    max_batch_items: int = 8  # items fused into one tower forward
    max_batch_wait_ms: float = 5.0  # how long the first item of a batch waits for company
    max_pending: int = 64  # jobs queued or running; more get 503
    embedding_cache_mb: float = 1024.0
    pack_weights: bool = True  # bf16/fp16 on a CPU: the tower's linear weights in oneDNN's layout
    cpu_kernels: bool = True  # on a CPU: the Qwen-VL towers' vision RoPE in mmserve's kernel
    fp32_gemm: str = "auto"  # fp32 on a CPU: "mkl", "onednn" (packed), or auto (mmserve.engine.packed_linear)
    quantization: str | None = None  # the tower's linear layers quantized on load (int8 / int4), weight-only
    send_timeout_s: float = 5.0  # pushing a part to an engine
    shm_pool_mb: float = 256.0  # shared-memory pool per engine this encoder sends to (shm://)
    mooncake_pool_mb: float = 256.0  # staging pool registered with Mooncake's transfer engine (mooncake://)
    register_urls: tuple[str, ...] = ()  # language servers to register with (and heartbeat)
    register_interval_s: float = 5.0
    advertise_url: str | None = None  # the URL servers should call; default http://host:port
    mm_processor_kwargs: tuple[tuple[str, object], ...] = ()
    media: MediaConfig = MediaConfig()
    cluster_secret: str | None = field(default=None, repr=False)  # see mmserve.transport.cluster_auth
    embedding_store: EmbeddingStoreConfig | None = None  # global embedding store (after the cache)

    def __post_init__(self) -> None:
        check_fp32_gemm(self.fp32_gemm)
        check_quantization(self.quantization)

    @property
    def url(self) -> str:
        return self.advertise_url or f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class RouterConfig:
    """`mmserve router` settings: the OpenAI front of prefill and decode servers (mmserve.disagg.router)."""

    prefill_urls: tuple[str, ...] = ()  # static members; more may register at runtime
    decode_urls: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    kv_transfer_backend: str = "zmq"  # one of mmserve.disagg.kv_messages.BACKENDS, sent with every handoff
    # Shared with the servers (mmserve.transport.cluster_auth): the router sends its token to them and
    # requires it on its own control plane (/register_server, /unregister_server, /servers).
    cluster_secret: str | None = field(default=None, repr=False)
    enable_anonymous_registration: bool = False  # ignored when a cluster secret is set
    api_key: str | None = field(default=None, repr=False)  # required on /v1/*; never forwarded upstream
    served_model_name: str | None = None  # None: the model the servers report in /disagg/info
    request_timeout_s: float = 600.0  # bounds every wait on an upstream: a prefill, decode headers, each read
    connect_timeout_s: float = 2.0
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0  # one /health probe or /disagg/info fetch
    failure_threshold: int = 2  # consecutive failed probes or connects that make a server unhealthy
    max_attempts: int = 3  # rooms tried per request (decode at capacity, a server unreachable)
    prefill_load_factor: float = 1.25  # bounded-load rendezvous: no prefill server takes > this x the mean
    affinity_text_chars: int = 512  # prompt text that keys the prefill choice
    affinity_token_ids: int = 256  # token ids of a token prompt that key the prefill choice
    max_request_body_bytes: int = 64 * 1024 * 1024
    log_level: str = "info"

    def __post_init__(self) -> None:
        from mmserve.disagg.kv_messages import BACKENDS

        if self.kv_transfer_backend not in BACKENDS:
            raise ValueError(f"kv_transfer_backend {self.kv_transfer_backend!r} is not one of {BACKENDS}")
        seconds = ("request_timeout_s", "connect_timeout_s", "health_interval_s", "health_timeout_s")
        for name in (*seconds, "prefill_load_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        counts = ("failure_threshold", "max_attempts", "affinity_text_chars", "affinity_token_ids")
        for name in (*counts, "max_request_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @property
    def anonymous_control_plane(self) -> bool:
        """The control-plane routes answer callers without a token (no secret, and the operator opted in)."""
        return self.enable_anonymous_registration and not self.cluster_secret


# The engine process gets its config as JSON on its command line (never a pickle). These live here, not in the
# engine's module, so that the API server can spawn the engine before it imports torch.
def engine_config_to_json(cfg: EngineConfig) -> str:
    return json.dumps(asdict(cfg))


def engine_config_from_json(text: str) -> EngineConfig:
    raw = json.loads(text)
    media = raw.pop("media")
    media["allowed_media_domains"] = tuple(media.get("allowed_media_domains") or ())
    media["allowed_media_networks"] = tuple(media.get("allowed_media_networks") or ())
    media["media_host_overrides"] = tuple(tuple(kv) for kv in media.get("media_host_overrides") or ())
    raw["mm_processor_kwargs"] = tuple(tuple(kv) for kv in raw.get("mm_processor_kwargs") or ())
    raw["embedding_transports"] = tuple(raw.get("embedding_transports") or ("tcp",))
    store = raw.pop("embedding_store", None)
    raw["embedding_store"] = EmbeddingStoreConfig(**store) if store else None
    return EngineConfig(media=MediaConfig(**media), **raw)
