"""The radix prefix cache's invariants, checked: `RadixCache.check_integrity` (every engine test ends with it).
Reads the tree's internals; mutates nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mmserve.engine.cache.prefix_cache import empty_slots

if TYPE_CHECKING:
    from mmserve.engine.cache.radix_cache import RadixCache


def check_tree(cache: RadixCache) -> None:
    """Raise AssertionError if the tree's structure, counters, pool references, states or window rows are
    inconsistent."""
    root = cache._root
    assert root.parent is None and not root.key and root.slots.numel() == 0, "malformed root"
    assert root.state is None, "the root holds a state"
    total = evictable = 0
    parts: list[torch.Tensor] = []
    leaves: set = set()
    stateful: list = []
    windows: list[torch.Tensor] = []
    stack = [root]
    while stack:
        node = stack.pop()
        assert node.lock_ref >= 0, f"negative lock_ref {node.lock_ref}"
        child_locks = sum(c.lock_ref for c in node.children.values())
        assert node.lock_ref >= child_locks, f"lock_ref {node.lock_ref} < children's {child_locks}"
        assert node.last_access <= cache._clock, "last_access in the future"
        for first, child in node.children.items():
            assert child.parent is node, "child's parent pointer is wrong"
            assert len(child.key) == child.slots.numel() > 0, "key/slots length mismatch or empty"
            assert child.key[0] == first, f"child keyed by {first} starts with {child.key[0]}"
            assert child.slots.dtype == torch.int64 and child.slots.dim() == 1, "slots not 1-D int64"
            stack.append(child)
        if node is root:
            continue
        total += len(node.key)
        evictable += len(node.key) if node.lock_ref == 0 else 0
        parts.append(node.slots)
        if cache.window_pool is not None:
            assert node.wslots is not None and node.wslots.numel() == len(node.key), (
                "window rows misaligned"
            )
            held = node.wslots[node.wslots >= 0]
            assert held.numel() == node.wcount, (
                f"node counts {node.wcount} window rows, holds {held.numel()}"
            )
            windows.append(held)
        if node.state is not None:
            stateful.append(node)
        if not node.children:
            leaves.add(node)
            assert not cache._trimmable(node), "an unlocked leaf without a state (tombstone)"
    assert total == cache._total_tokens, f"total_tokens {cache._total_tokens} but tree holds {total}"
    assert evictable == cache._evictable_tokens, f"evictable {cache._evictable_tokens}, actual {evictable}"
    assert leaves == set(cache._leaves), "leaf set out of sync with the tree"
    stored = torch.cat([empty_slots(), *parts])
    assert torch.unique(stored).numel() == stored.numel(), "a slot appears twice in the tree"
    assert bool((cache.pool.refcount(stored) >= 1).all()), "tree holds a slot with refcount 0"
    if cache.window_pool is not None:
        held = torch.cat([empty_slots(), *windows])
        assert held.numel() == cache._window_rows, (
            f"window_rows {cache._window_rows}, tree holds {held.numel()}"
        )
        assert torch.unique(held).numel() == held.numel(), "a window slot appears twice in the tree"
        assert bool((cache.window_pool.refcount(held) >= 1).all()), (
            "tree holds a window slot with refcount 0"
        )
    assert set(stateful) == set(cache._stateful), "stateful node set out of sync with the tree"
    states = [n.state for n in stateful]
    assert len(set(states)) == len(states), "a state slot appears twice in the tree"
    if states:
        assert cache.states is not None and bool(cache.states._used[torch.tensor(states)].all()), (
            "tree holds a free state slot"
        )
