"""MiniCPM-V 4.6 (`minicpmv4_6`): sliced high-resolution images and video frames through a NaViT-style ViT with a
window-attention merger after a middle layer and a 2x2 merger, under Qwen3.5's hybrid language model (Gated
DeltaNet layers around gated full attention; the same layer kinds as `qwen3_5`) with plain 1-D positions.

- Images: transformers' `MiniCPMV4_6ImageProcessorPil`. An image is an overview (resized to about
  `scale_resolution`^2 pixels, sides multiples of 4 patches) and, when it is larger than that, a grid of at most
  `max_slice_nums` slices of the image resized to the grid (`get_sliced_grid`). Every unit (overview, slice)
  becomes h x w / 16 tokens (h, w in patches; `downsample_mode` "4x": / 4). `max_slice_nums` can be set for the
  server (`--mm-processor-kwargs '{"max_slice_nums": 4}'`); it and every other setting that changes the units
  enter the content hash.
- Video: transformers' video processor needs torchvision, so every frame goes through the image processor with
  the video processor's settings (`video_preprocessor_config.json`, e.g. its own `max_slice_nums`); the frames
  are the ones mmserve's decoder samples. Sub-second frame stacking (`stack_frames` > 1) is refused at load.
- Expansion: transformers' processor writes text for each placeholder (`<|image_pad|>` / `<|video_pad|>`):
  `<image_id>k</image_id>` (k: the item's index among the prompt's items of its modality, `use_image_id`), then
  per frame `<image>` + overview tokens + `</image>` and the slices' `<slice>` + tokens + `</slice>`, grid rows
  joined by "\\n". It tokenizes together with the prompt around it: expanded through the tokenizer
  (`text_expansion`).
- Tower: transformers' `vision_tower` and `merger`, run as `MiniCPMV4_6Model.get_image_features` (borrowed as a
  method): one packed forward over every unit of a batch (attention within each unit, the window merger's
  attention within each 2x2 window).
- Positions: transformers' model computes none of its own: 0..L-1, item tokens included.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from typing import Any

import msgspec
import torch
from PIL import Image

from mmserve.models import weights
from mmserve.models.family import CausalLM, EmbeddingMismatch, LanguageModel, check_tensors, plain_setting
from mmserve.models.layer_specs import layer_specs_from_hf
from mmserve.models.text_expansion import expand_by_text
from mmserve.multimodal.errors import MediaDecodeError, UnsupportedMediaError
from mmserve.multimodal.items import MAIN, ExpandedPrompt, ItemEmbedding, Modality, TowerInput

LINEAR_ATTENTION = "Qwen3_5GatedDeltaNet"  # the language model is transformers' `qwen3_5_text`
OVERRIDES = ("max_slice_nums",)  # what `--mm-processor-kwargs` may set (images and video frames alike)
# Processor attributes that change the units' pixels or sizes (all enter the content hash).
SETTINGS = (
    "max_slice_nums",
    "scale_resolution",
    "patch_size",
    "slice_mode",
    "downsample_mode",
    "do_resize",
    "resample",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_convert_rgb",
)


class VisionMeta(msgspec.Struct, frozen=True, array_like=True):
    """An image (one frame) or a video: the decoded frame size, the slice grid (rows, cols; (0, 0) without slices),
    the (height, width) in patches of a frame's units (overview first, then the slices row by row), frames."""

    original_hw: tuple[int, int]
    grid: tuple[int, int]
    sizes: tuple[tuple[int, int], ...]
    frames: int = 1


class Tower(torch.nn.Module):
    """transformers' `vision_tower` (ViT with the window-attention merger) and `merger` (2x2 + projection)."""

    def __init__(self, config, vision_tower: torch.nn.Module, merger: torch.nn.Module) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = vision_tower
        self.merger = merger

    @property
    def dtype(self) -> torch.dtype:
        return self.vision_tower.dtype

    def forward(self, pixel_values: torch.Tensor, target_sizes: torch.Tensor) -> list[torch.Tensor]:
        """(1, 3, patch, sum of units' patches x patch) packed pixels and (units, 2) patch grids -> every unit's
        rows, as `MiniCPMV4_6Model.get_image_features`."""
        from transformers.models.minicpmv4_6.modeling_minicpmv4_6 import MiniCPMV4_6Model

        out = MiniCPMV4_6Model.get_image_features(self, pixel_values, target_sizes, return_dict=True)
        return list(out.pooler_output)


class Family(CausalLM):
    """MiniCPM-V 4.6 (see module docstring)."""

    tool_call_parser = "qwen3_coder"  # Qwen3.5's language model and its XML tool calls
    modalities = frozenset({Modality.IMAGE, Modality.VIDEO})
    position_rows = 1
    extra_dims: dict[str, int] = {}
    audio_sample_rate_hz = None

    def __init__(self, path: str, hf_config, mm_processor_kwargs: Mapping[str, Any]) -> None:
        unknown = set(mm_processor_kwargs) - set(OVERRIDES)
        if unknown:
            raise ValueError(
                f"unknown mm processor settings {sorted(unknown)}; MiniCPM-V 4.6 takes {list(OVERRIDES)}"
            )
        self.path = path
        self.hf_config = hf_config
        self.model_type = hf_config.model_type
        self.overrides = dict(mm_processor_kwargs)
        text = hf_config.get_text_config()
        self.hidden_size = text.hidden_size
        self.layer_specs = layer_specs_from_hf(text, LINEAR_ATTENTION)
        self.placeholders = {
            Modality.IMAGE: hf_config.image_token_id,
            Modality.VIDEO: hf_config.video_token_id,
        }
        self.downsample_mode = hf_config.downsample_mode

    # -- processor ------------------------------------------------------------------------------------
    @cached_property
    def image_processor(self):
        """transformers' PIL processor of the checkpoint, with the server's overrides; built on first use."""
        from transformers import MiniCPMV4_6ImageProcessorPil

        return MiniCPMV4_6ImageProcessorPil.from_pretrained(self.path, **self.overrides)

    @cached_property
    def settings(self) -> dict[Modality, dict[str, Any]]:
        """Per modality, the processor settings that shape its units: the image processor's, and for video the
        video processor's (transformers' class reads its config without torchvision; only its processing needs
        it). Raises ValueError for what this family does not do."""
        from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor

        video = MiniCPMV4_6VideoProcessor.from_pretrained(self.path, **self.overrides)
        if (video.stack_frames or 1) > 1:
            raise ValueError(
                "MiniCPM-V 4.6 videos with stacked sub-second frames (stack_frames > 1) are not supported"
            )
        out = {}
        for modality, proc in ((Modality.IMAGE, self.image_processor), (Modality.VIDEO, video)):
            out[modality] = {k: getattr(proc, k) for k in SETTINGS}
            if out[modality]["downsample_mode"] != self.downsample_mode or not out[modality]["do_resize"]:
                raise ValueError(
                    f"the {modality.value} processor's downsample_mode / do_resize must be the model's "
                    f"({self.downsample_mode!r}, true); got {out[modality]['downsample_mode']!r}, "
                    f"{out[modality]['do_resize']}"
                )
        return out

    def check_settings(self, settings: Mapping[str, Any]) -> None:
        if settings:
            raise UnsupportedMediaError(f"unknown item settings {sorted(settings)} for this model")

    def hash_settings(self, modality: Modality, settings: Mapping[str, Any]) -> dict[str, Any]:
        self.check_settings(settings)
        return {k: plain_setting(v) for k, v in self.settings[modality].items()}

    @property
    def token_divisor(self) -> int:
        return 4 if self.downsample_mode == "4x" else 16

    def meta(self, metadata: bytes) -> VisionMeta:
        return msgspec.msgpack.decode(metadata, type=VisionMeta)

    def unit_tokens(self, meta: VisionMeta) -> list[int]:
        """Tokens of each unit of one frame (overview, then the slices)."""
        return [h * w // self.token_divisor for h, w in meta.sizes]

    def num_tokens(self, meta: VisionMeta) -> int:
        return meta.frames * sum(self.unit_tokens(meta))

    def layout(self, modality: Modality, original_hw: tuple[int, int]) -> VisionMeta:
        """The units of a frame of `original_hw` pixels, by the image processor's own formulas (no pixels)."""
        s, proc = self.settings[modality], self.image_processor
        grid = (
            proc.get_sliced_grid(original_hw, s["max_slice_nums"], s["scale_resolution"])
            if s["slice_mode"]
            else None
        )
        resize = dict(scale_resolution=s["scale_resolution"], patch_size=s["patch_size"])
        h, w = proc.find_best_resize(
            original_hw, **resize, downsample_mode=s["downsample_mode"], allow_upscale=not grid
        )
        p = s["patch_size"]
        sizes = [(h // p, w // p)]
        if grid:
            rh, rw = proc.get_refine_size(
                original_hw, grid, **resize, downsample_mode=s["downsample_mode"], allow_upscale=True
            )
            sizes += [(rh // grid[0] // p, rw // grid[1] // p)] * (grid[0] * grid[1])
        return VisionMeta(original_hw, tuple(grid or (0, 0)), tuple(sizes))

    def input_pixels(self, modality: Modality, metadata: bytes) -> int:
        meta = self.meta(metadata)
        p = self.settings[modality]["patch_size"]
        return meta.frames * sum(h * w for h, w in meta.sizes) * p * p

    def check_item(self, item: ItemEmbedding) -> None:
        try:
            meta = self.meta(item.metadata)
        except msgspec.DecodeError as e:
            raise EmbeddingMismatch(
                f"{item.modality.value} embedding has no valid MiniCPM-V metadata: {e}"
            ) from e
        rows, cols = meta.grid
        units = 1 + rows * cols
        if (
            meta.frames < 1
            or min(rows, cols) < 0
            or len(meta.sizes) != units
            or min(map(min, meta.sizes)) < 1
        ):
            raise EmbeddingMismatch(f"{item.modality.value} embedding has invalid MiniCPM-V metadata {meta}")
        check_tensors(self, item, self.num_tokens(meta))

    # Precomputed embeddings: a frame's decoded size decides its units (the processor's formulas), hence its rows.
    FIELDS = {Modality.IMAGE: "image_sizes", Modality.VIDEO: "video_sizes"}

    def precomputed_metadata(self, modality: Modality, fields, settings: Mapping[str, Any]) -> bytes:
        """An image: `image_sizes`, its decoded (height, width); a video: `video_sizes`, a frame's (height, width),
        its frame count following from the rows."""
        self.check_settings(settings)
        hw = fields.ints(self.FIELDS[modality], 2, "the decoded (height, width)")
        meta = self.layout(modality, hw)
        per_frame = self.num_tokens(meta)
        frames, rest = divmod(fields.rows, per_frame)
        if frames < 1 or rest or (modality == Modality.IMAGE and frames != 1):
            unit = "a frame" if modality == Modality.VIDEO else "the image"
            raise fields.invalid(
                f"'{modality.value}_embeds' has {fields.rows} rows; {unit} of {hw[0]} x {hw[1]} pixels makes "
                f"{per_frame} rows{' (a video: frames x those)' if modality == Modality.VIDEO else ''}"
            )
        return msgspec.msgpack.encode(VisionMeta(meta.original_hw, meta.grid, meta.sizes, frames))

    def precomputed_fields(self, modality: Modality, metadata: bytes) -> dict[str, torch.Tensor]:
        return {self.FIELDS[modality]: torch.tensor(self.meta(metadata).original_hw)}

    def process(self, modality: Modality, media: Any, settings: Mapping[str, Any]) -> TowerInput:
        self.check_settings(settings)
        if modality == Modality.IMAGE:
            frames = [media]
        elif modality == Modality.VIDEO:
            frames = [Image.fromarray(f) for f in media.frames]
            if not frames:
                raise MediaDecodeError("video has no frames")
        else:
            raise UnsupportedMediaError(f"{modality.value} input is not supported by this model")
        s = {k: v for k, v in self.settings[modality].items() if k != "do_resize"}
        try:
            out = self.image_processor(images=frames, return_tensors="pt", **s)
        except ValueError as e:
            raise MediaDecodeError(f"{modality.value} cannot be preprocessed: {e}") from e
        sizes = [tuple(int(v) for v in hw) for hw in out["target_sizes"].tolist()]
        units = len(sizes) // len(frames)
        grid = tuple(int(v) for v in out["grids"][0])
        hw = (frames[0].height, frames[0].width)
        meta = VisionMeta(hw, grid, tuple(sizes[:units]), len(frames))
        tensors = {"pixel_values": out["pixel_values"], "target_sizes": out["target_sizes"]}
        return TowerInput(modality, tensors, msgspec.msgpack.encode(meta), self.num_tokens(meta), len(sizes))

    def probe_item(self) -> tuple[Modality, Any]:
        return Modality.IMAGE, Image.new("RGB", (16, 16), (128, 128, 128))

    # -- prompt ---------------------------------------------------------------------------------------
    def render(self, item, index: int) -> str:
        """transformers' `MiniCPMV4_6Processor` replacement text of the `index`-th item of its modality."""
        tok, meta = self.tokenizer, self.meta(item.metadata)
        pad = tok.convert_ids_to_tokens(self.placeholders[item.modality])
        counts = self.unit_tokens(meta)
        frame = f"{tok.image_start_token}{pad * counts[0]}{tok.image_end_token}"
        rows, cols = meta.grid
        slices = [f"{tok.slice_start_token}{pad * n}{tok.slice_end_token}" for n in counts[1:]]
        frame += "\n".join("".join(slices[r * cols : (r + 1) * cols]) for r in range(rows))
        prefix = f"{tok.image_id_start_token}{index}{tok.image_id_end_token}" if self.use_image_id else ""
        return prefix + frame * meta.frames

    @cached_property
    def use_image_id(self) -> bool:
        return bool(self.image_processor.use_image_id)

    def runs(self, item) -> list[int]:
        """Its runs of placeholder tokens in `render`'s text: one per unit of every frame."""
        meta = self.meta(item.metadata)
        return self.unit_tokens(meta) * meta.frames

    def expand(self, token_ids: list[int], items: list[Any]) -> ExpandedPrompt:
        index = {}
        for modality in self.placeholders:
            for k, it in enumerate(it for it in items if it.modality == modality):
                index[id(it)] = k
        render = lambda it: self.render(it, index[id(it)])  # noqa: E731
        return expand_by_text(
            self.tokenizer, token_ids, items, self.placeholders, render, self.runs, self.placeholders
        )

    # -- weights and forward --------------------------------------------------------------------------
    def load_language_model(self, dtype: torch.dtype, attn_implementation: str) -> LanguageModel:
        return weights.load_nested_language_model(self.path, self.hf_config, dtype, attn_implementation)

    def load_tower(self, dtype: torch.dtype) -> torch.nn.Module:
        parts = {"model.vision_tower": "sdpa", "model.merger": None}
        model = weights.load_tower_parts(self.path, self.hf_config, dtype, parts)
        return Tower(model.config, model.model.vision_tower, model.model.merger).eval()

    def encode(self, tower: torch.nn.Module, batch: list[TowerInput]) -> list[dict[str, torch.Tensor]]:
        device = next(tower.parameters()).device
        pixels = torch.cat([it.tensors["pixel_values"] for it in batch], dim=-1).to(device, tower.dtype)
        sizes = torch.cat([it.tensors["target_sizes"] for it in batch]).to(device)
        units = tower(pixels, sizes)  # every unit's (tokens, hidden), in order
        out, start = [], 0
        for it in batch:
            out.append({MAIN: torch.cat(units[start : start + it.cost]).clone()})
            start += it.cost
        return out


def hf_video_inputs(family: Family, videos: list) -> dict[str, Any]:
    """HF's video-processor outputs for decoded videos, from our preprocessing (see hf_processor)."""
    items = [family.process(Modality.VIDEO, v, {}) for v in videos]
    metas = [family.meta(it.metadata) for it in items]
    grids = [m.grid for m in metas for _ in range(m.frames)]
    return {
        "pixel_values_videos": torch.cat([it.tensors["pixel_values"] for it in items], dim=-1),
        "target_sizes_videos": torch.cat([it.tensors["target_sizes"] for it in items]),
        "grids_videos": torch.tensor(grids, dtype=torch.int32),
        "num_patches_per_frame": torch.tensor([r * c + 1 for r, c in grids], dtype=torch.int32),
        "num_frames_per_video": [m.frames for m in metas],
    }


def hf_processor(path: str, family: Family):
    """transformers' own `MiniCPMV4_6Processor` (the parity oracle's image preprocessing and expansion), its PIL
    image processor with the family's overrides. HF's video processor needs torchvision, so video pixels come from
    our preprocessing (`PrecomputedVideos`, checked frame by frame against the image processor)."""
    from transformers import AutoTokenizer, MiniCPMV4_6ImageProcessorPil, MiniCPMV4_6Processor

    from mmserve.testing.reference import PrecomputedVideos, allow_any_video_processor

    tokenizer = AutoTokenizer.from_pretrained(path)
    video = family.settings[Modality.VIDEO]
    videos = PrecomputedVideos(
        lambda v: hf_video_inputs(family, v),
        slice_mode=video["slice_mode"],
        downsample_mode=video["downsample_mode"],
    )
    with allow_any_video_processor():
        return MiniCPMV4_6Processor(
            image_processor=MiniCPMV4_6ImageProcessorPil.from_pretrained(path, **family.overrides),
            video_processor=videos,
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )
