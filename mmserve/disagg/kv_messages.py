"""The prefill -> decode handoff protocol: typed msgpack messages on one ZMQ DEALER -> ROUTER channel.

The decode engine binds a ROUTER (its *bootstrap*, ``tcp://HOST:PORT``); a prefill engine connects one DEALER
per decode engine it hands requests to. Per request (a *room*, named by the router):

    P: Reserve(room, rows, total)    -> D: Reserved(slots, mooncake target) | Refused(failure)
    P: writes the KV rows into those slots (Mooncake), or attaches them to the commit (ZMQ)
    P: Commit(room, state) [+ rows]  -> D: Committed | Refused
    P: Cancel(room)                  (abort or timeout on the prefill side; no answer)

Frames: ``[message, payload, mac]``; payload is the raw KV rows of a ZMQ commit, else empty; mac is present
only with a cluster secret (HMAC over message and payload, mmserve.transport.cluster_auth). Nothing here can
carry code: msgspec decodes only these tagged structs.
"""

from __future__ import annotations

import msgspec

from mmserve.engine.logprobs import TokenLogprobs
from mmserve.engine.sampling_params import SamplingParams
from mmserve.transport.messages import Failure, KvTarget  # noqa: F401 (KvTarget: re-exported)

BACKENDS = ("zmq", "mooncake")


class KvLayout(msgspec.Struct, frozen=True):
    """Both pools must agree on this, or the rows would be read as something else."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str


class MooncakeTarget(msgspec.Struct, frozen=True):
    """The decode pool as Mooncake addresses it: row (kv, layer, slot) is at
    ``address + ((kv * num_layers + layer) * num_slots + slot) * row_bytes``."""

    session: str  # "host:rpc_port" of the decode engine's transfer engine
    address: int
    num_slots: int
    row_bytes: int


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
    room: str
    rows: int  # KV rows that will be written (the prompt; 0 when the first token ends the request)
    total: int  # prompt + max_tokens: the decode engine admits only what it can carry to the end
    layout: KvLayout
    backend: str
    sent_at: float
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
