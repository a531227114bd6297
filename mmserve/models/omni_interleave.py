"""The row order of Qwen-Omni's audio-in-video items: how transformers' processors interleave a video's rows with
its own audio track's, by time id (mmserve.models.qwen_omni lays the item's rows and positions out by it)."""

from __future__ import annotations

from collections.abc import Sequence


def chunk_bounds(indices: Sequence[int], per_chunk: int) -> list[tuple[int, int]]:
    """[start, end) runs of `indices` (increasing time ids) within successive `per_chunk`-wide time windows: the
    processor's `get_chunked_index` (a run per window up to the last index, empty ones included)."""
    out, start, chunk = [], 0, 1
    for i, value in enumerate(indices):
        if value >= chunk * per_chunk:
            out.append((start, i))
            start, chunk = i, chunk + 1
    out.append((start, len(indices)))
    return out


def time_sorted_runs(video_t: Sequence[float], audio_t: Sequence[float]) -> list[tuple[str, int, int]]:
    """Qwen3-Omni's audio-in-video order: video and audio rows merged by time id (a video row first on a tie), as
    ("video" | "audio", start, end) runs of each tower's rows."""
    runs: list[tuple[str, int, int]] = []
    v = a = 0
    while v < len(video_t) or a < len(audio_t):
        kind = "video" if a == len(audio_t) or (v < len(video_t) and video_t[v] <= audio_t[a]) else "audio"
        start = v if kind == "video" else a
        if kind == "video":
            v += 1
        else:
            a += 1
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((kind, start, start + 1))
    return runs
