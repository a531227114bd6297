"""Child servers that stop with the process that started them.

`serve --encoder-workers` and the P/D pipeline start servers as subprocesses and stop them on exit; if the
parent is SIGKILLed it cannot, so each child started with `child_of_this_process` watches its parent itself
(`MMSERVE_PARENT_PID`) and shuts down cleanly when it is gone, as the engine process does for its API server.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

logger = logging.getLogger("mmserve.server")
PARENT_ENV = "MMSERVE_PARENT_PID"


def child_of_this_process(env: dict[str, str]) -> dict[str, str]:
    """`env` for a child that must not outlive this process."""
    return {**env, PARENT_ENV: str(os.getpid())}


async def exit_with_parent(on_gone: Callable[[], None], interval_s: float = 0.5) -> None:
    """Call `on_gone` once the parent named by MMSERVE_PARENT_PID is gone (returns at once without it)."""
    value = os.environ.get(PARENT_ENV)
    if not value or not value.isdigit():
        return
    while os.getppid() == int(value):
        await asyncio.sleep(interval_s)
    logger.error("the process that started this server (pid %s) is gone; shutting down", value)
    on_gone()
