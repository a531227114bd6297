"""OpenAI-style chat messages -> chat-template messages + the media references they carry.

Content parts: `text`, `image_url` ({"url": ...} or a bare string), `video_url`, `audio_url`, `input_audio`
({"data": base64, "format": "wav"}), and precomputed embeddings `image_embeds` / `video_embeds` /
`audio_embeds` (a base64 string, kept unparsed as an `EmbedsRef`: mmserve.multimodal.precomputed checks it
against the model family; the server refuses them without --enable-mm-embeds). Every media part becomes a
placeholder part ({"type": "image"} ...) in the template messages, so the chat template emits exactly one
placeholder per item. Malformed input raises ValueError naming the message and the part (HTTP 400 later).
"""

from __future__ import annotations

from typing import Any

from mmserve.multimodal.items import Modality
from mmserve.multimodal.media import MediaRef
from mmserve.multimodal.precomputed import EmbedsRef, part_name

_URL_PARTS = {"image_url": Modality.IMAGE, "video_url": Modality.VIDEO, "audio_url": Modality.AUDIO}
_EMBEDS_PARTS = {part_name(m): m for m in Modality}
_ROLES = {"system", "user", "assistant", "tool", "developer"}
_PART_KEYS = {"text": {"type", "text"}, "input_audio": {"type", "input_audio"}} | {
    k: {"type", k} for k in (*_URL_PARTS, *_EMBEDS_PARTS)
}


def _only(obj: dict[str, Any], allowed: set[str], where: str) -> None:
    """Refuse keys this server does not implement (never accept and ignore them)."""
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ValueError(f"{where}: {', '.join(map(repr, unknown))} not supported by this server")


def _url_of(part: dict[str, Any], key: str, where: str) -> str:
    value = part.get(key)
    if isinstance(value, dict):
        _only(value, {"url", "detail"}, f"{where}.{key}")
        # OpenAI's image `detail` picks a resolution; here the processor settings do, so only "auto" is honest.
        if value.get("detail", "auto") != "auto":
            raise ValueError(
                f"{where}.{key}.detail: only 'auto' is supported (resolution follows the model's processor)"
            )
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}: '{key}' must be an object with a non-empty 'url' string")
    return url


def parse_messages(
    messages: Any,
) -> tuple[list[dict[str, Any]], list[tuple[Modality, MediaRef | EmbedsRef]]]:
    """Returns (messages for the chat template, media references in prompt order)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    template: list[dict[str, Any]] = []
    media: list[tuple[Modality, MediaRef | EmbedsRef]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where} must be an object")
        _only(message, {"role", "content"}, where)
        role = message.get("role")
        if role not in _ROLES:
            raise ValueError(f"{where}.role must be one of {sorted(_ROLES)}, got {role!r}")
        content = message.get("content")
        if content is None:
            content = ""
        if isinstance(content, str):
            template.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ValueError(f"{where}.content must be a string or a list of content parts")
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            pwhere = f"{where}.content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(part, dict) and kind in _PART_KEYS:
                _only(part, _PART_KEYS[kind], pwhere)
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"{pwhere}: 'text' must be a string")
                parts.append({"type": "text", "text": part["text"]})
            elif kind in _URL_PARTS:
                modality = _URL_PARTS[kind]
                media.append((modality, MediaRef.parse(_url_of(part, kind, pwhere))))
                parts.append({"type": modality.value})
            elif kind in _EMBEDS_PARTS:
                modality = _EMBEDS_PARTS[kind]
                media.append((modality, EmbedsRef(part[kind], f"{pwhere} ({kind})")))
                parts.append({"type": modality.value})
            elif kind == "input_audio":
                audio = part.get("input_audio")
                if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
                    raise ValueError(f"{pwhere}: 'input_audio' must be an object with base64 'data'")
                _only(audio, {"data", "format"}, f"{pwhere}.input_audio")
                fmt = audio.get("format") or "wav"
                media.append((Modality.AUDIO, MediaRef.parse(f"data:audio/{fmt};base64,{audio['data']}")))
                parts.append({"type": "audio"})
            else:
                raise ValueError(f"{pwhere}: unsupported content part type {kind!r}")
        template.append({"role": role, "content": parts})
    return template, media
