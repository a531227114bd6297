"""Hand decoded parts from a transport's receiver thread to the engine loop, which polls a file descriptor.

A receiver that does its work on a thread (the shared-memory and Mooncake transports) puts each outcome, a
decoded part or the error it raised, in a :class:`Handoff`; the engine loop's poller waits on ``fileno``
beside its ZMQ sockets. A pipe carries one byte per queued outcome, so the descriptor is readable exactly
while something waits.
"""

from __future__ import annotations

import contextlib
import os
import queue


class Handoff:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def fileno(self) -> int:
        return self._r

    def put(self, outcome) -> None:
        """From the receiver thread: a ``(header, items)`` pair, or an exception for the loop to raise."""
        self._queue.put(outcome)
        with contextlib.suppress(BlockingIOError):  # a full pipe is readable anyway; get() drains the queue
            os.write(self._w, b"p")

    def get(self, timeout_s: float):
        """The next outcome (raising it if it is an error), or None when nothing arrives in ``timeout_s``."""
        try:
            outcome = self._queue.get(timeout=timeout_s) if timeout_s > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None
        with contextlib.suppress(BlockingIOError):
            os.read(self._r, 1)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


def detached(error: BaseException) -> BaseException:
    """``error`` without its traceback and chained causes: their frames (and each frame's callers, through
    ``f_back``) would keep the receiver's local views, and so pool regions, alive while the error waits in a
    Handoff, and in a reference cycle even after."""
    error.__traceback__ = error.__cause__ = error.__context__ = None
    return error
