"""Shared pieces of the engine tests: conversations, HF references, a logits-recording sampler."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import av
import numpy as np
import torch
from PIL import Image

from mmserve.engine.sampler import Sampler
from mmserve.multimodal.items import Modality
from mmserve.multimodal.media import decode_image, decode_video
from mmserve.testing.reference import hf_generate, prepare_prompt
from tests.conftest import random_image


def png_uri(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def mp4_bytes(seed: int, frames: int = 4, width: int = 64, height: int = 48, fps: int = 2) -> bytes:
    rng = np.random.RandomState(seed)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(
                (rng.rand(height, width, 3) * 255).astype("uint8"), format="rgb24"
            )
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buf.getvalue()


@dataclass
class Case:
    """One conversation in both forms: OpenAI-style for mmserve, decoded media for the HF oracle."""

    messages: list
    media: list  # (Modality, decoded object)


def image_case(seeds: list[int], text: str, system: str | None = None, sizes=None) -> Case:
    sizes = sizes or [(64, 48)] * len(seeds)
    images = [random_image(s, *wh) for s, wh in zip(seeds, sizes, strict=True)]
    parts = [{"type": "image_url", "image_url": {"url": png_uri(im)}} for im in images]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    # The oracle sees exactly what the server decodes from the PNG.
    decoded = [(Modality.IMAGE, decode_image(_png(im), _media_cfg())) for im in images]
    return Case(messages, decoded)


def video_case(seed: int, text: str) -> Case:
    data = mp4_bytes(seed)
    uri = "data:video/mp4;base64," + base64.b64encode(data).decode()
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": uri}},
                                             {"type": "text", "text": text}]}]  # fmt: skip
    return Case(messages, [(Modality.VIDEO, decode_video(data, _media_cfg()))])


def text_case(text: str) -> Case:
    return Case([{"role": "user", "content": text}], [])


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _media_cfg():
    from mmserve.config import MediaConfig

    return MediaConfig()


def template_messages(messages: list) -> list:
    from mmserve.multimodal.messages import parse_messages

    return parse_messages(messages)[0]


def reference(model, tokenizer, processor, case: Case, max_new_tokens: int):
    prompt, processed = prepare_prompt(tokenizer, processor, template_messages(case.messages), case.media)
    return hf_generate(model, prompt, processed, max_new_tokens=max_new_tokens)


class RecordingSampler(Sampler):
    """Records every logits row, keyed by the identity of the request's SamplingParams."""

    def __init__(self) -> None:
        self.rows: dict[int, list[torch.Tensor]] = {}

    def __call__(self, logits, params, generators):
        for row, p in zip(logits, params, strict=True):
            self.rows.setdefault(id(p), []).append(row.detach().clone())
        return super().__call__(logits, params, generators)

    def logits_for(self, params) -> torch.Tensor:
        return torch.stack(self.rows[id(params)])
