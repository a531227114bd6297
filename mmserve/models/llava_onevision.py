"""LLaVA-OneVision: anyres image tiling, pooled video frames, a SigLIP tower and a plain (1-D RoPE) Qwen2 LM.

Images go through transformers' PIL image processor (`LlavaOnevisionImageProcessorPil`, from the checkpoint).
As in transformers, what an image becomes depends on the whole request (its `batch_num_images`):

| images in the request | tower input                                     | LM tokens (strategy "full")           |
|-----------------------|-------------------------------------------------|---------------------------------------|
| exactly one (anyres)  | base tile + the best-resolution grid of tiles   | P + rows x (cols + 1), see below      |
| several               | the image padded to a square (mean colour), 1 tile | P + 1 (base tile + one newline)    |

P is the tokens of one tile ((image_size / patch_size)^2). An anyres image's grid features are unpadded to the
image's aspect ratio, bilinearly shrunk when they exceed `anyres_max_N` tiles' worth (by more than 10 %),
and every row ends with `image_newline`. `item_settings` tells each image its mode (`{"anyres": bool}`);
the mode travels with the item and enters its content hash.

Videos: HF's video processor needs torchvision, so frames are preprocessed here: each frame is resized to
the video processor's (square) size and rescaled / normalized by the image processor's own methods, with the
settings of `video_preprocessor_config.json`. Per frame the tower output is pooled 2x2 (bilinear,
`apply_pooling`); the frames are concatenated and ONE `image_newline` ends the video:
frames x ceil(sqrt(P) / 2)^2 + 1 tokens.

The tower is transformers' own modules (SigLIP `vision_tower`, `multi_modal_projector`, `image_newline`)
with `LlavaOnevisionModel`'s packing and pooling borrowed as methods; one fused forward covers every tile and
frame of a batch. Checkpoint keys come in transformers 5's layout (`model.vision_tower...`,
`model.language_model...`) or the original one (`vision_tower.vision_model...`, `language_model.model...`,
`language_model.lm_head...`); both are accepted. The LM uses plain 1-D RoPE: item tokens advance positions
one by one like text.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import Any

import msgspec
import numpy as np
import torch
from PIL import Image

from mmserve.models import weights
from mmserve.models.family import (
    CausalLM,
    EmbeddingMismatch,
    LanguageModel,
    check_tensors,
    expand_placeholders,
    plain_setting,
)
from mmserve.models.layer_specs import layer_specs_from_hf
from mmserve.multimodal.errors import MediaDecodeError, UnsupportedMediaError
from mmserve.multimodal.items import MAIN, ExpandedPrompt, ItemEmbedding, Modality, TowerInput

# Tower parts: (name in the Tower module, checkpoint prefixes in both layouts).
TOWER_PARTS = (
    ("vision_tower.", ("model.vision_tower.", "vision_tower.")),
    ("multi_modal_projector.", ("model.multi_modal_projector.", "multi_modal_projector.")),
    ("image_newline", ("model.image_newline", "image_newline")),
)
NESTED_VISION = ("vision_model.",)  # older checkpoints nest the SigLIP transformer one level deeper
# Image-processor attributes that change an image's pixels (all enter the content hash).
IMAGE_SETTINGS = (
    "size",
    "crop_size",
    "image_grid_pinpoints",
    "resample",
    "do_resize",
    "do_center_crop",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_convert_rgb",
)


@dataclass(frozen=True)
class FrameSettings:
    """How video frames are preprocessed: `LlavaOnevisionVideoProcessor`'s settings (its class defaults,
    then the checkpoint's video_preprocessor_config.json). Frames are stretched to (height, width)."""

    height: int
    width: int
    resample: int
    do_resize: bool
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]

    @classmethod
    def from_dir(cls, path: str, defaults: type | None = None) -> FrameSettings:
        """`defaults`: the family's HF video-processor class, whose class attributes are its defaults."""
        from transformers.models.llava_onevision.video_processing_llava_onevision import (
            LlavaOnevisionVideoProcessor,
        )

        Defaults = defaults or LlavaOnevisionVideoProcessor  # noqa: N806 (a class)
        raw: dict[str, Any] = {}
        file = os.path.join(path, "video_preprocessor_config.json")
        if os.path.exists(file):
            with open(file) as f:
                raw = json.load(f)
        size = raw.get("size") or Defaults.size
        if "height" not in size or "width" not in size:
            raise ValueError(
                f"video processor size {size} is not supported: frames need a height and a width"
            )
        values = {f.name: raw.get(f.name, getattr(Defaults, f.name, None)) for f in fields(cls)}
        values.update(
            height=size["height"],
            width=size["width"],
            resample=int(values["resample"]),
            image_mean=tuple(values["image_mean"]),
            image_std=tuple(values["image_std"]),
        )
        return cls(**values)


class VisionMeta(msgspec.Struct, frozen=True, array_like=True):
    """What travels with a LLaVA-OneVision item: its tower inputs (tiles of an image, frames of a video) and
    their pixel size, and for an image its original (height, width) and whether it was tiled (anyres)."""

    num_inputs: int
    input_hw: tuple[int, int]
    original_hw: tuple[int, int] = (0, 0)
    anyres: bool = False


class Tower(torch.nn.Module):
    """The vision half of transformers' `LlavaOnevisionModel`, module names as in the checkpoint; its
    packing (`pack_image_features`) and video pooling (`apply_pooling`) are HF's own methods."""

    def __init__(self, config, dtype: torch.dtype) -> None:
        from transformers.models.llava_onevision.modeling_llava_onevision import (
            LlavaOnevisionMultiModalProjector,
        )

        super().__init__()
        self.config = config
        self.vision_tower = weights.build_empty(config.vision_config, dtype, "sdpa")
        self.multi_modal_projector = LlavaOnevisionMultiModalProjector(config).to(dtype)
        self.image_newline = torch.nn.Parameter(torch.empty(config.text_config.hidden_size, dtype=dtype))

    @property
    def dtype(self) -> torch.dtype:
        return self.image_newline.dtype

    def pack_image_features(self, *args, **kwargs):
        from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

        return LlavaOnevisionModel.pack_image_features(self, *args, **kwargs)

    def apply_pooling(self, features: torch.Tensor) -> torch.Tensor:
        from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

        return LlavaOnevisionModel.apply_pooling(self, features)

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) tiles or frames -> projected features (N, P, hidden), as HF's `get_image_features`:
        the `vision_feature_layer` hidden state(s), CLS dropped for the "default" strategy."""
        layer = self.config.vision_feature_layer
        out = self.vision_tower(pixel_values, output_hidden_states=layer, return_dict=True)
        if isinstance(layer, int):
            selected = out.hidden_states[layer]
        else:
            selected = torch.cat([out.hidden_states[i] for i in layer], dim=-1)
        if self.config.vision_feature_select_strategy == "default":
            selected = selected[:, 1:]
        return self.multi_modal_projector(selected)

    def pack_video(self, features: torch.Tensor) -> torch.Tensor:
        """(frames, P, hidden) -> (frames * pooled + 1, hidden): HF's `get_video_features` for one video."""
        pooled = self.apply_pooling(features)  # (frames, ceil(h/2) * ceil(w/2), hidden)
        return torch.cat((pooled.reshape(-1, pooled.shape[-1]), self.image_newline[None].to(pooled)), dim=0)

    def pack_image(self, features: torch.Tensor, original_hw: tuple[int, int]) -> torch.Tensor:
        """(tiles, P, hidden) of one image -> its token rows (anyres when it has more than one tile)."""
        packed, _ = self.pack_image_features(
            [features],
            [original_hw],
            image_newline=self.image_newline,
            vision_aspect_ratio=self.config.vision_aspect_ratio,
        )
        return packed[0]


class Family(CausalLM):
    """LLaVA-OneVision (see module docstring)."""

    modalities = frozenset({Modality.IMAGE, Modality.VIDEO})
    position_rows = 1
    extra_dims: dict[str, int] = {}
    audio_sample_rate_hz = None

    def __init__(self, path: str, hf_config, mm_processor_kwargs: Mapping[str, Any]) -> None:
        if mm_processor_kwargs:
            raise ValueError(
                f"unknown mm processor settings {sorted(mm_processor_kwargs)}: LLaVA-OneVision takes none"
            )
        self.path = path
        self.hf_config = hf_config
        self.model_type = hf_config.model_type
        self.placeholders = {
            Modality.IMAGE: hf_config.image_token_id,
            Modality.VIDEO: hf_config.video_token_id,
        }
        self.hidden_size = hf_config.text_config.hidden_size
        self.layer_specs = layer_specs_from_hf(hf_config.get_text_config())
        vision = hf_config.vision_config
        self.patches_per_side = vision.image_size // vision.patch_size  # of one tile: P = patches_per_side^2
        self.strategy = hf_config.vision_feature_select_strategy
        self.aspect_ratio = hf_config.vision_aspect_ratio
        if not self.aspect_ratio.startswith("anyres_max_") or not self.aspect_ratio[11:].isdigit():
            raise ValueError(f"vision_aspect_ratio {self.aspect_ratio!r} is not supported (anyres_max_N)")
        self.max_num_tiles = int(self.aspect_ratio[11:])
        self.model_settings = {
            "vision_feature_layer": hf_config.vision_feature_layer,
            "vision_feature_select_strategy": self.strategy,
        }

    # -- processor ------------------------------------------------------------------------------------
    @cached_property
    def image_processor(self):
        """Built on first use (the API server never preprocesses, and skips the import)."""
        from transformers import LlavaOnevisionImageProcessorPil

        return LlavaOnevisionImageProcessorPil.from_pretrained(self.path)

    @cached_property
    def frames(self) -> FrameSettings:
        return FrameSettings.from_dir(self.path)

    def item_settings(self, modalities: Sequence[Modality]) -> list[dict[str, Any]]:
        """HF tiles an image (anyres) only when it is the request's only image."""
        anyres = sum(m == Modality.IMAGE for m in modalities) == 1
        return [{"anyres": anyres} if m == Modality.IMAGE else {} for m in modalities]

    def image_mode(self, modality: Modality, settings: Mapping[str, Any]) -> bool:
        """The anyres flag of an image's settings (default: a lone image). Raises UnsupportedMediaError for
        any other setting."""
        allowed = {"anyres"} if modality == Modality.IMAGE else set()
        unknown = set(settings) - allowed
        if unknown or not isinstance(settings.get("anyres", True), bool):
            raise UnsupportedMediaError(f"unknown item settings {sorted(settings)} for this model")
        return settings.get("anyres", True)

    def hash_settings(self, modality: Modality, settings: Mapping[str, Any]) -> dict[str, Any]:
        anyres = self.image_mode(modality, settings)
        if modality == Modality.VIDEO:
            return {**asdict(self.frames), **self.model_settings}
        proc = self.image_processor
        image = {k: plain_setting(getattr(proc, k, None)) for k in IMAGE_SETTINGS}
        return {**image, **self.model_settings, "vision_aspect_ratio": self.aspect_ratio, "anyres": anyres}

    def meta(self, metadata: bytes) -> VisionMeta:
        return msgspec.msgpack.decode(metadata, type=VisionMeta)

    def num_tokens(self, modality: Modality, meta: VisionMeta) -> int:
        """LM tokens of an item, by HF's processor formulas (`_get_number_of_features`, `replace_*_token`)."""
        side = self.patches_per_side
        if modality == Modality.VIDEO:
            return meta.num_inputs * math.ceil(side / 2) ** 2 + 1
        if not meta.anyres:
            count = side * side + 1  # base tile + one newline
        else:
            from transformers.image_processing_utils import select_best_resolution

            height, width = meta.original_hw
            best_h, best_w = select_best_resolution(
                (height, width), self.image_processor.image_grid_pinpoints
            )
            rows, cols = side * (best_h // meta.input_hw[0]), side * (best_w // meta.input_hw[1])
            # Unpad: drop the feature rows / columns that covered the padding around the resized image.
            if width / height > cols / rows:
                rows -= 2 * ((rows - int(round(height * (cols / width), 7))) // 2)
            else:
                cols -= 2 * ((cols - int(round(width * (rows / height), 7))) // 2)
            ratio = math.sqrt(rows * cols / (self.max_num_tiles * side**2))
            if ratio > 1.1:  # anyres_max_N: shrink to about N tiles' worth
                rows, cols = int(rows // ratio), int(cols // ratio)
            count = side * side + rows * (cols + 1)  # base tile + each grid row and its newline
        return count - 1 if self.strategy == "default" else count

    def input_pixels(self, modality: Modality, metadata: bytes) -> int:
        """Pixels the tower sees: tiles (or frames) x tile height x tile width."""
        meta = self.meta(metadata)
        return meta.num_inputs * meta.input_hw[0] * meta.input_hw[1]

    def check_item(self, item: ItemEmbedding) -> None:
        try:
            meta = self.meta(item.metadata)
        except msgspec.DecodeError as e:
            raise EmbeddingMismatch(
                f"{item.modality.value} embedding has no valid LLaVA-OneVision metadata: {e}"
            ) from e
        sizes = (
            meta.num_inputs,
            *meta.input_hw,
            *(meta.original_hw if item.modality == Modality.IMAGE else ()),
        )
        if min(sizes) < 1:
            raise EmbeddingMismatch(
                f"{item.modality.value} embedding has invalid LLaVA-OneVision metadata {meta}"
            )
        check_tensors(self, item, self.num_tokens(item.modality, meta))

    def precomputed_metadata(self, modality: Modality, fields, settings: Mapping[str, Any]) -> bytes:
        """An image: `image_sizes`, its original (height, width) as HF names it. As for pixels, it is tiled
        (anyres) when it is the request's only image (`item_settings`), so its rows must be that mode's. A
        video: no field; its frame count follows from its rows (frames x pooled tile tokens + one newline)."""
        anyres = self.image_mode(modality, settings)
        if modality == Modality.VIDEO:
            per_frame = math.ceil(self.patches_per_side / 2) ** 2
            frames, rest = divmod(fields.rows - 1, per_frame)
            if frames < 1 or rest:
                raise fields.invalid(
                    f"'video_embeds' has {fields.rows} rows; a video has frames x {per_frame} + 1 rows"
                )
            return msgspec.msgpack.encode(VisionMeta(frames, (self.frames.height, self.frames.width)))
        from transformers.image_processing_utils import select_best_resolution

        height, width = fields.ints("image_sizes", 2, "the image's original (height, width)")
        size = self.image_processor.size
        tile, tiles = (size.height, size.width), 1  # the base tile; anyres adds the best-resolution grid
        if anyres:
            pinpoints = self.image_processor.image_grid_pinpoints
            best_h, best_w = select_best_resolution((height, width), pinpoints)
            tiles += (best_h // tile[0]) * (best_w // tile[1])
        return msgspec.msgpack.encode(VisionMeta(tiles, tile, (height, width), anyres))

    def precomputed_fields(self, modality: Modality, metadata: bytes) -> dict[str, torch.Tensor]:
        meta = self.meta(metadata)
        return {"image_sizes": torch.tensor(meta.original_hw)} if modality == Modality.IMAGE else {}

    def process(self, modality: Modality, media: Any, settings: Mapping[str, Any]) -> TowerInput:
        """Tower input for one decoded item: a PIL image, or a DecodedVideo."""
        anyres = self.image_mode(modality, settings)
        if modality == Modality.IMAGE:
            return self.process_image(media, anyres)
        if modality == Modality.VIDEO:
            return self.process_video(media.frames)
        raise UnsupportedMediaError(f"{modality.value} input is not supported by this model")

    def tower_input(self, modality: Modality, pixel_values: torch.Tensor, meta: VisionMeta) -> TowerInput:
        return TowerInput(
            modality,
            {"pixel_values": pixel_values},
            msgspec.msgpack.encode(meta),
            self.num_tokens(modality, meta),
            cost=meta.num_inputs,
        )

    def process_image(self, image: Image.Image, anyres: bool) -> TowerInput:
        from transformers.image_processing_backends import PilBackend

        # HF tiles an image only when its sample holds exactly one image (`batch_num_images`); its public
        # `preprocess` counts the images it is given, so the count goes to the backend's preprocess directly.
        batch_num_images = [1 if anyres else 2]
        try:
            out = PilBackend.preprocess(self.image_processor, [image], batch_num_images, return_tensors="pt")
        except ValueError as e:
            raise MediaDecodeError(f"image cannot be preprocessed: {e}") from e
        pixel_values = out["pixel_values"][0]  # (tiles, 3, H, W)
        meta = VisionMeta(
            pixel_values.shape[0],
            tuple(pixel_values.shape[-2:]),
            tuple(int(x) for x in out["image_sizes"][0]),
            anyres,
        )
        return self.tower_input(Modality.IMAGE, pixel_values, meta)

    def frame_pixels(self, frames: np.ndarray) -> torch.Tensor:
        return frame_pixels(self.image_processor, self.frames, frames)

    def process_video(self, frames: np.ndarray) -> TowerInput:
        if frames.ndim != 4 or frames.shape[0] == 0:
            raise MediaDecodeError("video has no frames")
        pixel_values = self.frame_pixels(frames)
        meta = VisionMeta(pixel_values.shape[0], (self.frames.height, self.frames.width))
        return self.tower_input(Modality.VIDEO, pixel_values, meta)

    def probe_item(self) -> tuple[Modality, Any]:
        return Modality.IMAGE, Image.new("RGB", (16, 16), (128, 128, 128))

    # -- prompt ---------------------------------------------------------------------------------------
    def expand(self, token_ids: list[int], items: list[Any]) -> ExpandedPrompt:
        return expand_placeholders(token_ids, items, self.placeholders)

    # -- weights and forward --------------------------------------------------------------------------
    def load_language_model(self, dtype: torch.dtype, attn_implementation: str) -> LanguageModel:
        return weights.load_nested_language_model(self.path, self.hf_config, dtype, attn_implementation)

    def load_tower(self, dtype: torch.dtype) -> torch.nn.Module:
        tower = Tower(self.hf_config, dtype)
        tensors: dict[str, torch.Tensor] = {}
        for name, prefixes in TOWER_PARTS:
            found = weights.renamed(weights.iter_prefixed(self.path, prefixes), NESTED_VISION)
            tensors.update({name + key: tensor for key, tensor in found.items()})
        weights.load_into(tower, tensors, "vision tower")
        return tower.eval()

    def encode(self, tower: torch.nn.Module, batch: list[TowerInput]) -> list[dict[str, torch.Tensor]]:
        device = tower.image_newline.device
        pixels = torch.cat([it.tensors["pixel_values"] for it in batch]).to(
            device, tower.dtype
        )  # (tiles, 3, H, W)
        features = tower.features(pixels)  # (tiles, P, hidden)
        out = []
        for item, feats in zip(batch, torch.split(features, [it.cost for it in batch]), strict=True):
            if item.modality == Modality.VIDEO:
                rows = tower.pack_video(feats)
            else:
                rows = tower.pack_image(feats, self.meta(item.metadata).original_hw)
            # Independent storage per item: each lives on in the cache on its own.
            out.append({MAIN: rows.clone()})
        return out


def frame_pixels(image_processor, s: FrameSettings, frames: np.ndarray) -> torch.Tensor:
    """frames (T, H, W, 3) uint8 RGB -> (T, 3, height, width) float32, as HF's video processors with settings `s`:
    each frame resized (stretched), rescaled and normalized by the image processor's own methods."""
    from transformers.image_utils import SizeDict

    size = SizeDict(height=s.height, width=s.width)
    out = []
    for frame in frames:
        pixels = image_processor.process_image(Image.fromarray(frame), do_convert_rgb=True)  # (3, H, W) uint8
        if s.do_resize:
            pixels = image_processor.resize(pixels, size, resample=s.resample)
        if s.do_rescale:
            pixels = image_processor.rescale(pixels, s.rescale_factor)
        if s.do_normalize:
            pixels = image_processor.normalize(pixels, s.image_mean, s.image_std)
        out.append(pixels)
    return torch.from_numpy(np.stack(out)).float()


def hf_video_inputs(family: Family, videos: list) -> dict[str, Any]:
    """HF's video-processor outputs for decoded videos, from our preprocessing (see hf_processor):
    `pixel_values_videos` (num_videos, frames, 3, H, W), as HF's model takes them (one tensor: the videos of a
    request need equal frame counts)."""
    return {"pixel_values_videos": torch.stack([family.frame_pixels(v.frames) for v in videos])}


def hf_processor(path: str, family: Family):
    """Hugging Face's own processor class for this checkpoint (the parity oracle's preprocessing): the PIL
    image processor (tiling, `batch_num_images` rule) and HF's placeholder expansion. HF's video processor
    needs torchvision, so video pixels come from our preprocessing (`PrecomputedVideos`, checked separately
    against the image processor)."""
    from transformers import AutoTokenizer, LlavaOnevisionImageProcessorPil, LlavaOnevisionProcessor

    from mmserve.testing.reference import PrecomputedVideos, allow_any_video_processor

    settings = {
        "num_image_tokens": family.patches_per_side**2,
        "vision_feature_select_strategy": family.strategy,
        "vision_aspect_ratio": family.aspect_ratio,
    }
    file = os.path.join(path, "processor_config.json")
    if os.path.exists(file):
        with open(file) as f:
            raw = json.load(f)
        settings.update({k: raw[k] for k in settings if raw.get(k) is not None})
    tokenizer = AutoTokenizer.from_pretrained(path)
    videos = PrecomputedVideos(lambda v: hf_video_inputs(family, v))
    with allow_any_video_processor():
        return LlavaOnevisionProcessor(
            image_processor=LlavaOnevisionImageProcessorPil.from_pretrained(path),
            tokenizer=tokenizer,
            video_processor=videos,
            chat_template=tokenizer.chat_template,
            **settings,
        )
