"""Leave a server process without the interpreter's teardown.

Once a process has closed what it owns (sockets, engines, child processes), finalising every module of
torch and transformers still takes 0.5-1.2 s per process on a two-core machine, on every stop: a server
with its engine spends ~2 s of its stop there. Like multiprocessing's children, mmserve's processes flush
their logs and streams and leave with `os._exit`. Shared memory here is memfd (freed by the kernel with the
last descriptor), so nothing is left behind that an exit handler would have cleaned up.

Only the `python -m` entry points use this, never `main()` called in-process (tests, embedding users).
"""

from __future__ import annotations

import logging
import os
import sys


def exit_now(code: int) -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to save
            pass
    os._exit(code)
