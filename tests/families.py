"""Per-family test cases: what "one item", "two items" and the extra modalities mean for each model family."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.engine_helpers import Case, audio_case, image_case, text_case, video_case

# Small videos keep the tiny models fast; each family names its own video pixel settings.
QWEN_VIDEO = {"video_min_pixels": 56 * 56, "video_max_pixels": 112 * 112}
QWEN3_VIDEO = {"video_min_pixels": 32 * 32 * 2, "video_max_pixels": 64 * 64 * 4}
# GLM: a 64 x 48 clip of 4 frames resized to 84 x 56 (a 6 x 4 patch grid: height and width differ).
GLM_VIDEO = {"video_min_pixels": 4 * 56 * 70}


@dataclass(frozen=True)
class FamilyCases:
    arch: str
    modality: str  # the family's main modality
    mm_kwargs: dict = field(default_factory=dict)
    has_video: bool = False
    others: tuple[str, ...] = ()  # further still modalities ("image" / "audio"), one and two items of each
    # The two clips' lengths (s). Qwen3-Omni's: equal, because transformers' processor pads a call's clips to the
    # longest before the STFT, so HF's features of a shorter clip differ in its last mel frame from the clip
    # featurized alone, as mmserve (and HF, for a one-clip prompt) does: tests/test_family_qwen_omni.py.
    two_clip_seconds: tuple[float, float] = (0.6, 1.3)

    def one(
        self, seed: int, text: str = "Describe it.", size: tuple[int, int] = (64, 48), modality: str = ""
    ) -> Case:
        """One item; `size` is an image's (width, height), or (hundredths of a second, -) of a clip."""
        if (modality or self.modality) == "audio":
            return audio_case([seed], text, seconds=[size[0] / 100])
        return image_case([seed], text, sizes=[size])

    def two(self, seeds: list[int], text: str = "Compare them.", modality: str = "") -> Case:
        if (modality or self.modality) == "audio":
            return audio_case(seeds, text, seconds=list(self.two_clip_seconds))
        return image_case(seeds, text, sizes=[(64, 48), (48, 80)])

    def bad(self) -> list[tuple[list, int, str]]:
        """Bad media for this family: (messages, HTTP status, a fragment of the error message)."""
        import base64

        garbage = base64.b64encode(b"\x00not media at all" * 8).decode()
        if self.modality == "audio":
            long_clip = audio_case([9], "Too long.", seconds=[3.0]).messages  # the tiny model's window is 2 s
            part = {"type": "input_audio", "input_audio": {"data": garbage, "format": "wav"}}
            return [
                ([{"role": "user", "content": [part]}], 400, "cannot decode audio"),
                (long_clip, 413, "at most 2 s"),
            ]
        part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + garbage}}
        return [([{"role": "user", "content": [part]}], 400, "cannot decode image")]

    def cases(self) -> dict[str, Case]:
        """The single-request parity cases: text only, one and two items, the video path if any."""
        out = {"text": text_case("Tell me a story about a cat."), "one": self.one(0), "two": self.two([1, 2])}
        for k, modality in enumerate(self.others):
            out[f"one-{modality}"] = self.one(4 + k, modality=modality)
            out[f"two-{modality}"] = self.two([6 + 2 * k, 7 + 2 * k], modality=modality)
        if self.has_video:
            out["video"] = video_case(3, "Describe the video.")
        return out


FAMILIES = {
    "qwen2_vl": FamilyCases("qwen2_vl", "image", QWEN_VIDEO, has_video=True),
    "qwen2_5_vl": FamilyCases("qwen2_5_vl", "image", QWEN_VIDEO, has_video=True),
    "qwen3_vl": FamilyCases("qwen3_vl", "image", QWEN3_VIDEO, has_video=True),
    "qwen3_vl_moe": FamilyCases("qwen3_vl_moe", "image", QWEN3_VIDEO, has_video=True),
    "qwen3_5": FamilyCases("qwen3_5", "image", QWEN3_VIDEO, has_video=True),
    "qwen3_5_moe": FamilyCases("qwen3_5_moe", "image", QWEN3_VIDEO, has_video=True),
    "llava_onevision": FamilyCases("llava_onevision", "image", has_video=True),
    "qwen2_audio": FamilyCases("qwen2_audio", "audio"),
    "gemma3": FamilyCases("gemma3", "image"),
    "gemma4": FamilyCases("gemma4", "image", has_video=True, others=("audio",)),
    "qwen2_5_omni": FamilyCases("qwen2_5_omni", "image", QWEN_VIDEO, has_video=True, others=("audio",)),
    "qwen3_omni_moe": FamilyCases(
        "qwen3_omni_moe", "image", QWEN3_VIDEO, has_video=True, others=("audio",), two_clip_seconds=(1.3, 1.3)
    ),
    "idefics3": FamilyCases("idefics3", "image"),
    "smolvlm": FamilyCases("smolvlm", "image", has_video=True),
    "mistral3": FamilyCases("mistral3", "image"),
    "internvl": FamilyCases("internvl", "image", has_video=True),
    "minicpmv4_6": FamilyCases("minicpmv4_6", "image", has_video=True),
    "glm4v": FamilyCases("glm4v", "image", GLM_VIDEO, has_video=True),
    "glm4v_moe": FamilyCases("glm4v_moe", "image", GLM_VIDEO, has_video=True),
}
