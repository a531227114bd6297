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
from mmserve.testing.reference import HFReference
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
    decoded = [(Modality.IMAGE, decode_image(png_bytes(im), _media_cfg())) for im in images]
    return Case(messages, decoded)


def video_case(seed: int, text: str) -> Case:
    data = mp4_bytes(seed)
    uri = "data:video/mp4;base64," + base64.b64encode(data).decode()
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": uri}},
                                             {"type": "text", "text": text}]}]  # fmt: skip
    return Case(messages, [(Modality.VIDEO, decode_video(data, _media_cfg()))])


def text_case(text: str) -> Case:
    return Case([{"role": "user", "content": text}], [])


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _media_cfg():
    from mmserve.config import MediaConfig

    return MediaConfig()


def template_messages(messages: list) -> list:
    from mmserve.multimodal.messages import parse_messages

    return parse_messages(messages)[0]


def reference(ref: HFReference, case: Case, max_new_tokens: int):
    """HF generate on `case` with inputs from transformers' own processor (see mmserve.testing.reference)."""
    return ref.generate(template_messages(case.messages), case.media, max_new_tokens=max_new_tokens)


class RecordingSampler(Sampler):
    """Records every logits row, keyed by the identity of the request's SamplingParams."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, list[torch.Tensor]] = {}

    def __call__(self, logits, params, generators):
        for row, p in zip(logits, params, strict=True):
            self.rows.setdefault(id(p), []).append(row.detach().float())
        return super().__call__(logits, params, generators)

    def logits_for(self, params) -> torch.Tensor:
        return torch.stack(self.rows[id(params)])


def recorded_greedy_chat(llm, cases: list[Case], max_new_tokens: int):
    """(outputs, params, recorder): `cases` run together, greedy with `max_new_tokens`, every logits row kept."""
    from mmserve import SamplingParams

    recorder = RecordingSampler()
    llm.engine.sampler = recorder
    params = [SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True) for _ in cases]
    return llm.chat([c.messages for c in cases], params), params, recorder


def reference_text(
    model_dir: str, max_new_tokens: int, mm_processor_kwargs: dict | None = None, dtype: str = "float32"
):
    """A function: Case -> the HF reference's greedy text (special tokens skipped, as the server answers)."""
    ref = HFReference(model_dir, dtype=dtype, mm_processor_kwargs=mm_processor_kwargs)
    return lambda case, max_new=max_new_tokens: ref.tokenizer.decode(
        reference(ref, case, max_new).token_ids, skip_special_tokens=True
    )


def wav_bytes(seed: int, seconds: float, rate: int = 16_000) -> bytes:
    """A seeded clip as 16-bit PCM WAV: three tones spread over the spectrum, each switched on and off
    every 50 ms at random, plus noise (so that the mel features of two seeds really differ)."""
    import soundfile

    rng = np.random.RandomState(seed)
    t = np.arange(int(seconds * rate)) / rate
    samples = 0.02 * rng.randn(t.shape[0])
    for freq in rng.uniform(100, rate / 2 - 500, size=3):
        gates = rng.rand(int(seconds * 20) + 1) < 0.5
        samples += 0.25 * np.sin(2 * np.pi * freq * t) * gates[(t * 20).astype(int)]
    buf = io.BytesIO()
    soundfile.write(buf, samples.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def audio_case(seeds: list[int], text: str, seconds: list[float] | None = None) -> Case:
    from mmserve.multimodal.media import decode_audio

    seconds = seconds or [0.6] * len(seeds)
    clips = [wav_bytes(s, sec) for s, sec in zip(seeds, seconds, strict=True)]
    parts = [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(c).decode(), "format": "wav"}}
        for c in clips
    ]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
    return Case(messages, [(Modality.AUDIO, decode_audio(c, _media_cfg())) for c in clips])
