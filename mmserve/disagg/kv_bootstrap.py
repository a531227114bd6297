"""Decode side of the handoff: the bootstrap socket where prefill engines hand requests over.

A ROUTER on ``tcp://HOST:PORT``, polled by the engine loop (which alone touches the engine, so every slot
moves on that one thread). A room meets two parties, in either order: the prefill engine's Reserve/Commit
(mmserve.disagg.kv_messages) and the API server's AdoptReq (the router sent the client's request to both
servers). A committed request whose AdoptReq has not come yet waits, parked, holding its slots.

Ownership: a reservation's slots (KV, and the state slot of a hybrid model) belong to its `_Room` until the
commit hands them to the adopted request (`Engine.adopt`); every other ending (Cancel, abort by the API server,
deadline, bad commit, shutdown) gives them back with `Engine.unreserve`. Each room has one deadline: the
AdoptReq's timeout while the prefill server works, then `kv_transfer_timeout_s` from the reservation to the
commit, and again from the commit to the AdoptReq; the API server's side gets a 504 when it passes.

Admission: a reservation is granted only if the request fits to its last token beside everything running and
reserved (`outstanding_growth`), so decoding never has to retract an adopted request, which could not be
recomputed here. Otherwise the prefill engine is told 503 `decode_at_capacity` and the router tries elsewhere.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from mmserve.disagg import kv_messages as k
from mmserve.engine.cache.transfer import HandoffSlots
from mmserve.engine.engine import Engine
from mmserve.engine.request import Request
from mmserve.engine.token_checks import check_token_params
from mmserve.transport import messages as m
from mmserve.transport.cluster_auth import ClusterSecret, PartRejected, PartVerifier

logger = logging.getLogger("mmserve.disagg")
PROMPT_TAIL_TOKENS = 8  # prompt tokens the decode server's detokenizer gets as context (it uses the last 5)


@dataclass
class _Room:
    deadline: float  # time.monotonic()
    expected: bool = False  # the API server's AdoptReq arrived
    peer: bytes | None = None  # ROUTER identity of the prefill engine
    held: HandoffSlots | None = None  # reserved (ours until adoption): KV, window rows, a hybrid's state slot
    total: int = 0
    request: Request | None = None  # committed, waiting for the AdoptReq
    accepted: list = field(default_factory=list)  # its first messages for the API server


class KvBootstrap:
    def __init__(
        self, engine: Engine, host: str, port: int, timeout_s: float, secret: ClusterSecret | None = None
    ) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted prefill engine keeps its identity
        if port:
            self.socket.bind(f"tcp://{host}:{port}")
        else:
            port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.verifier = PartVerifier(secret) if secret is not None else None
        self.secret = secret
        self.layout = k.cache_layout(engine.transfer)
        self.mooncake = None
        try:
            from mmserve.disagg.kv_mooncake import KvMooncake

            self.mooncake = KvMooncake(engine.transfer, host)
        except (ImportError, OSError, ValueError) as e:  # the zmq backend still works
            logger.warning("Mooncake KV backend unavailable on this decode engine: %s", e)
        self.rooms: dict[str, _Room] = {}
        self.handoffs = self.failures = self.bytes_received = 0

    @property
    def pollable(self) -> zmq.Socket:
        return self.socket

    @property
    def backends(self) -> list[str]:
        return ["zmq", "mooncake"] if self.mooncake is not None else ["zmq"]

    @property
    def num_pending(self) -> int:
        return len(self.rooms)

    # -- the prefill engines' side ----------------------------------------------------------------
    def drain(self) -> list:
        """Handle every waiting message; returns messages for the API server."""
        out: list = []
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            peer, body = frames[0], frames[1:]
            tag, room, version = k.protocol_version(body[0]) if body else (None, None, None)
            if tag == "reserve" and room is not None and version != k.KV_PROTOCOL_VERSION:
                failure = m.Failure(
                    400,
                    "kv_protocol_mismatch",
                    f"the prefill engine speaks KV handoff protocol version {version}, this decode engine "
                    f"{k.KV_PROTOCOL_VERSION}: run both from the same mmserve release",
                )
                self._end(room, failure, out)
                self._reply(peer, k.Refused(room, failure))
                continue
            try:
                msg = k.to_decode.decode(body[0])
                if self.verifier is not None:
                    self.verifier.check_fresh(self.verifier.check_mac(body), msg.sent_at)
            except (msgspec.DecodeError, IndexError) as e:
                logger.warning("dropped a malformed KV handoff message: %s", e)
                continue
            except PartRejected as e:
                logger.warning("dropped a KV handoff message: %s", e)
                continue
            if isinstance(msg, k.Reserve):
                reply = self._reserve(peer, msg)
                if isinstance(reply, k.Refused) and reply.failure.code != "duplicate_room":
                    # This room's KV will never come here: its API request ends now (503 lets the router,
                    # which retries elsewhere with a new room, tell a refusal from a failure).
                    self._end(msg.room, reply.failure, out)
                self._reply(peer, reply)
            elif not self._from_owner(
                msg.room, peer
            ):  # only the engine that reserved a room may fill or end it
                logger.warning("dropped a KV %s for room %s from another peer", type(msg).__name__, msg.room)
                if isinstance(msg, k.Commit):
                    self._reply(
                        peer, k.Refused(msg.room, m.Failure(409, "unknown_room", "not your reservation"))
                    )
            elif isinstance(msg, k.Commit):
                self._reply(peer, self._commit(msg, body[1] if len(body) > 1 else b"", out))
            elif isinstance(msg, k.Cancel):
                self._end(
                    msg.room,
                    m.Failure(
                        502, "kv_transfer_failed", f"the prefill engine cancelled the handoff ({msg.reason})"
                    ),
                    out,
                )

    def _from_owner(self, rid: str, peer: bytes) -> bool:
        room = self.rooms.get(rid)
        return room is None or room.peer is None or room.peer == peer

    def _reply(self, peer: bytes, msg) -> None:
        frames = [k.encoder.encode(msg), b""]
        if self.secret is not None:
            frames = self.secret.sign(frames)
        self.socket.send_multipart([peer, *frames])

    def _reserve(self, peer: bytes, msg: k.Reserve):
        def refuse(status: int, code: str, text: str) -> k.Refused:
            return k.Refused(msg.room, m.Failure(status, code, text))

        room = self.rooms.get(msg.room)
        if room is not None and room.peer is not None:
            return refuse(409, "duplicate_room", f"room {msg.room!r} already has a handoff")
        if msg.layout != self.layout:
            return refuse(
                400,
                "kv_layout_mismatch",
                f"the prefill engine's cache layout does not match this decode engine's "
                f"({msg.layout.difference(self.layout)}): the same model and dtype are needed",
            )
        if msg.backend not in self.backends:
            return refuse(
                400,
                "kv_backend_unavailable",
                f"this decode engine offers {self.backends}, not {msg.backend!r}",
            )
        engine = self.engine
        if msg.total > engine.max_request_tokens:
            # 503 like a full pool: another decode server (a bigger one) may take it; the router tries.
            return refuse(
                503,
                "decode_at_capacity",
                f"{msg.total} tokens (prompt + max_tokens) never fit this decode engine "
                f"({engine.max_request_tokens} tokens at most)",
            )
        pending = sum(r.total - r.held.slots.numel() for r in self.rooms.values() if r.held is not None)
        room_left = engine.handoff_room() - pending
        if msg.total > room_left:
            return refuse(
                503,
                "decode_at_capacity",
                f"decode engine has room for {max(room_left, 0)} more tokens; this request needs {msg.total}",
            )
        if msg.order and sorted(msg.order) != list(range(msg.rows)):
            return refuse(400, "bad_handoff", "the reservation's slot order is not a permutation of its rows")
        if msg.rows and msg.state != (engine.states is not None):
            message = "a hybrid model's handoff carries its linear-attention state, and only a hybrid model's does"
            return refuse(400, "bad_handoff", message)
        window_rows = min(msg.rows, engine.window - 1) if engine.window is not None else 0
        if msg.window_rows != window_rows:
            message = f"{msg.window_rows} sliding-window rows sent with {msg.rows} rows, {window_rows} expected"
            return refuse(400, "bad_handoff", message)
        held = engine.reserve(msg.rows, msg.state)
        if held is None:  # KV counted free above: short of state or window slots (or the accounting is wrong)
            return refuse(503, "decode_at_capacity", "decode engine could not reserve its cache slots")
        if msg.order:
            held.slots = held.slots.sort().values[torch.tensor(msg.order, dtype=torch.int64)]
        if room is None:
            room = self.rooms[msg.room] = _Room(0.0)
        # From here the transfer has kv_transfer_timeout_s to commit, however long the prefill queue was.
        room.deadline = time.monotonic() + self.timeout_s
        room.peer, room.held, room.total = peer, held, msg.total
        target = self.mooncake.target() if msg.backend == "mooncake" else None
        window = held.window_slots.tolist() if held.window_slots is not None else []
        return k.Reserved(msg.room, held.slots.tolist(), target, held.state_slot, window)

    def _commit(self, msg: k.Commit, payload, out: list):
        room = self.rooms.get(msg.room)
        if room is None or room.held is None or room.request is not None:
            return k.Refused(
                msg.room, m.Failure(409, "unknown_room", f"no reservation for room {msg.room!r}")
            )
        state = msg.state
        try:
            rows = room.held.slots.numel()
            if state.finish_reason is None and rows != len(state.prompt_ids):
                raise ValueError(f"{rows} rows reserved for a {len(state.prompt_ids)}-token prompt")
            # The first token is the next step's input, the params the sampler's: out of range (a prefill
            # server of another model), either would fail every request of that decode batch.
            vocab = self.engine.model_config.vocab_size
            if not 0 <= state.first_token < vocab:
                raise ValueError(f"first token {state.first_token} is outside the vocabulary [0, {vocab})")
            check_token_params(state.sampling, self.engine.model_config.vocab_size)
            transfer = self.engine.transfer
            if len(payload):  # zmq backend: the rows (and the state) ride on the commit
                data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                transfer.write(room.held, data)
            self.bytes_received += transfer.nbytes(room.held)
            room.request = _request(msg.room, state)
        except (ValueError, RuntimeError) as e:
            self._end(msg.room, m.Failure(502, "kv_transfer_failed", f"bad KV handoff: {e}"), out)
            return k.Refused(msg.room, m.Failure(400, "bad_handoff", str(e)))
        room.accepted = _first_messages(msg.room, state, self.engine.model_config.vocab_size)
        room.deadline = time.monotonic() + self.timeout_s  # parked until the API server's AdoptReq
        if room.expected:
            self._adopt(msg.room, out)
        return k.Committed(msg.room)

    # -- the API server's side --------------------------------------------------------------------
    def expect(self, request_id: str, timeout_s: float) -> list:
        """AdoptReq: the API server streams this room's tokens (a handoff may already be parked)."""
        room = self.rooms.get(request_id)
        if room is None:  # the prefill server is still encoding / queueing / prefilling: wait up to timeout_s
            room = self.rooms[request_id] = _Room(time.monotonic() + timeout_s)
        room.expected = True
        out: list = []
        if room.request is not None:
            self._adopt(request_id, out)
        return out

    def abort(self, request_id: str) -> None:
        self._end(request_id, None, [])

    def expire(self) -> list:
        out: list = []
        now = time.monotonic()
        for rid in [rid for rid, room in self.rooms.items() if room.deadline < now]:
            self._end(
                rid,
                m.Failure(
                    504, "kv_transfer_timeout", "the prefill server's KV handoff did not arrive in time"
                ),
                out,
            )
        return out

    def _adopt(self, rid: str, out: list) -> None:
        room = self.rooms.pop(rid)
        req = room.request
        out.extend(room.accepted)
        self.handoffs += 1
        if req.finished:  # the first token ended it: nothing to decode, nothing was reserved
            self.engine.unreserve(room.held)
            return
        try:
            self.engine.adopt(req, room.held)
        except ValueError as e:
            self.engine.unreserve(room.held)
            out[-len(room.accepted) :] = [m.ErrorMsg(rid, m.Failure(409, "duplicate_request", str(e)))]

    def _end(self, rid: str, failure: m.Failure | None, out: list) -> None:
        """Forget a room, giving back its reservation; with `failure`, count it and tell the waiting API request."""
        self.failures += failure is not None
        room = self.rooms.pop(rid, None)
        if room is None:
            return
        if room.held is not None:
            self.engine.unreserve(room.held)
        if failure is not None and room.expected:
            out.append(m.ErrorMsg(rid, failure))

    def close(self) -> None:
        for rid in list(self.rooms):
            self._end(rid, None, [])
        self.socket.close(0)
        self.ctx.term()
        if self.mooncake is not None:
            self.mooncake.close()


def _request(room: str, state: k.HandoffState) -> Request:
    generator = None
    if state.generator_state is not None:
        generator = torch.Generator()
        generator.set_state(torch.frombuffer(bytearray(state.generator_state), dtype=torch.uint8))
    req = Request(
        room,
        list(state.prompt_ids),
        state.sampling,
        rope_delta=state.rope_delta,
        generator=generator,
        recomputable=False,
    )
    req.append_output(state.first_token)
    req.num_cached_tokens = state.num_cached_tokens
    if state.finish_reason is not None:
        req.finish_reason = state.finish_reason
        req.status = req.status.FINISHED
    return req


def _first_messages(room: str, state: k.HandoffState, vocab_size: int) -> list:
    tail = [t for t in state.prompt_ids[-PROMPT_TAIL_TOKENS:] if t < vocab_size]  # items' pad values are no text
    accepted = m.AcceptedMsg(
        room,
        state.prompt_tokens,
        state.encode_s,
        state.mm_items,
        state.mm_cache_hits,
        list(state.encoded_by),
        prompt_tail=tail,
    )
    tokens = m.TokensMsg(
        room,
        [state.first_token],
        state.finish_reason,
        state.num_cached_tokens,
        state.queue_s,
        state.prefill_s,
        logprobs=[state.first_logprobs] if state.first_logprobs is not None else None,
        prompt_logprobs=state.prompt_logprobs,
        stop_reason=state.stop_reason,
        eos=state.finish_reason == "stop" and state.stopped_on_token,
    )
    return [accepted, tokens]
