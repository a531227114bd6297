"""How many prompt tokens a chat prompt's media items become, without running any tower.

Each item goes through its family's own preprocessing (`ModelFamily.process`: for an image, the resize that
fixes its patch grid), which gives its token count and metadata; the family's `expand` then places the items
exactly as the engine will. So the count is the engine's `usage.prompt_tokens` for every family (Qwen3-VL's
per-frame timestamps included), at the cost of fetching, decoding and preprocessing the media (CPU work:
callers run this on a thread).
"""

from __future__ import annotations

from mmserve.multimodal import media_options, precomputed
from mmserve.multimodal.errors import MediaError, MediaNotCachedError
from mmserve.multimodal.items import ExpandedPrompt, Modality, MultimodalItem
from mmserve.multimodal.media import load_bytes
from mmserve.multimodal.messages import MediaPart
from mmserve.multimodal.precomputed import EmbedsRef
from mmserve.server.app_state import AppState
from mmserve.server.chat_prompt import ChatPrompt

_NO_HASH = bytes(16)  # pad values do not matter for counting


def expand_media(state: AppState, prompt: ChatPrompt) -> ExpandedPrompt:
    """The prompt with every media placeholder expanded as the engine will. Raises MediaError (400) naming
    the item ("image #2: ...") for media that cannot be fetched or decoded, ValueError when placeholders and
    items do not match."""
    items, seen = [], {}
    for (modality, ref), settings in zip(prompt.media, prompt.settings, strict=True):
        seen[modality] = seen.get(modality, 0) + 1
        try:
            items.append(_item(state, modality, ref, settings))
        except MediaError as e:
            raise type(e)(str(e), item=f"{modality.value} #{seen[modality]}") from e
    return state.family.expand(prompt.prompt_ids, items)


def _item(state: AppState, modality: Modality, part: MediaPart | EmbedsRef, settings) -> MultimodalItem:
    family = state.family
    if isinstance(part, EmbedsRef):
        cfg = state.cfg
        return MultimodalItem.of(
            precomputed.build_item(family, modality, part, settings, cfg.max_mm_embeds_bytes)
        )
    if part.ref is None:  # the embedding caches that hold it are the engine's and the encoders', not ours
        raise MediaNotCachedError(f"uuid {part.uuid!r} alone cannot be counted here; send the media with it")
    media_cfg = state.client.cfg.media
    data = load_bytes(part.ref, media_cfg)
    media = media_options.decode(family, modality, data, settings, media_cfg, part.options)
    tower_input = family.process(modality, media, settings)
    return MultimodalItem(modality, _NO_HASH, tower_input.num_tokens, tower_input.metadata)
