"""The `hf` baseline of `mmserve bench compare`: plain transformers `generate`, one request at a time.

What a user without a serving engine does: decode the request's media, preprocess, `model.generate`. The
same workload requests are replayed and turned into the same `RequestTrace`s as the HTTP client produces
(first-token and per-token times come from a streamer hooked into `generate`), so `stats.summarize` reports
both sides identically.
"""

from __future__ import annotations

import time

from transformers.generation.streamers import BaseStreamer

from mmserve.bench.client import RequestTrace
from mmserve.bench.workload import BenchRequest
from mmserve.config import MediaConfig
from mmserve.multimodal.items import Modality
from mmserve.multimodal.media import decode_image, decode_video, load_bytes
from mmserve.multimodal.messages import parse_messages
from mmserve.testing.reference import HFReference


class _TokenClock(BaseStreamer):
    """Records when each generated token arrives (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.calls = 0
        self.times: list[float] = []

    def put(self, value) -> None:
        self.calls += 1
        if self.calls > 1:
            self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFBaseline:
    def __init__(self, model_dir: str, dtype: str = "float32") -> None:
        self.reference = HFReference(model_dir, dtype=dtype)
        self.media_cfg = MediaConfig()

    def run(self, requests: list[BenchRequest]) -> tuple[list[RequestTrace], float]:
        start = time.perf_counter()
        traces = [self.one(req) for req in requests]
        return traces, time.perf_counter() - start

    def one(self, req: BenchRequest) -> RequestTrace:
        t0 = time.perf_counter()
        template, parts = parse_messages(req.messages)
        media = []
        for modality, part in parts:
            data = load_bytes(part.ref, self.media_cfg)
            decoded = (
                decode_image(data, self.media_cfg)
                if modality == Modality.IMAGE
                else decode_video(data, self.media_cfg)
            )
            media.append((modality, decoded))
        clock = _TokenClock()
        out = self.reference.generate(template, media, max_new_tokens=req.max_tokens, streamer=clock)
        end = time.perf_counter()
        return RequestTrace(
            index=req.index,
            start=t0,
            first_token=clock.times[0] if clock.times else None,
            token_times=clock.times,
            end=end,
            status=200,
            output_tokens=len(out.token_ids),
            prompt_tokens=len(out.input_ids),
            cached_tokens=0,
            error=None,
        )
