"""The prefill -> decode handoff protocol: typed msgpack messages on one ZMQ DEALER -> ROUTER channel.

The decode engine binds a ROUTER (its *bootstrap*, ``tcp://HOST:PORT``); a prefill engine connects one DEALER
per decode engine it hands requests to. Per request (a *room*, named by the router):

    P: Reserve(version, room, layout, rows, total, state) -> D: Reserved(slots, state slot, mooncake target)
                                                          | Refused(failure)
    P: writes the KV rows and the state into them (Mooncake), or attaches them to the commit (ZMQ)
    P: Commit(room, state) [+ rows]  -> D: Committed | Refused
    P: Cancel(room)                  (abort or timeout on the prefill side; no answer)

Frames: ``[message, payload, mac]``; payload is the raw KV rows (every plane), then for sliding-window models
the window rows (every plane of the window pool), then for hybrid models the linear layers' state, of a ZMQ
commit, else empty; mac is present only with a cluster secret (HMAC over message
and payload, mmserve.transport.cluster_auth). Nothing here can carry code: msgspec decodes only these tagged
structs. A Reserve's `version` is read before its schema (`protocol_version`): a peer speaking another version
is refused with an error naming both, not left waiting on a message it cannot decode.
"""

from __future__ import annotations

import msgspec

from mmserve.logprobs import TokenLogprobs
from mmserve.sampling_params import SamplingParams
from mmserve.transport.messages import Failure, KvTarget  # noqa: F401 (KvTarget: re-exported)

BACKENDS = ("zmq", "mooncake")
# 2: per-kind cache layouts (KV rows only for layers that have them, linear-attention state with them)
# 3: sliding-window layers' rows in a pool of their own: only the prompt's last W - 1 travel
KV_PROTOCOL_VERSION = 3


class CacheLayout(msgspec.Struct, frozen=True):
    """Both engines must agree on this, or the bytes would be read as something else: the dtype and what each
    decoder layer keeps (`LayerSpec.describe()`: attention rows of a shape, or a linear layer's state)."""

    dtype: str
    layers: list[str]

    def difference(self, other: CacheLayout) -> str:
        """The first way `other` differs from this layout, in words."""
        for i, (a, b) in enumerate(zip(self.layers, other.layers, strict=False)):
            if a != b:
                return f"layer {i} is {b} here, {a} at the peer"
        if len(self.layers) != len(other.layers):
            return f"{len(other.layers)} layers here, {len(self.layers)} at the peer"
        if self.dtype != other.dtype:  # the model's dtype, or `--kv-cache-dtype`
            return f"dtype {other.dtype} here, {self.dtype} at the peer"
        return "no difference"


def cache_layout(transfer) -> CacheLayout:
    """The layout of an engine's cache (its `CacheTransfer`)."""
    return CacheLayout(str(transfer.dtype), list(transfer.layout))


class Plane(msgspec.Struct, frozen=True, array_like=True):
    offset: int  # bytes from the region's address
    row_bytes: int


class MooncakeRegion(msgspec.Struct, frozen=True):
    """A registered allocation of the decode engine: row r of plane i is at
    ``address + planes[i].offset + r * planes[i].row_bytes``."""

    address: int
    num_rows: int
    planes: list[Plane]


class MooncakeTarget(msgspec.Struct, frozen=True):
    """Where the prefill engine writes: the decode engine's KV pool, (hybrid models) its state pool and
    (sliding-window models) its window pool."""

    session: str  # "host:rpc_port" of the decode engine's transfer engine
    kv: MooncakeRegion
    state: MooncakeRegion | None = None
    window: MooncakeRegion | None = None


class HandoffState(msgspec.Struct, frozen=True):
    """Everything the decode engine needs to continue as if it had prefilled the request itself."""

    prompt_ids: list[int]  # expanded (items' tokens carry their pad values)
    first_token: int
    finish_reason: str | None  # set when the first token already ends the request (no KV then)
    sampling: SamplingParams  # as resolved by the prefill engine (max_tokens never None)
    rope_delta: int  # decode position of index i: i + rope_delta
    generator_state: bytes | None  # the seeded generator after the first sample (None: unseeded)
    prompt_tokens: int
    num_cached_tokens: int
    queue_s: float
    prefill_s: float
    encode_s: float
    mm_items: int
    mm_cache_hits: int
    encoded_by: list[str]
    stop_reason: int | None = None  # the first token is a stop token id
    stopped_on_token: bool = False  # ... or EOS: not part of the text
    first_logprobs: TokenLogprobs | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class Reserve(msgspec.Struct, tag="reserve"):
    version: int  # KV_PROTOCOL_VERSION, checked before the rest is decoded (`protocol_version`)
    room: str
    rows: int  # KV rows that will be written (the prompt; 0 when the first token ends the request)
    total: int  # prompt + max_tokens: the decode engine admits only what it can carry to the end
    layout: CacheLayout
    backend: str
    sent_at: float
    state: bool = False  # a linear-attention state comes with the rows (hybrid models): reserve a state slot
    window_rows: int = 0  # sliding-window rows that come too (the prompt's last W - 1): reserve window slots
    # Rank of each row's source slot among the prefill engine's slots: the decode engine orders its reserved
    # slots the same way, so rows consecutive at the source land consecutive too (one Mooncake segment).
    order: list[int] = []


class Commit(msgspec.Struct, tag="commit"):
    room: str
    state: HandoffState
    sent_at: float


class Cancel(msgspec.Struct, tag="cancel"):
    room: str
    reason: str
    sent_at: float


class Reserved(msgspec.Struct, tag="reserved"):
    room: str
    slots: list[int]
    mooncake: MooncakeTarget | None = None  # set when the reservation asked for the mooncake backend
    state_slot: int | None = None  # set when the reservation asked for a state
    window_slots: list[int] = []  # one per window row asked for


class Committed(msgspec.Struct, tag="committed"):
    room: str


class Refused(msgspec.Struct, tag="refused"):
    room: str
    failure: Failure


ToDecode = Reserve | Commit | Cancel
FromDecode = Reserved | Committed | Refused

encoder = msgspec.msgpack.Encoder()
to_decode = msgspec.msgpack.Decoder(ToDecode)
from_decode = msgspec.msgpack.Decoder(FromDecode)


def protocol_version(body: bytes) -> tuple[str | None, str | None, object]:
    """(tag, room, version) of a message to the decode engine, read without its schema; Nones when the bytes are
    no msgpack map (then decoding will say what is wrong)."""
    try:
        raw = msgspec.msgpack.decode(body)
    except msgspec.DecodeError:
        return None, None, None
    if not isinstance(raw, dict):
        return None, None, None
    room = raw.get("room")
    return raw.get("type"), room if isinstance(room, str) else None, raw.get("version")
