"""A chat request's messages as the engine takes them: prompt token ids (the chat template applied, one
placeholder token per media item) and the media items, checked against the server's limits and the model.

Shared by /v1/chat/completions and the chat form of /tokenize, so both see the same prompt.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

from mmserve.multimodal import precomputed
from mmserve.multimodal.errors import MediaError
from mmserve.multimodal.items import Modality
from mmserve.multimodal.media_options import request_options
from mmserve.multimodal.messages import MediaPart, parse_messages
from mmserve.multimodal.precomputed import EmbedsRef
from mmserve.server.app_state import AppState
from mmserve.server.protocol import APIError
from mmserve.server.tools import render_chat
from mmserve.transport.messages import MediaItemMsg


@dataclass
class ChatPrompt:
    prompt_ids: list[int]  # each media item still one placeholder token (the engine expands them)
    media: list[tuple[Modality, MediaPart | EmbedsRef]]  # in prompt order, with the request's media options
    settings: list[dict[str, Any]]  # the family's per-item settings, parallel to `media`

    @property
    def has_embeds(self) -> bool:
        return any(isinstance(ref, EmbedsRef) for _, ref in self.media)


def chat_prompt(
    state: AppState,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    tools: list[dict[str, Any]] | None = None,
    mm_processor_kwargs: dict[str, Any] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    media_io_kwargs: dict[str, Any] | None = None,
) -> ChatPrompt:
    """Raises APIError (400) for messages the server or the model cannot take. `media_io_kwargs` (vLLM's)
    become options of every item of their modality (mmserve.multimodal.media_options)."""
    cfg, family = state.cfg, state.family
    try:
        template, media = parse_messages(messages)
    except (ValueError, MediaError) as e:
        raise APIError(400, str(e), "invalid_messages") from e
    try:
        requested = request_options(media_io_kwargs, state.client.cfg.media)
    except ValueError as e:
        raise APIError(400, str(e), "invalid_media_io_kwargs") from e
    media = [
        (mod, replace(part, options={**requested.get(mod, {}), **part.options}))
        if isinstance(part, MediaPart)
        else (mod, part)
        for mod, part in media
    ]
    embeds = [ref.where for _, ref in media if isinstance(ref, EmbedsRef)]
    if embeds and not cfg.enable_mm_embeds:
        disabled = "precomputed embeddings are disabled on this server; start it with --enable-mm-embeds"
        raise APIError(400, f"{embeds[0]}: {disabled}", "embeds_disabled")
    limits = cfg.mm_limits
    for modality in {mod for mod, _ in media}:
        count = sum(1 for mod, _ in media if mod == modality)
        allowed = limits.get(modality.value, 0)
        if count > allowed:
            message = (
                f"{count} {modality.value} item(s) in the prompt; at most {allowed} allowed "
                "(--limit-mm-per-prompt)"
            )
            raise APIError(400, message, "too_many_items")
    try:
        text = render_chat(
            state.tokenizer, template, tools, add_generation_prompt, continue_final_message, template_kwargs
        )
    except Exception as e:  # a template that rejects the conversation (e.g. bad role order)
        raise APIError(400, f"chat template failed: {e}", "invalid_messages") from e
    prompt_ids = state.tokenize(text, add_special_tokens=add_special_tokens)
    for modality, _ in media:
        if modality not in family.modalities:
            raise APIError(
                400,
                f"this model takes no {modality.value} input (it takes "
                f"{', '.join(sorted(m.value for m in family.modalities))})",
                "unsupported_media",
            )
    modalities = [mod for mod, _ in media]
    try:
        settings = family.request_item_settings(modalities, mm_processor_kwargs or {})
    except ValueError as e:
        raise APIError(400, str(e), "invalid_mm_processor_kwargs") from e
    return ChatPrompt(prompt_ids, media, settings)


async def media_items(state: AppState, prompt: ChatPrompt, cache_salt: str | None) -> list[MediaItemMsg]:
    """The items as they travel to the engine; precomputed embeddings are decoded and checked here (400s).
    Media bytes are not fetched here: the engine or an encoder does that."""

    def build() -> list[MediaItemMsg]:
        return [
            precomputed.item_msg(state.family, mod, part, s, state.cfg.max_mm_embeds_bytes, cache_salt)
            if isinstance(part, EmbedsRef)
            else MediaItemMsg(
                mod.value,
                url=part.ref and part.ref.url,
                data=part.ref and part.ref.data,
                settings=s,
                uuid=part.uuid,
                options=part.options,
            )
            for (mod, part), s in zip(prompt.media, prompt.settings, strict=True)
        ]

    try:  # decoding and checking embeddings is CPU work: off the event loop
        return await asyncio.to_thread(build) if prompt.has_embeds else build()
    except MediaError as e:
        raise APIError.of(e.failure) from e
