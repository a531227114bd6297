"""KV rows (and linear-attention state) over Mooncake's transfer engine: the prefill engine writes straight into
the decode engine's pools.

Each side registers its KV pool (one allocation: every plane of every layer group) and, for hybrid models, its
state pool with a `TransferEngine` once (P2P handshake: no metadata server). A reservation answers with the
decode pools' `MooncakeTarget` (their addresses and the offset and row size of every plane); the prefill engine
then writes every plane's rows of the request from its own slots to the reserved slots, runs of consecutive
slots on both sides merged into one segment, and each state plane's row of its state slot to the reserved one,
all in one `batch_transfer_sync_write`. No staging copy on either side. TCP here, RDMA where the hardware has it
(Mooncake picks; nothing here changes).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from mmserve.disagg.kv_messages import MooncakeRegion, MooncakeTarget, Plane
from mmserve.engine.cache.transfer import CacheTransfer, HandoffSlots, Region


class KvMooncake:
    def __init__(self, transfer: CacheTransfer, host: str) -> None:
        from mooncake.engine import TransferEngine  # its native library loads only when this backend is used

        if transfer.kv.device.type != "cpu":
            raise ValueError(
                "the mooncake KV backend here moves CPU pools only (this wheel has no GPU transport)"
            )
        self.transfer = transfer
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise OSError(f"Mooncake transfer engine did not start on {host}")
        self.kv = transfer.kv_region()
        self.state = transfer.state_region()
        self.window = transfer.window_region()
        self._registered: list[int] = []
        for region in (self.kv, self.state, self.window):
            if region is None:
                continue
            if self.engine.register_memory(region.address, region.nbytes) != 0:
                self.close()
                raise OSError("Mooncake could not register the engine's cache pools")
            self._registered.append(region.address)
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._lock = threading.Lock()  # one batch at a time through this engine (peer threads share it)

    def target(self) -> MooncakeTarget:
        return MooncakeTarget(
            self.session,
            _wire(self.kv),
            _wire(self.state) if self.state else None,
            _wire(self.window) if self.window else None,
        )

    def write(self, target: MooncakeTarget, src: HandoffSlots, dst: HandoffSlots) -> int:
        """Write every plane's rows of our slots `src` into the peer's `dst` (KV rows, window rows, the state
        slot's rows). Returns the bytes moved; raises ValueError when the peer's planes do not match ours and
        OSError when the transfer engine reports a failure."""
        srcs, dsts, lens = [], [], []
        _rows(self.kv, target.kv, src.slots, dst.slots, "KV", (srcs, dsts, lens))
        if src.window_slots is not None:
            if self.window is None or target.window is None or dst.window_slots is None:
                raise ValueError("sliding-window rows to write, but no window pool on one side")
            _rows(self.window, target.window, src.window_slots, dst.window_slots, "window", (srcs, dsts, lens))
        if src.state_slot is not None:
            if self.state is None or target.state is None or dst.state_slot is None:
                raise ValueError("a linear-attention state to write, but no state pool on one side")
            _check_planes(self.state, target.state, "state")
            for (src_off, row), dst_plane in zip(self.state.planes, target.state.planes, strict=True):
                srcs.append(self.state.address + src_off + src.state_slot * row)
                dsts.append(target.state.address + dst_plane.offset + dst.state_slot * row)
                lens.append(row)
        if not srcs:
            return 0
        with self._lock:
            rc = self.engine.batch_transfer_sync_write(target.session, srcs, dsts, lens)
        if rc != 0:
            raise OSError(f"Mooncake KV write to {target.session} failed (code {rc})")
        return sum(lens)

    def close(self) -> None:
        for address in self._registered:
            with contextlib.suppress(Exception):
                self.engine.unregister_memory(address)
        self._registered = []


def _rows(ours: Region, theirs: MooncakeRegion, src: torch.Tensor, dst: torch.Tensor, what: str, out) -> None:
    """Segments moving our rows `src` of every plane of `ours` to rows `dst` of the peer's planes, appended to
    out = (sources, destinations, lengths); runs of consecutive rows on both sides go as one segment."""
    _check_planes(ours, theirs, what)
    runs = _runs(src.tolist(), dst.tolist())
    for (src_off, row), dst_plane in zip(ours.planes, theirs.planes, strict=True):
        for s, d, n in runs:
            out[0].append(ours.address + src_off + s * row)
            out[1].append(theirs.address + dst_plane.offset + d * row)
            out[2].append(n * row)


def _wire(region: Region) -> MooncakeRegion:
    return MooncakeRegion(region.address, region.num_rows, [Plane(o, r) for o, r in region.planes])


def _check_planes(ours: Region, theirs: MooncakeRegion, what: str) -> None:
    rows = [r for _, r in ours.planes]
    if rows != [p.row_bytes for p in theirs.planes]:
        raise ValueError(f"{what} planes differ: rows of {rows} bytes here, {[p.row_bytes for p in theirs.planes]} there")


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) segments: stretches where both slot lists step by +1 together, or by -1
    together (a descending stretch is the same memory copied forwards from its lowest row)."""
    assert len(src) == len(dst), (len(src), len(dst))
    runs: list[list[int]] = []  # [src_first, dst_first, length, step]
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n, step = runs[-1]
            for candidate in (step,) if n > 1 else (1, -1):
                if s == s0 + candidate * n and d == d0 + candidate * n:
                    runs[-1] = [s0, d0, n + 1, candidate]
                    break
            else:
                runs.append([s, d, 1, 1])
        else:
            runs.append([s, d, 1, 1])
    return [(s0, d0, n) if step == 1 else (s0 - n + 1, d0 - n + 1, n) for s0, d0, n, step in runs]
