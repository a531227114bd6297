"""KV rows over Mooncake's transfer engine: the prefill engine writes straight into the decode engine's pool.

Each side registers its whole KV pool (`KVPool.buffer`, one allocation) with a `TransferEngine` once (P2P
handshake: no metadata server). A reservation answers with the decode pool's `MooncakeTarget`; the prefill
engine then writes every (K|V, layer) row of the request from its own slots to the reserved slots with one
`batch_transfer_sync_write`, runs of consecutive slots on both sides merged into one segment. No staging
copy on either side. TCP here, RDMA where the hardware has it (Mooncake picks; nothing here changes).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from mmserve.disagg.kv_messages import MooncakeTarget
from mmserve.engine.kv_pool import KVPool


class KvMooncake:
    def __init__(self, pool: KVPool, host: str) -> None:
        from mooncake.engine import TransferEngine  # its native library loads only when this backend is used

        if pool.device.type != "cpu":
            raise ValueError(
                "the mooncake KV backend here moves CPU pools only (this wheel has no GPU transport)"
            )
        self.pool = pool
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise OSError(f"Mooncake transfer engine did not start on {host}")
        self.address = pool.buffer.data_ptr()
        self.nbytes = pool.buffer.numel() * pool.buffer.element_size()
        if self.engine.register_memory(self.address, self.nbytes) != 0:
            raise OSError("Mooncake could not register the KV pool")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._lock = threading.Lock()  # one batch at a time through this engine (peer threads share it)

    def target(self) -> MooncakeTarget:
        return MooncakeTarget(self.session, self.address, self.pool.num_slots, self.pool.row_bytes)

    def write(self, target: MooncakeTarget, src_slots: torch.Tensor, dst_slots: list[int]) -> int:
        """Write the K and V rows of our `src_slots` into the peer's `dst_slots`, every layer. Returns the
        bytes moved; raises OSError when the transfer engine reports a failure."""
        pool = self.pool
        row = pool.row_bytes
        if row != target.row_bytes:
            raise ValueError(f"KV row size differs: {row} here, {target.row_bytes} at the decode engine")
        runs = _runs(src_slots.tolist(), dst_slots)
        srcs, dsts, lens = [], [], []
        for plane in range(2 * pool.num_layers):  # (kv, layer) planes in buffer order
            src_plane = self.address + plane * pool.num_slots * row
            dst_plane = target.address + plane * target.num_slots * row
            for src, dst, n in runs:
                srcs.append(src_plane + src * row)
                dsts.append(dst_plane + dst * row)
                lens.append(n * row)
        if not srcs:
            return 0
        with self._lock:
            rc = self.engine.batch_transfer_sync_write(target.session, srcs, dsts, lens)
        if rc != 0:
            raise OSError(f"Mooncake KV write to {target.session} failed (code {rc})")
        return sum(lens)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.unregister_memory(self.address)


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
