"""When to restart a child process that died, and when to stop trying (a crash loop).

Pure bookkeeping: the caller passes the time, so that the policy is tested without processes or clocks.
Used by mmserve.server.encoder_workers, one `RestartBackoff` per worker.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 0.5  # the wait before the first restart; doubled after each exit that follows
    max_delay_s: float = 30.0
    # A child that exits this many times within `window_s` crash-loops (a bad model path, a port taken, a
    # tower that fails at start): restarting it again would only burn CPU, so it is given up.
    max_exits: int = 5
    window_s: float = 60.0  # also how long a child must stay healthy for its next exit to start over at 0.5 s

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ValueError("need 0 < first_delay_s <= max_delay_s")
        if self.max_exits < 1 or self.window_s <= 0:
            raise ValueError("need max_exits >= 1 and window_s > 0")


class RestartBackoff:
    """One child's restarts. `exited(now)` -> seconds to wait before restarting it, or None: it crash-loops,
    give up. `healthy(now)`: the restarted child answers again (a long healthy run resets the backoff).

    | exits so far, without a healthy run of window_s between | delay               |
    |---------------------------------------------------------|---------------------|
    | 1, 2, 3, ...                                            | 0.5, 1, 2, ... 30 s |
    | max_exits within window_s                               | None (given up)     |
    """

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.exits: deque[float] = deque()  # times of the exits within the last window_s
        self.consecutive = 0  # exits since the last healthy run of window_s
        self.healthy_since: float | None = None

    def exited(self, now: float) -> float | None:
        p = self.policy
        self.exits.append(now)
        while now - self.exits[0] > p.window_s:
            self.exits.popleft()
        if len(self.exits) >= p.max_exits:
            return None
        if self.healthy_since is not None and now - self.healthy_since >= p.window_s:
            self.consecutive = 0  # it ran well for a while: this exit is news, not a loop
        self.healthy_since = None
        self.consecutive += 1
        return min(p.max_delay_s, p.first_delay_s * 2 ** (self.consecutive - 1))

    def healthy(self, now: float) -> None:
        self.healthy_since = now
