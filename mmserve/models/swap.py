"""Swapping a model's submodules in place: how mmserve puts its own layers under HF's code (packed linear layers,
patch GEMMs, fused vision attention, activation tables) without touching the code that calls them."""

from __future__ import annotations

from collections.abc import Callable

import torch

Swap = Callable[[torch.nn.Module], torch.nn.Module | None]


def swap_modules(root: torch.nn.Module, swap: Swap) -> int:
    """Replaces each submodule `m` under `root` for which `swap(m)` gives a module with that module, in its
    parent's attribute; returns how many. The submodules are listed first, so a new module's own children are
    not visited."""
    targets = [(name, module) for name, module in root.named_modules() if name]
    done = 0
    for name, module in targets:
        new = swap(module)
        if new is None:
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(root.get_submodule(parent_name), attr, new)
        done += 1
    return done
