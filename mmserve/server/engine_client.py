"""The API server's side of the engine process: spawn it, talk to it over ZMQ, watch it.

Owns the engine subprocess and both sockets. Each in-flight request has one asyncio queue that receives the
engine's messages for it; when the engine process dies, every queue gets a 503 error at once and
`on_death` is called (the server then exits non-zero so a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq
import zmq.asyncio

from mmserve.config import EngineConfig, engine_config_to_json
from mmserve.transport import messages as m
from mmserve.transport.cluster_auth import child_env

logger = logging.getLogger("mmserve.server")


class EngineDeadError(RuntimeError):
    pass


class EngineClient:
    def __init__(self, cfg: EngineConfig, log_level: str = "info", on_death: Callable[[], None] | None = None,
                 cluster_secret: str | None = None):  # fmt: skip
        self.cfg = cfg
        self.cluster_secret = cluster_secret
        self.log_level = log_level
        self.on_death = on_death
        self.ctx = zmq.asyncio.Context()
        self._dir = tempfile.mkdtemp(prefix="mmserve-")
        self.input_addr = f"ipc://{self._dir}/engine-in"
        self.output_addr = f"ipc://{self._dir}/engine-out"
        self.to_engine = self.ctx.socket(zmq.PUSH)
        self.to_engine.setsockopt(zmq.LINGER, 0)
        self.to_engine.bind(self.input_addr)
        self.from_engine = self.ctx.socket(zmq.PULL)
        self.from_engine.bind(self.output_addr)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(m.FromEngine)
        self.proc: subprocess.Popen | None = None
        self.ready: m.ReadyMsg | None = None
        self.stats: m.StatsMsg | None = None
        self.dead = False
        self._queues: dict[str, asyncio.Queue] = {}
        self._pings: dict[int, asyncio.Future] = {}
        self._nonces = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    # -- lifecycle ----------------------------------------------------------------------------------
    def spawn(self) -> None:
        """Start the engine process (returns at once; `wait_ready` waits for its ReadyMsg)."""
        cmd = [sys.executable, "-m", "mmserve.runtime.loop", "--config", engine_config_to_json(self.cfg),
               "--input-addr", self.input_addr, "--output-addr", self.output_addr, "--log-level", self.log_level]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=child_env(self.cluster_secret))

    async def wait_ready(self, timeout_s: float = 600.0) -> m.ReadyMsg:
        assert self.proc is not None, "spawn() first"
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.ready is None:
            if self.proc.poll() is not None:
                raise EngineDeadError(
                    f"engine process exited with code {self.proc.returncode} during start-up"
                )
            if asyncio.get_running_loop().time() > deadline:
                raise EngineDeadError(f"engine did not become ready in {timeout_s}s")
            if await self.from_engine.poll(200):
                msg = self.decoder.decode(await self.from_engine.recv())
                if isinstance(msg, m.ReadyMsg):
                    self.ready = msg
                elif isinstance(msg, m.ErrorMsg) and not msg.request_id:  # the engine could not start
                    raise EngineDeadError(f"the engine cannot start: {msg.failure.message}")
        self._tasks = [asyncio.create_task(self._reader()), asyncio.create_task(self._watchdog())]
        return self.ready

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine process (politely, then SIGTERM, then SIGKILL) and free sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        # An engine still booting reads no messages until it is ready: it gets SIGTERM at once.
        if self.proc is not None and self.proc.poll() is None and self.ready is not None:
            try:
                await self.to_engine.send(self.encoder.encode(m.ShutdownReq()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            for _ in range(int(timeout_s * 10)):
                if self.proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.to_engine.close(0)
        self.from_engine.close(0)
        self.ctx.term()
        for name in ("engine-in", "engine-out"):
            try:
                os.unlink(os.path.join(self._dir, name))
            except FileNotFoundError:
                pass
        os.rmdir(self._dir)

    async def _reader(self) -> None:
        while True:
            raw = await self.from_engine.recv()
            try:
                msg = self.decoder.decode(raw)
            except msgspec.DecodeError:
                logger.warning("dropped an undecodable engine message")
                continue
            if isinstance(msg, m.StatsMsg):
                self.stats = msg
                future = self._pings.pop(msg.nonce, None)
                if future is not None and not future.done():
                    future.set_result(msg)
                continue
            queue = self._queues.get(getattr(msg, "request_id", ""))
            if queue is not None:
                queue.put_nowait(msg)

    async def _watchdog(self) -> None:
        while self.proc.poll() is None:
            await asyncio.sleep(0.2)
        self.dead = True
        logger.error("engine process died (exit code %s)", self.proc.returncode)
        self.fail_all(m.Failure(503, "engine_dead", "the engine process died; retry later"))
        if self.on_death is not None:
            self.on_death()

    def fail_all(self, failure: m.Failure) -> None:
        """Ends every request in flight with `failure` (engine death; server shutdown: streams end in-band)."""
        for rid, queue in list(self._queues.items()):
            queue.put_nowait(m.ErrorMsg(rid, failure))

    # -- requests -----------------------------------------------------------------------------------
    async def generate(
        self, req: m.GenerateReq | m.AdoptReq
    ) -> AsyncIterator[m.AcceptedMsg | m.TokensMsg | m.HandedOffMsg | m.ErrorMsg]:
        """Messages for one request until it finishes or fails. Closing the iterator early aborts it."""
        if self.dead:
            raise EngineDeadError("the engine process is not running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[req.request_id] = queue
        finished = False
        choices_left = req.sampling.n if isinstance(req, m.GenerateReq) else 1  # n > 1: each choice finishes
        try:
            await self.to_engine.send(self.encoder.encode(req))
            while True:
                msg = await queue.get()
                choices_left -= isinstance(msg, m.TokensMsg) and msg.finish_reason is not None
                finished = isinstance(msg, (m.ErrorMsg, m.HandedOffMsg)) or choices_left == 0
                yield msg
                if finished:
                    return
        finally:
            self._queues.pop(req.request_id, None)
            if not finished and not self.dead:
                await self.abort(req.request_id)

    async def send(self, msg) -> None:
        """Send any ToEngine message (dispatcher: local encode / fail)."""
        if not self.dead:
            await self.to_engine.send(self.encoder.encode(msg))

    async def abort(self, request_id: str) -> None:
        try:
            await self.to_engine.send(self.encoder.encode(m.AbortReq(request_id)), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            logger.warning("could not send abort for %s", request_id)

    async def ping(self, timeout_s: float = 2.0, check_integrity: bool = False) -> m.StatsMsg | None:
        """Round trip to the engine loop; None if it does not answer in time.

        With `check_integrity`, the engine also checks its pools and caches (`integrity_error` "" = passed)."""
        if self.dead:
            return None
        nonce = next(self._nonces)
        future = asyncio.get_running_loop().create_future()
        self._pings[nonce] = future
        await self.to_engine.send(self.encoder.encode(m.PingReq(nonce, check_integrity)))
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            return None
        finally:
            self._pings.pop(nonce, None)

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._queues
