"""Model families: the one seam between generic serving code and everything model-specific.

A family module (`mmserve/models/<name>.py`) owns a model family end to end: its processor (preprocess,
placeholder expansion, token counts, the settings that enter the content hash), loading its language model
and its tower, `encode(tower, batch)`, prompt positions (and the rope delta of decode positions), the extra
inputs its language model takes (DeepStack and the like), and how to build Hugging Face's own processor for
the parity oracle. Generic code (items, intake, cache, wire, runner, batcher) only calls the `ModelFamily`
methods below and carries item metadata as opaque bytes.

`FAMILIES` is the one table from HF `model_type` to the module; modules are imported on first use. The CLI's
`--arch` choices, the offline model kit and the HF reference helper read it too. Adding a family = one file
here, one entry in `mmserve/testing/tiny_models.py`, one line below (and one line in `tests/families.py` for
the shared test matrix); see docs/adding-a-model.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

from mmserve.models.layer_specs import LayerSpec
from mmserve.multimodal.items import MAIN, ExpandedPrompt, ItemEmbedding, Modality, TowerInput

# HF model_type -> module in mmserve.models
FAMILIES: dict[str, str] = {
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl",  # Qwen3-VL with sparse MoE blocks: nothing else differs for serving
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "llava_onevision": "llava_onevision",
    "qwen2_audio": "qwen2_audio",
    "qwen2_5_omni": "qwen_omni",  # the thinker only (text output)
    "qwen3_omni_moe": "qwen_omni",  # the thinker only: MoE, DeepStack
    "gemma3": "gemma3",
    "gemma4": "gemma4",
    "idefics3": "idefics3",
    "smolvlm": "idefics3",  # SmolVLM / SmolVLM2: Idefics3's tiles, and videos as frames of global images
    "mistral3": "mistral3",
    "internvl": "internvl",
    "minicpmv4_6": "minicpmv4_6",  # MiniCPM-V 4.6: sliced images, Qwen3.5's hybrid language model
    "glm4v": "glm4v",
    "glm4v_moe": "glm4v",  # GLM-4.5V: GLM-4.1V with sparse MoE blocks (transformers' modules)
}


class EmbeddingMismatch(ValueError):
    """An item embedding does not fit this model (another hidden size, a missing extra, wrong row count):
    typically an encoder serving another model. Ends only the request that carries it."""


@dataclass
class LanguageModel:
    """The decoder stack and the output head: everything the engine runs."""

    model: torch.nn.Module  # HF text model: embed_tokens, layers, norm, rotary_emb
    lm_head: torch.nn.Linear


class ModelFamily(Protocol):
    """One checkpoint's model-specific behaviour. Built by `load_family`; cheap (reads configs, no weights).

    Thread-safety: every method may be called from several threads at once (encoder job threads, the
    engine loop); implementations keep no mutable state after construction.
    """

    model_type: str
    modalities: frozenset[Modality]  # media the towers accept
    hidden_size: int  # rows of every embedding tensor are this wide (extras may differ, see extra_dims)
    extra_dims: dict[str, int]  # name -> width of every row-aligned extra tensor each item carries
    position_rows: int  # 3 for M-RoPE position ids (3, T), 1 for plain RoPE (T,)
    audio_sample_rate_hz: int | None  # the rate audio is decoded at, for audio families
    # What every decoder layer keeps (mmserve.models.layer_specs): drives the pools, the scheduler, the prefix
    # cache, the kernels and the P/D layout.
    layer_specs: tuple[LayerSpec, ...]
    # How the model writes tool calls (a name in mmserve.server.tool_parsers.PARSERS): the default of
    # --tool-call-parser when the checkpoint's chat template renders tools.
    tool_call_parser: str

    # -- processor ------------------------------------------------------------------------------------
    def item_settings(self, modalities: Sequence[Modality]) -> list[dict[str, Any]]:
        """Per-item processing settings that depend on the whole request (one dict per item, usually
        empty). They travel with each item to its encoder and enter its content hash."""
        ...

    def request_item_settings(
        self, modalities: Sequence[Modality], kwargs: Mapping[str, Any]
    ) -> list[dict[str, Any]]:
        """`item_settings` for a request with its own `mm_processor_kwargs` (vLLM's request field). Raises
        ValueError (400) for kwargs the family does not take (`CausalLM`: any)."""
        ...

    def video_audio_rate_hz(self, settings: Mapping[str, Any]) -> int | None:
        """The rate at which to decode the audio track of a video item with `settings`, or None for frames only
        (`CausalLM`); the decoded video then carries it as `DecodedVideo.audio`."""
        ...

    def hash_settings(self, modality: Modality, settings: Mapping[str, Any]) -> dict[str, Any]:
        """Every preprocessing setting that changes this item's embedding (enters the content hash).
        Raises MediaError (400) for unknown `settings`."""
        ...

    def process(self, modality: Modality, media: Any, settings: Mapping[str, Any]) -> TowerInput:
        """Tower input for one decoded item (PIL image, DecodedVideo, float32 audio samples). Raises
        MediaError subclasses (400) for media the model cannot take."""
        ...

    def input_pixels(self, modality: Modality, metadata: bytes) -> int:
        """Model-input pixels of an item (its frames' resized pixels), for --max-mm-pixels-per-prompt; 0 for
        audio."""
        ...

    def check_item(self, item: ItemEmbedding) -> None:
        """Raises EmbeddingMismatch unless `item` fits this model: hidden size, dtype, rows for its metadata,
        the extras every item must carry."""
        ...

    def precomputed_metadata(self, modality: Modality, fields: Any, settings: Mapping[str, Any]) -> bytes:
        """Metadata bytes of a client's precomputed embedding (--enable-mm-embeds), read from its named
        tensors with `fields.ints` / `fields.floats` (`mmserve.multimodal.precomputed.Fields`; `fields.rows`
        is the main embedding's row count): grids, sizes, lengths. `settings` are the item's
        `item_settings`. Raises `fields.invalid(...)` (400) for a missing or impossible field; `check_item`
        then ties the rows to the metadata."""
        ...

    def precomputed_fields(self, modality: Modality, metadata: bytes) -> dict[str, torch.Tensor]:
        """The inverse of `precomputed_metadata`: the named metadata tensors a client sends for an item with
        this metadata (to turn mmserve's own embeddings into content parts)."""
        ...

    def expand(self, token_ids: list[int], items: list[Any]) -> ExpandedPrompt:
        """Replace the k-th placeholder of each modality by the k-th item of that modality; sets each
        item's offset and span. Raises ValueError when placeholders and items do not match."""
        ...

    def positions(self, expanded: ExpandedPrompt) -> tuple[torch.Tensor, int]:
        """Position ids `(position_rows, L)` of the whole prompt and the rope delta: decode position of
        sequence index `i >= L` is `i + delta` on every row."""
        ...

    def probe_item(self) -> tuple[Modality, Any]:
        """A tiny decoded item of this family's main modality for encoder health probes."""
        ...

    def probe_items(self) -> list[tuple[Modality, Any]]:
        """A tiny decoded item of every modality the towers accept (`CausalLM`: `probe_item`'s, and gray frames
        or silence for the others): an encoder's `/health` encodes each."""
        ...

    # -- weights and forward --------------------------------------------------------------------------
    def load_language_model(self, dtype: torch.dtype, attn_implementation: str) -> LanguageModel:
        """Only the language model and its head (no tower weights are read)."""
        ...

    def load_tower(self, dtype: torch.dtype) -> torch.nn.Module:
        """Only the tower(s) and projector(s) (no language-model weights are read)."""
        ...

    def encode(self, tower: torch.nn.Module, batch: list[TowerInput]) -> list[dict[str, torch.Tensor]]:
        """One fused forward over `batch`; per item its tensors: MAIN `(num_tokens, hidden)` and the
        extras named in `extra_dims`, each with its own storage (they live on in caches)."""
        ...

    def lm_inputs(
        self, num_tokens: int, positions: torch.Tensor, rows: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        """Extra keyword arguments of the language model for one packed forward of `num_tokens` rows:
        `positions` (int64, increasing) are the packed rows holding item rows with extras, `rows[name]` those
        extras in the same order. Called only for families with extras and batches that hold some."""
        ...

    # -- what the language model computes beyond causal attention (defaults: `CausalLM`) ---------------
    logit_softcap: float | None  # logits = tanh(logits / cap) * cap after lm_head, where the model does so

    def token_inputs(self, language_model: torch.nn.Module, token_ids: torch.Tensor) -> dict[str, Any]:
        """Per-token keyword arguments of the language model for the packed rows' token ids `(1, T)` (items'
        tokens carry their pad values), e.g. Gemma 4's per-layer embeddings; {} for most families."""
        ...

    def bidirectional_blocks(self, expanded: ExpandedPrompt) -> list[tuple[int, int]]:
        """[start, end) of every run of tokens that attend to each other both ways (in the layers whose spec
        says `bidirectional_items`), in order, as transformers forms them; [] for causal families."""
        ...

    remaps_ids: bool  # whether `embed_ids` changes anything

    def embed_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The ids the language model looks up for `token_ids` (pad values pass through): Gemma 4 looks up its
        media placeholder tokens as `pad_token_id` wherever they occur, generated ones included."""
        ...


class CausalLM:
    """The defaults of the hooks above: a language model that attends causally, takes nothing per token beyond
    its embeddings, positions 0..L-1 and no extra inputs (`lm_inputs`), and caps no logits; and of a family's
    processor: no per-request item settings, the checkpoint's own tokenizer (at `self.path`); Hermes tool calls."""

    logit_softcap: float | None = None
    remaps_ids = False
    tool_call_parser = "hermes"

    @cached_property
    def tokenizer(self):
        """Built on first use: the API server and a language-only engine may never need it."""
        from mmserve.models.loader import load_tokenizer

        return load_tokenizer(self.path)

    def item_settings(self, modalities: Sequence[Modality]) -> list[dict[str, Any]]:
        return [{} for _ in modalities]

    def request_item_settings(
        self, modalities: Sequence[Modality], kwargs: Mapping[str, Any]
    ) -> list[dict[str, Any]]:
        """`item_settings` for a request with its own `mm_processor_kwargs`; a family that takes none refuses
        them (ValueError, 400)."""
        if kwargs:
            raise ValueError(f"this model takes no per-request mm_processor_kwargs (got {sorted(kwargs)})")
        return self.item_settings(modalities)

    def video_audio_rate_hz(self, settings: Mapping[str, Any]) -> int | None:
        """The rate to decode a video item's audio track at (None: its frames only; Qwen-Omni's
        audio-in-video items want it)."""
        return None

    def probe_items(self) -> list[tuple[Modality, Any]]:
        main, media = self.probe_item()
        out = [(main, media)]
        for modality in sorted(self.modalities - {main}, key=lambda m: m.value):
            out.append((modality, probe_media(modality, media if main == Modality.IMAGE else None, self)))
        return out

    def positions(self, expanded: ExpandedPrompt) -> tuple[torch.Tensor, int]:
        return sequential_positions(expanded)

    def lm_inputs(
        self, num_tokens: int, positions: torch.Tensor, rows: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        return {}

    def token_inputs(self, language_model, token_ids) -> dict[str, Any]:
        return {}

    def embed_ids(self, token_ids):
        return token_ids

    def bidirectional_blocks(self, expanded: ExpandedPrompt) -> list[tuple[int, int]]:
        return []


def probe_media(modality: Modality, image: Any, family: Any) -> Any:
    """A tiny decoded item of `modality`: two frames of `image` (else 56 x 56 gray) half a second apart for a
    video, 56 x 56 gray for an image, half a second of silence for audio."""
    import numpy as np
    from PIL import Image

    from mmserve.multimodal.media import DecodedVideo

    image = image if image is not None else Image.new("RGB", (56, 56), (128, 128, 128))
    if modality == Modality.IMAGE:
        return image
    if modality == Modality.VIDEO:
        frames = np.stack([np.asarray(image.convert("RGB"))] * 2)
        return DecodedVideo(frames, fps=2.0, duration_s=1.0, timestamps_s=(0.0, 0.5))
    return np.zeros(family.audio_sample_rate_hz // 2, dtype=np.float32)


def plain_setting(value: Any) -> Any:
    """A processor attribute as JSON-able data for a content hash (SizeDict / enum / tuple -> dict / int / list)."""
    from transformers.image_utils import SizeDict

    if isinstance(value, SizeDict):
        return {k: v for k, v in dict(value).items() if v is not None}
    if isinstance(value, tuple | list):
        return [plain_setting(v) for v in value]
    return int(value) if isinstance(value, int) else value  # IntEnum (resample) -> int


def item_runs(expanded: ExpandedPrompt, modalities: frozenset[Modality]) -> list[tuple[int, int]]:
    """[start, end) of the maximal runs of pad tokens of items of `modalities`: transformers' bidirectional blocks
    (runs of consecutive multimodal tokens; two items with no token between them form one run)."""
    runs: list[tuple[int, int]] = []
    ids = expanded.token_ids
    for item in sorted(expanded.items, key=lambda it: it.offset):
        if item.modality not in modalities:
            continue
        i = item.offset
        while i < item.end:
            if ids[i] != item.pad_value:
                i += 1
                continue
            j = i
            while j < item.end and ids[j] == item.pad_value:
                j += 1
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], j)
            else:
                runs.append((i, j))
            i = j
    return runs


def family_module(model_type: str) -> ModuleType:
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(FAMILIES)}")
    return importlib.import_module(f"mmserve.models.{FAMILIES[model_type]}")


def load_family(
    path: str, hf_config=None, mm_processor_kwargs: Mapping[str, Any] | None = None
) -> ModelFamily:
    """The family of the checkpoint in `path` (a local directory), configured from its files."""
    if hf_config is None:
        from mmserve.models.loader import load_hf_config

        hf_config = load_hf_config(path)
    module = family_module(hf_config.model_type)
    return module.Family(path, hf_config, dict(mm_processor_kwargs or {}))


def check_tensors(family: ModelFamily, item: ItemEmbedding, expected_rows: int) -> None:
    """The generic part of `check_item`: MAIN and exactly the family's extras, 2-D, one float dtype, the
    family's widths, `expected_rows` rows each. Raises EmbeddingMismatch naming the first problem."""
    where = f"{item.modality.value} embedding"
    names = set(item.tensors)
    wanted = {MAIN, *family.extra_dims}
    if names != wanted:
        missing, unexpected = sorted(wanted - names), sorted(names - wanted)
        raise EmbeddingMismatch(
            f"{where} has tensors {sorted(names)}; this model needs {sorted(wanted)} "
            f"(missing {missing}, unexpected {unexpected})"
        )
    dtype = item.tensors[MAIN].dtype
    widths = {MAIN: family.hidden_size, **family.extra_dims}
    for name, tensor in item.tensors.items():
        if tensor.dim() != 2 or tensor.shape[1] != widths[name]:
            raise EmbeddingMismatch(
                f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}; this model needs "
                f"(rows, {widths[name]}) (an encoder serving another model?)"
            )
        if tensor.shape[0] != expected_rows:
            raise EmbeddingMismatch(
                f"{where}: tensor {name!r} has {tensor.shape[0]} rows; its metadata needs {expected_rows}"
            )
        if tensor.dtype != dtype or not tensor.is_floating_point():
            raise EmbeddingMismatch(f"{where}: tensor {name!r} is {tensor.dtype}, main is {dtype}")


def expand_placeholders(
    token_ids: list[int],
    items: list[Any],
    placeholders: Mapping[Modality, int],
    render=None,
) -> ExpandedPrompt:
    """Replace the k-th placeholder token of each modality by the k-th item of that modality.

    `render(item, placeholder_id) -> (engine_ids, hf_ids)` gives an item's expansion (default: `num_tokens`
    pad values, and as many placeholder ids for HF); the item's span is its length. Sets offsets and spans.
    Raises ValueError when the number of placeholders and items differ.
    """
    by_modality = {m: [it for it in items if it.modality == m] for m in placeholders}
    for it in items:
        if it.modality not in placeholders:
            raise ValueError(f"this model takes no {it.modality.value} input")
    remaining = {m: iter(v) for m, v in by_modality.items()}
    counts = dict.fromkeys(placeholders, 0)
    token_to_modality = {tid: m for m, tid in placeholders.items()}
    engine_ids: list[int] = []
    hf_ids: list[int] = []
    ordered = []
    for tid in token_ids:
        modality = token_to_modality.get(tid)
        if modality is None:
            engine_ids.append(tid)
            hf_ids.append(tid)
            continue
        counts[modality] += 1
        item = next(remaining[modality], None)
        if item is None:
            break
        ours, theirs = (
            render(item, tid) if render else ([item.pad_value] * item.num_tokens, [tid] * item.num_tokens)
        )
        item.offset, item.span = len(engine_ids), len(ours)
        engine_ids.extend(ours)
        hf_ids.extend(theirs)
        ordered.append(item)
    for modality, expected in by_modality.items():
        if counts[modality] != len(expected):
            raise ValueError(
                f"prompt has {counts[modality]} {modality.value} placeholder(s) but "
                f"{len(expected)} {modality.value} item(s) were given"
            )
    return ExpandedPrompt(engine_ids, hf_ids, ordered)


def sequential_positions(expanded: ExpandedPrompt) -> tuple[torch.Tensor, int]:
    """Plain 1-D RoPE positions `(1, L)`: every token, item tokens included, advances by one."""
    import torch

    return torch.arange(len(expanded.token_ids)).view(1, -1), 0


def check_pixel_limit(family: ModelFamily, items: Sequence[ItemEmbedding], limit: int | None) -> None:
    """Raises MediaTooLargeError (413) if `items` hold more model-input pixels than `limit`
    (--max-mm-pixels-per-prompt)."""
    if limit is None or not items:
        return
    from mmserve.multimodal.errors import MediaTooLargeError

    total = sum(family.input_pixels(it.modality, it.metadata) for it in items)
    if total > limit:
        raise MediaTooLargeError(
            f"the request's media are {total} pixels after resizing; this server allows "
            f"at most {limit} per request (--max-mm-pixels-per-prompt)"
        )
