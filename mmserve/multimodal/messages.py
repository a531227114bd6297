"""OpenAI-style chat messages -> chat-template messages + the media references they carry.

Content parts: `text`, `image_url` ({"url": ...} or a bare string), `video_url`, `audio_url`, `input_audio`
({"data": base64, "format": "wav"}), and precomputed embeddings `image_embeds` / `video_embeds` /
`audio_embeds` (a base64 string, kept unparsed as an `EmbedsRef`: mmserve.multimodal.precomputed checks it
against the model family; the server refuses them without --enable-mm-embeds). Every media part becomes a
placeholder part ({"type": "image"} ...) in the template messages, so the chat template emits exactly one
placeholder per item. Malformed input raises ValueError naming the message and the part (HTTP 400 later).

Tool calling: a `tool` message needs `tool_call_id` and text content; an assistant message may carry
`tool_calls` (content may then be null). They reach the template in the shape Hugging Face chat templates
expect: `function.arguments` parsed from its JSON string into a dict (Qwen templates render
`arguments | tojson`), the tool message as `{"role": "tool", "content": str, "tool_call_id": str}`.
"""

from __future__ import annotations

import io
import json
from typing import Any

from mmserve.multimodal.items import Modality
from mmserve.multimodal.media import MediaRef
from mmserve.multimodal.precomputed import EmbedsRef, part_name

_URL_PARTS = {"image_url": Modality.IMAGE, "video_url": Modality.VIDEO, "audio_url": Modality.AUDIO}
_EMBEDS_PARTS = {part_name(m): m for m in Modality}
_ROLES = {"system", "user", "assistant", "tool", "developer"}
_MESSAGE_KEYS = {"tool": {"role", "content", "tool_call_id"}, "assistant": {"role", "content", "tool_calls"}}
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


def _tool_message(message: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise ValueError(f"{where}.tool_call_id must be a non-empty string (the id of the call answered)")
    content = message.get("content")
    if isinstance(content, list):  # text parts only: the templates render a tool result as one string
        texts = []
        for j, part in enumerate(content):
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(text, str):
                raise ValueError(f"{where}.content[{j}]: a tool message takes text parts only")
            _only(part, {"type", "text"}, f"{where}.content[{j}]")
            texts.append(text)
        content = "".join(texts)
    if not isinstance(content, str):
        raise ValueError(f"{where}.content must be a string or a list of text parts")
    return {"role": "tool", "content": content, "tool_call_id": call_id}


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    where = f"{where}.tool_calls"
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list")
    out = []
    for k, call in enumerate(calls):
        cwhere = f"{where}[{k}]"
        if not isinstance(call, dict):
            raise ValueError(f"{cwhere} must be an object")
        _only(call, {"id", "type", "function"}, cwhere)
        if call.get("type", "function") != "function":
            raise ValueError(f"{cwhere}.type must be 'function'")
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise ValueError(f"{cwhere}.id must be a non-empty string")
        function = call.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{cwhere}.function must be an object with 'name' and 'arguments'")
        _only(function, {"name", "arguments"}, f"{cwhere}.function")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"{cwhere}.function.name must be a non-empty string")
        try:
            arguments = json.loads(function.get("arguments"))
        except (TypeError, ValueError):
            arguments = None
        if not isinstance(arguments, dict):
            raise ValueError(f"{cwhere}.function.arguments must be a string holding a JSON object")
        function = {"name": function["name"], "arguments": arguments}
        out.append({"id": call["id"], "type": "function", "function": function})
    return out


def pil_media_ref(image: Any) -> MediaRef:
    """A PIL image as an in-process ref: its lossless PNG encoding (the encoder hashes and decodes bytes)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return MediaRef.from_bytes(buf.getvalue())


def _pil_part(part: dict[str, Any], allow_pil: bool, where: str) -> MediaRef:
    from PIL import Image

    if not allow_pil:  # an HTTP request is JSON: it cannot carry a PIL image
        raise ValueError(
            f"{where}: 'image_pil' parts (a PIL image) are accepted by the offline Python API only; "
            "send the image as an 'image_url' part (a data: URL)"
        )
    if not isinstance(part.get("image_pil"), Image.Image):
        raise ValueError(f"{where}: 'image_pil' must be a PIL.Image.Image")
    return pil_media_ref(part["image_pil"])


def parse_messages(
    messages: Any, allow_pil: bool = False
) -> tuple[list[dict[str, Any]], list[tuple[Modality, MediaRef | EmbedsRef]]]:
    """Returns (messages for the chat template, media references in prompt order). `allow_pil`: accept
    vLLM's `{"type": "image_pil", "image_pil": <PIL image>}` parts (the offline API; never over HTTP)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    template: list[dict[str, Any]] = []
    media: list[tuple[Modality, MediaRef | EmbedsRef]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where} must be an object")
        role = message.get("role")
        if role not in _ROLES:
            raise ValueError(f"{where}.role must be one of {sorted(_ROLES)}, got {role!r}")
        _only(message, _MESSAGE_KEYS.get(role, {"role", "content"}), where)
        if role == "tool":
            template.append(_tool_message(message, where))
            continue
        # `tool_calls: null` / `[]` (an echoed assistant message without calls) is the same as no key.
        calls = _tool_calls(message["tool_calls"], where) if message.get("tool_calls") is not None else []
        extra = {"tool_calls": calls} if calls else {}
        content = message.get("content")
        if content is None:
            content = ""
        if isinstance(content, str):
            template.append({"role": role, "content": content, **extra})
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
            elif kind == "image_pil":
                _only(part, {"type", "image_pil"}, pwhere)
                media.append((Modality.IMAGE, _pil_part(part, allow_pil, pwhere)))
                parts.append({"type": "image"})
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
        template.append({"role": role, "content": parts, **extra})
    return template, media
