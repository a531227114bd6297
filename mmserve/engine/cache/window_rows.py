"""Window rows in the radix prefix cache (models with sliding-window layers, whose rows live in a window pool of
their own and are freed once no window can read them): a node holds, beside its full-attention slots, one window
slot per token, -1 where that row was freed (a *window tombstone*); the tree owns one window-pool reference per
slot it holds.

| rule                         | why                                                                        |
| a hit ends at the deepest point p whose W - 1 window rows before it are all held (or all rows from 0 held) | the next token's window reads them (`resume_point`) |
| an insert takes the caller's window rows where the tree holds none (`revive_rows`) | a later request may resume there |
| rows are freed least recently used first when the window pool is short: an unlocked leaf goes whole, any other node keeps its full rows (`drop_rows`) | window rows have their own pool |

The functions mutate the rows and the pool's refcounts they are given; the tree keeps its counts.
"""

from __future__ import annotations

import torch

from mmserve.engine.cache.kv_pool import KVPool


def resume_point(rows: torch.Tensor, window: int) -> int:
    """The longest prefix of a matched path (its window slots `rows`, -1 where freed) a request can resume after:
    the end of a run of held rows at least W - 1 long, or of the run from the start."""
    freed = (rows < 0).nonzero().flatten().tolist()  # positions whose window row is gone
    end = rows.numel()
    for gap in reversed(freed):  # runs of held rows [gap + 1, end), right to left
        if end - (gap + 1) >= window - 1:
            return end
        end = gap
    return end  # the run from the start: nothing before it to read


def take_rows(pool: KVPool, rows: torch.Tensor) -> int:
    """The tree takes a reference on each held row of `rows`; returns how many."""
    held = rows[rows >= 0]
    pool.ref(held)
    return held.numel()


def revive_rows(pool: KVPool, mine: torch.Tensor, theirs: torch.Tensor) -> int:
    """Where `mine` (a node's rows) has none and `theirs` (a caller's, of the same tokens) has one, take it;
    returns how many."""
    revive = (mine < 0) & (theirs >= 0)
    if not bool(revive.any()):
        return 0
    pool.ref(theirs[revive])
    mine[revive] = theirs[revive]
    return int(revive.sum())


def drop_rows(pool: KVPool, rows: torch.Tensor) -> int:
    """Free every held row of `rows` (a node's: they become -1); returns how many."""
    held = rows >= 0
    pool.free(rows[held])
    rows[held] = -1
    return int(held.sum())
