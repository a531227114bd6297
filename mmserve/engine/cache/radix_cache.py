"""Token-level radix tree mapping token prefixes to KV slots (and, for hybrid models, state checkpoints), for
prefix caching.

Keys are int64 token ids, including image/video/audio pad values (hash-derived, up to 2**63 - 1), so two
prompts with the same text but different media diverge at the first differing pad value.

Ownership: the tree owns exactly one pool reference for each slot stored in it, taken in `insert` and
dropped in `evict`/`reset`. `match` takes no references: a caller that keeps the matched slots must
`pool.ref` them itself, and should `lock` the handle so the path cannot be evicted meanwhile.

State checkpoints (a tree built with a `StatePool`: models with linear-attention layers, whose KV alone cannot
resume a sequence). A node may own one state slot, the state after its last token; a node without one is a
*tombstone*, kept only as the KV of the path to deeper nodes.
| rule                         | why                                                                        |
| `match` ends at the deepest node with a state (the root: the empty state) | resuming needs the state there |
| `insert` always brings a state, the tree takes it: kept, or freed if the node has one already | no KV-only leaves |
| a split leaves the state on the lower node | the state belongs to the last token of the edge              |
| no unlocked leaf is a tombstone: removing a state from a leaf removes the leaf, then any parent it leaves a tombstone leaf; a locked one goes when its last lock does | KV nobody can resume from is freed |
| `evict_states` frees the least recently used states, locked nodes' too | states have their own budget; a running request copied its state at admission and needs no checkpoint |

Window rows (a tree built with a window pool: models with sliding-window layers): each node holds, beside its
full-attention slots, one window slot per token or -1 where that row was freed; the rules are window_rows.py's.

LRU timestamps come from a counter bumped once per `match`/`insert`, so eviction order is deterministic.
Not thread-safe: callers must hold the scheduler's lock (or be the scheduler thread) for every method.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence

import torch

from mmserve.engine.cache.kv_pool import KVPool
from mmserve.engine.cache.prefix_cache import (  # noqa: F401 (re-exported: the interface this cache implements)
    MatchResult,
    NoPrefixCache,
    PrefixCache,
    cat_slots,
    empty_slots,
)
from mmserve.engine.cache.radix_integrity import check_tree
from mmserve.engine.cache.state_pool import StatePool
from mmserve.engine.cache.window_rows import drop_rows, resume_point, revive_rows, take_rows


class _Node:
    __slots__ = ("key", "slots", "parent", "children", "lock_ref", "last_access", "state", "wslots", "wcount")

    def __init__(self, key: list[int], slots: torch.Tensor, parent: _Node | None, last_access: int) -> None:
        self.key = key
        self.slots = slots
        self.parent = parent  # None for the root and for evicted nodes
        self.children: dict[int, _Node] = {}
        self.lock_ref = 0
        self.last_access = last_access
        self.state: int | None = None  # state-checkpoint trees: the state after this node's last token
        self.wslots: torch.Tensor | None = None  # window trees: window slot per token, -1 where freed
        self.wcount = 0  # window slots held (entries >= 0 of wslots)


def _common_prefix_len(key: list[int], tokens: Sequence[int], start: int) -> int:
    n = min(len(key), len(tokens) - start)
    i = 0
    while i < n and key[i] == tokens[start + i]:
        i += 1
    return i


class RadixCache:
    """Radix tree of token prefixes over the slots of `pool` (and the checkpoints in `states`, when given); see
    the module docstring for ownership."""

    def __init__(
        self,
        pool: KVPool,
        states: StatePool | None = None,
        window_pool: KVPool | None = None,
        window: int | None = None,
    ) -> None:
        assert (window_pool is None) == (window is None), "a window pool comes with its window"
        assert states is None or window_pool is None, "state checkpoints and window rows are never both kept"
        self.pool = pool
        self.states = states
        self.keeps_states = states is not None
        self.window_pool = window_pool
        self.window = window
        self._clock = 0
        self._init_tree()

    def _init_tree(self) -> None:
        self._root = _Node([], empty_slots(), None, 0)
        # Insertion-ordered set of non-root childless nodes, so eviction need not walk the whole tree.
        self._leaves: dict[_Node, None] = {}
        self._stateful: dict[_Node, None] = {}  # nodes that own a state
        self._total_tokens = 0
        self._evictable_tokens = 0
        self._window_rows = 0

    @property
    def total_tokens(self) -> int:
        return self._total_tokens

    @property
    def evictable_tokens(self) -> int:
        return self._evictable_tokens

    @property
    def num_states(self) -> int:
        return len(self._stateful)

    @property
    def window_rows(self) -> int:
        """Window-pool slots the tree holds."""
        return self._window_rows

    def match(self, tokens: Sequence[int]) -> MatchResult:
        """Longest usable cached prefix of `tokens` (with states: the deepest node that has one). Takes no pool
        references.

        Mutates LRU times along the path, and splits an edge if the match ends inside it (so the handle is
        an exact node; never in a state tree, whose matches end at nodes); slot ownership is unchanged. Caller
        must hold the scheduler's lock.
        """
        if self.keeps_states:
            path = self._walk(tokens, stamp=True)
            depth = max((i for i, node in enumerate(path) if node.state is not None), default=-1)
            node = path[depth] if depth >= 0 else self._root
            parts = [n.slots for n in path[: depth + 1]]
            return MatchResult(cat_slots(parts), node, node.state)
        if self.window_pool is not None:
            tokens = tokens[: self._resumable(tokens)]
            node, _, parts = self._descend(tokens)
            wparts = [n.wslots for n in self._path(node)]
            return MatchResult(cat_slots(parts), node, window_slots=cat_slots(wparts))
        node, _, parts = self._descend(tokens)
        return MatchResult(slots=cat_slots(parts), handle=node)

    def _resumable(self, tokens: Sequence[int]) -> int:
        """Window trees: the longest prefix of `tokens` that is cached with the window rows its next token reads:
        the end of a run of held rows at least W - 1 long, or starting at 0. Changes nothing."""
        rows = [child.wslots[:common] for child, common in self._edges(tokens)]
        return resume_point(cat_slots(rows), self.window)

    def _path(self, node: _Node) -> list[_Node]:
        """The nodes from the root's child down to `node`."""
        path = []
        while node is not self._root:
            path.append(node)
            node = node.parent
        return path[::-1]

    def cached_len(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` a `match` would give, changing nothing (no split, no LRU stamp): a
        scheduling hint."""
        if self.keeps_states:
            matched = best = 0
            for node in self._walk(tokens, stamp=False):
                matched += len(node.key)
                if node.state is not None:
                    best = matched
            return best
        if self.window_pool is not None:
            return self._resumable(tokens)
        return sum(common for _, common in self._edges(tokens))

    def lock(self, handle: object) -> None:
        """Protect the path root..handle from eviction (one more lock on each node of it). `handle` must come
        from a `match` with no `evict` in between (or be locked already). Mutates lock counts; the caller owns the
        lock and must `unlock` it once. Caller must hold the scheduler's lock."""
        node = self._as_node(handle)
        assert node is self._root or node.parent is not None, "lock of an evicted handle"
        while node is not None:
            if node.lock_ref == 0:
                self._evictable_tokens -= len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: object) -> None:
        """Undo one `lock(handle)` held by the caller. Mutates lock counts; in a state tree, a tombstone leaf
        that this leaves unlocked is removed (and its KV freed)."""
        handle = node = self._as_node(handle)
        while node is not None:
            assert node.lock_ref > 0, "unlock without a matching lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_tokens += len(node.key)
            node = node.parent
        if self._trimmable(handle):
            self._remove_leaf(handle)

    def _trimmable(self, node: _Node) -> bool:
        """A state tree's unlocked tombstone leaf: KV nobody can resume from."""
        return (
            self.keeps_states
            and node is not self._root
            and node.parent is not None
            and node.state is None
            and not node.children
            and node.lock_ref == 0
        )

    def insert(
        self,
        tokens: Sequence[int],
        slots: torch.Tensor,
        state: int | None = None,
        window_slots: torch.Tensor | None = None,
    ) -> int:
        """Store `tokens -> slots` (and, in a state tree, `state`: the caller's state slot after the last token,
        which the tree takes over, keeping it or freeing it if that prefix has one already; in a window tree,
        `window_slots`: the caller's window rows, -1 where it holds none); returns the length of the prefix that
        was already present.

        For that prefix the tree keeps its own slots (the caller's are duplicates it still owns) and takes the
        caller's window rows only where it has none; for the rest the tree takes one reference on the caller's
        slots via `pool.ref` (and `window_pool.ref`). Mutates the tree, LRU times and pool refcounts. Caller must
        hold the scheduler's lock and own live references to `slots` and the held `window_slots`.
        """
        assert (state is not None) == self.keeps_states, "a state tree stores a state with every insert"
        assert (window_slots is not None) == (self.window_pool is not None), "a window tree takes window rows"
        slots = slots.to(device="cpu", dtype=torch.int64).reshape(-1)
        assert slots.numel() == len(tokens), f"{slots.numel()} slots for {len(tokens)} tokens"
        if not tokens:  # the root holds the empty state implicitly
            if state is not None:
                self.states.free(state)
            return 0
        node, matched, _ = self._descend(tokens)  # ends exactly at `matched` (an edge is split there)
        if window_slots is not None:
            window_slots = window_slots.to(device="cpu", dtype=torch.int64).reshape(-1)
            self._revive(node, window_slots[:matched])
        if matched < len(tokens):
            new_slots = slots[matched:].clone()
            self.pool.ref(new_slots)
            leaf = _Node(list(tokens[matched:]), new_slots, node, self._clock)
            if window_slots is not None:
                self._take_window_rows(leaf, window_slots[matched:].clone())
            node.children[leaf.key[0]] = leaf
            self._leaves.pop(node, None)
            self._leaves[leaf] = None
            self._total_tokens += len(leaf.key)
            self._evictable_tokens += len(leaf.key)  # unlocked even if `node` is locked
            node = leaf
        if state is not None:
            if node.state is None:
                node.state = state
                self._stateful[node] = None
            else:
                self.states.free(state)
        return matched

    def _take_window_rows(self, node: _Node, rows: torch.Tensor) -> None:
        node.wslots, node.wcount = rows, take_rows(self.window_pool, rows)
        self._window_rows += node.wcount

    def _revive(self, node: _Node, rows: torch.Tensor) -> None:
        """Give the path root..node (exactly `rows` long) the caller's window rows where it holds none."""
        end = rows.numel()
        for n in reversed(self._path(node)):
            start = end - len(n.key)
            revived = revive_rows(self.window_pool, n.wslots, rows[start:end])
            n.wcount += revived
            self._window_rows += revived
            end = start

    def evict(self, num_tokens: int) -> int:
        """Remove unlocked leaves, least recently used first (a parent whose last child goes becomes a
        leaf), until at least `num_tokens` tokens are gone or nothing evictable remains.

        Mutates the tree and drops its pool references (`pool.free`) on removed slots, which return to the
        free list only if no request holds them; removed nodes' states are freed. Returns tokens removed. Caller
        must hold the scheduler's lock.
        """
        tie = itertools.count()
        heap = [(n.last_access, next(tie), n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        removed = 0
        while removed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node.parent is None:  # trimmed with a child before its turn came
                continue
            tokens, parent = self._remove_leaf(node)
            removed += tokens
            if parent is not self._root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(tie), parent))
        return removed

    def evict_states(self, num_states: int) -> int:
        """Free up to `num_states` states, least recently used first, locked nodes' too (a running request copied
        its state when it was admitted); an unlocked leaf that loses its state is removed (its KV freed), and so
        is every parent that this leaves a tombstone leaf. Returns the states freed. Mutates the tree, the state
        pool and pool refcounts."""
        heap = [(n.last_access, i, n) for i, n in enumerate(self._stateful)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_states and heap:
            _, _, node = heapq.heappop(heap)
            if node.parent is None or node.state is None:
                continue
            self._drop_state(node)
            freed += 1
            if self._trimmable(node):
                self._remove_leaf(node)
        return freed

    def evict_window(self, num_rows: int) -> int:
        """Free at least `num_rows` window rows if the tree holds them, least recently used node first: an unlocked
        leaf is removed whole (a leaf without window rows could never be resumed from), any other node keeps its
        full-attention rows and loses its window rows (locked ones too: a running request holds its own
        references to what it reads). Returns the window rows freed; mutates the tree and both pools' refcounts."""
        tie = itertools.count()
        heap = [(n.last_access, next(tie), n) for n in self._window_nodes()]
        heapq.heapify(heap)
        freed = 0
        while freed < num_rows and heap:
            _, _, node = heapq.heappop(heap)
            if node.parent is None or node.wcount == 0:
                continue
            if not node.children and node.lock_ref == 0:
                rows = node.wcount
                _, parent = self._remove_leaf(node)
                freed += rows
                if (
                    parent is not self._root
                    and not parent.children
                    and parent.lock_ref == 0
                    and parent.wcount
                ):
                    heapq.heappush(heap, (parent.last_access, next(tie), parent))
                continue
            freed += self._drop_window_rows(node)
        return freed

    def _window_nodes(self) -> list[_Node]:
        nodes, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.wcount:
                nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def _drop_window_rows(self, node: _Node) -> int:
        freed = drop_rows(self.window_pool, node.wslots)
        node.wcount = 0
        self._window_rows -= freed
        return freed

    def _drop_state(self, node: _Node) -> None:
        self.states.free(node.state)
        node.state = None
        del self._stateful[node]

    def _remove_leaf(self, node: _Node) -> tuple[int, _Node]:
        """Remove an unlocked leaf (freeing its slots and state), then, in a state tree, every ancestor this
        leaves a tombstone leaf: nobody can resume from its KV. Returns (tokens removed, the first ancestor
        that stays)."""
        removed = 0
        while True:
            parent = node.parent
            assert parent is not None and not node.children and node.lock_ref == 0
            if node.state is not None:
                self._drop_state(node)
            if node.wcount:
                self._drop_window_rows(node)
            self.pool.free(node.slots)
            del parent.children[node.key[0]]
            del self._leaves[node]
            node.parent = None
            removed += len(node.key)
            self._total_tokens -= len(node.key)
            self._evictable_tokens -= len(node.key)
            if parent is self._root or parent.children:
                return removed, parent
            self._leaves[parent] = None
            if not self._trimmable(parent):
                return removed, parent
            node = parent

    def reset(self) -> None:
        """Drop every node, the tree's pool references and its states. No handle may be locked. Mutates the tree,
        pool refcounts and the state pool; caller must hold the scheduler's lock."""
        assert self._root.lock_ref == 0, "reset while handles are locked"
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            self.pool.free(node.slots)
            if node.state is not None:
                self.states.free(node.state)
            if node.wcount:
                self.window_pool.free(node.wslots[node.wslots >= 0])
            node.parent = None
            stack.extend(node.children.values())
        self._init_tree()

    def check_integrity(self) -> None:
        """Raise AssertionError if the tree's structure, counters, pool references, states or window rows are
        inconsistent (radix_integrity.py). Mutates nothing."""
        check_tree(self)

    def _walk(self, tokens: Sequence[int], stamp: bool) -> list[_Node]:
        """The nodes whose whole edge is a prefix of `tokens`, root excluded, in order (no split)."""
        if stamp:
            self._clock += 1
            self._root.last_access = self._clock
        path = [child for child, common in self._edges(tokens) if common == len(child.key)]
        if stamp:
            for child in path:
                child.last_access = self._clock
        return path

    def _edges(self, tokens: Sequence[int]) -> Iterator[tuple[_Node, int]]:
        """Each node on the longest present prefix of `tokens`, root excluded, with how many of its edge's tokens
        the prefix covers (all but maybe the last's). Changes nothing."""
        node, matched = self._root, 0
        while matched < len(tokens):
            child = node.children.get(tokens[matched])
            if child is None:
                return
            common = _common_prefix_len(child.key, tokens, matched)
            yield child, common
            if common < len(child.key):
                return
            matched += common
            node = child

    def _descend(self, tokens: Sequence[int]) -> tuple[_Node, int, list[torch.Tensor]]:
        """Walk the longest present prefix of `tokens`, splitting the last edge if the prefix ends inside
        it; stamp the path with a fresh LRU time. Returns (deepest node, tokens matched, slot parts)."""
        self._clock += 1
        node, matched, parts = self._root, 0, []
        node.last_access = self._clock
        while matched < len(tokens):
            child = node.children.get(tokens[matched])
            if child is None:
                break
            common = _common_prefix_len(child.key, tokens, matched)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = self._clock
            parts.append(child.slots)
            matched += common
            node = child
        return node, matched, parts

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node`'s edge after `at` tokens; returns the new upper node. `node` keeps the lower part (and its
        state, the state after its last token), so handles to it stay valid and still denote the same prefix.
        The upper node is a tombstone in a state tree. Counts are unchanged."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key)
        upper = _Node(node.key[:at], node.slots[:at].clone(), parent, node.last_access)
        upper.lock_ref = node.lock_ref  # every lock through `node` passes through `upper`
        if node.wslots is not None:
            upper.wslots, node.wslots = node.wslots[:at].clone(), node.wslots[at:].clone()
            upper.wcount = int((upper.wslots >= 0).sum())
            node.wcount -= upper.wcount
        upper.children[node.key[at]] = node
        parent.children[upper.key[0]] = upper
        node.key = node.key[at:]
        node.slots = node.slots[at:].clone()
        node.parent = upper
        return upper

    def _as_node(self, handle: object) -> _Node:
        assert isinstance(handle, _Node), f"not a RadixCache handle: {handle!r}"
        return handle
