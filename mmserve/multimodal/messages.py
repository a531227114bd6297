"""OpenAI-style chat messages -> chat-template messages + the media references they carry.

Content parts: `text`, `image_url` ({"url": ...} or a bare string), `video_url`, `audio_url`, `input_audio`
({"data": base64, "format": "wav"}), and precomputed embeddings `image_embeds` / `video_embeds` /
`audio_embeds` (a base64 string, kept unparsed as an `EmbedsRef`: mmserve.multimodal.precomputed checks it
against the model family; the server refuses them without --enable-mm-embeds). Every media part becomes a
placeholder part ({"type": "image"} ...) in the template messages, so the chat template emits exactly one
placeholder per item. Malformed input raises ValueError naming the message and the part (HTTP 400 later).

Media parts as vLLM's clients send them: a `uuid` beside the media (the item's identity instead of its bytes'
hash; with no media, null or missing, the part refers to the item sent earlier with that uuid), an image's
`detail` ("low" downscales; in `image_url`, or beside it where vLLM reads it too): mmserve.multimodal.
media_options. vLLM ignores every other key of a part; here only those that cannot change the output are
(`IGNORED_PART_KEYS`, logged), any other is a 400 naming it.

Roles and message keys reach the template as vLLM passes them: any role string (custom roles such as
"ipython" are the template's to render or refuse), and keys other than `role`, `content`, `tool_calls` and
`tool_call_id` (OpenAI's `name`, `reasoning_content`, ...) are copied into the template message unchanged.

Tool calling: a `tool` message needs `tool_call_id` and text content; an assistant message may carry
`tool_calls` (content may then be null). They reach the template in the shape Hugging Face chat templates
expect: `function.arguments` parsed from its JSON string into a dict (Qwen templates render
`arguments | tojson`), the tool message as `{"role": "tool", "content": str, "tool_call_id": str}`.
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from mmserve.multimodal.items import Modality
from mmserve.multimodal.media import MediaRef
from mmserve.multimodal.media_options import check_uuid, detail_option
from mmserve.multimodal.precomputed import EmbedsRef, part_name

logger = logging.getLogger("mmserve.multimodal")

_URL_PARTS = {"image_url": Modality.IMAGE, "video_url": Modality.VIDEO, "audio_url": Modality.AUDIO}
_EMBEDS_PARTS = {part_name(m): m for m in Modality}
# Keys parse_messages reads itself; every other key of a message passes through to the template.
_OWN_KEYS = {"role", "content", "tool_calls", "tool_call_id"}
_PART_KEYS = {"text": {"type", "text"}, "input_audio": {"type", "input_audio", "uuid"}} | {
    k: {"type", k, "uuid"} for k in (*_URL_PARTS, *_EMBEDS_PARTS, "image_pil")
}
_PART_KEYS["image_url"] |= {"detail"}  # vLLM reads an image's detail beside its url object too
# Accepted on any part and ignored, because they cannot change the output: prompt-caching hints of
# Anthropic-style clients (this server caches prefixes by itself).
IGNORED_PART_KEYS = frozenset({"cache_control"})


@dataclass(frozen=True)
class MediaPart:
    """A media content part: where its bytes come from (None: a reference by `uuid` to an item sent before),
    the caller's identity for it, and its options (mmserve.multimodal.media_options, canonical)."""

    ref: MediaRef | None
    uuid: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


def _only(obj: dict[str, Any], allowed: set[str], where: str) -> None:
    """Refuse keys this server does not implement (never accept and ignore them)."""
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ValueError(f"{where}: {', '.join(map(repr, unknown))} not supported by this server")


def _url_of(part: dict[str, Any], key: str, where: str, by_uuid: bool) -> tuple[str | None, dict[str, Any]]:
    """A URL part's url and options. With `by_uuid` the url may be missing (null, an object without one, or
    empty, as vLLM reads them): the part refers to the item sent earlier with its uuid."""
    value = part.get(key)
    details = {where: part["detail"]} if "detail" in part else {}
    if isinstance(value, dict):
        _only(value, {"url", "detail"}, f"{where}.{key}")
        details |= {f"{where}.{key}": value["detail"]} if "detail" in value else {}
    if len(details) > 1:
        raise ValueError(f"{where}: 'detail' given both in '{key}' and beside it; give it once")
    options: dict[str, Any] = {}
    for dwhere, detail in details.items():
        if key != "image_url" and detail != "auto":
            raise ValueError(f"{dwhere}.detail: only images take a detail ('auto' or none here)")
        options = detail_option(detail, dwhere)
    url = value.get("url") if isinstance(value, dict) else value
    if by_uuid and url in (None, ""):
        return None, options
    if not isinstance(url, str) or not url:
        raise ValueError(
            f"{where}: '{key}' must be an object with a non-empty 'url' string (or null beside the 'uuid' of "
            "an item sent before)"
        )
    return url, options


def _uuid(part: dict[str, Any], where: str) -> str | None:
    value = part.get("uuid")
    return None if value is None else check_uuid(value, where)


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
            _only(part, {"type", "text"} | IGNORED_PART_KEYS, f"{where}.content[{j}]")
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
        raw = function.get("arguments")
        try:  # "" is what clients (and OpenAI) write for a call of a tool that takes no arguments
            arguments = {} if isinstance(raw, str) and not raw.strip() else json.loads(raw)
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


def _pil_part(part: dict[str, Any], allow_pil: bool, where: str, by_uuid: bool) -> MediaRef | None:
    from PIL import Image

    if not allow_pil:  # an HTTP request is JSON: it cannot carry a PIL image
        raise ValueError(
            f"{where}: 'image_pil' parts (a PIL image) are accepted by the offline Python API only; "
            "send the image as an 'image_url' part (a data: URL)"
        )
    if by_uuid and part.get("image_pil") is None:
        return None
    if not isinstance(part.get("image_pil"), Image.Image):
        raise ValueError(f"{where}: 'image_pil' must be a PIL.Image.Image")
    return pil_media_ref(part["image_pil"])


def _audio_part(part: dict[str, Any], where: str, by_uuid: bool) -> MediaRef | None:
    audio = part.get("input_audio")
    if by_uuid and (audio is None or (isinstance(audio, dict) and audio.get("data") in (None, ""))):
        return None
    if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
        raise ValueError(f"{where}: 'input_audio' must be an object with base64 'data'")
    _only(audio, {"data", "format"}, f"{where}.input_audio")
    fmt = audio.get("format") or "wav"
    return MediaRef.parse(f"data:audio/{fmt};base64,{audio['data']}")


def parse_messages(
    messages: Any, allow_pil: bool = False
) -> tuple[list[dict[str, Any]], list[tuple[Modality, MediaPart | EmbedsRef]]]:
    """Returns (messages for the chat template, media parts in prompt order). `allow_pil`: accept
    vLLM's `{"type": "image_pil", "image_pil": <PIL image>}` parts (the offline API; never over HTTP)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    template: list[dict[str, Any]] = []
    media: list[tuple[Modality, MediaPart | EmbedsRef]] = []
    ignored: set[str] = set()  # IGNORED_PART_KEYS the request set
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where} must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}.role must be a non-empty string, got {role!r}")
        if "tool_call_id" in message and role != "tool":
            raise ValueError(f"{where}: 'tool_call_id' belongs to a tool message")
        if "tool_calls" in message and role != "assistant":
            raise ValueError(f"{where}: 'tool_calls' belongs to an assistant message")
        passed = {k: v for k, v in message.items() if k not in _OWN_KEYS}
        if role == "tool":
            template.append({**passed, **_tool_message(message, where)})
            continue
        # `tool_calls: null` / `[]` (an echoed assistant message without calls) is the same as no key.
        calls = _tool_calls(message["tool_calls"], where) if message.get("tool_calls") is not None else []
        extra = {**passed, "tool_calls": calls} if calls else passed
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
                _only(part, _PART_KEYS[kind] | IGNORED_PART_KEYS, pwhere)
                ignored |= IGNORED_PART_KEYS & set(part)
            uuid = _uuid(part, pwhere) if kind in _PART_KEYS else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"{pwhere}: 'text' must be a string")
                parts.append({"type": "text", "text": part["text"]})
                continue
            if kind in _URL_PARTS:
                url, options = _url_of(part, kind, pwhere, uuid is not None)
                ref = None if url is None else MediaRef.parse(url)
                media.append((_URL_PARTS[kind], MediaPart(ref, uuid, options)))
            elif kind == "image_pil":
                pil = _pil_part(part, allow_pil, pwhere, uuid is not None)
                media.append((Modality.IMAGE, MediaPart(pil, uuid)))
            elif kind == "input_audio":
                media.append((Modality.AUDIO, MediaPart(_audio_part(part, pwhere, uuid is not None), uuid)))
            elif kind in _EMBEDS_PARTS:
                if uuid is not None:  # no cache holds a client's embedding to refer to, and it hashes itself
                    raise ValueError(f"{pwhere}: 'uuid' is not taken on precomputed embeddings ({kind})")
                media.append((_EMBEDS_PARTS[kind], EmbedsRef(part[kind], f"{pwhere} ({kind})")))
            else:
                raise ValueError(f"{pwhere}: unsupported content part type {kind!r}")
            parts.append({"type": media[-1][0].value})
        template.append({"role": role, "content": parts, **extra})
    if ignored:
        logger.warning("content part keys %s accepted and ignored (they cannot change the output)", ignored)
    return template, media
