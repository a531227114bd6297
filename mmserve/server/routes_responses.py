"""A minimal OpenAI Responses API: `POST /v1/responses` with text and image input, streamed or not.

The request is translated into a chat request (`input` items become messages, `instructions` a system
message, `max_output_tokens` max_tokens, `reasoning.effort` reasoning_effort) and runs through the same path;
the answer is a `response` object with one `message` output item, or its event stream (`response.created` ...
`response.output_text.delta` ... `response.completed`). With `--reasoning-parser`, a thinking model's
reasoning comes first as a `reasoning` item (`content: [{"type": "reasoning_text", ...}]`, as vLLM's;
streamed as `response.reasoning_text.delta`). Stateless: `previous_response_id`, `store: true` and tools
are refused.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from mmserve.server.app_state import AppState, app_state, parse
from mmserve.server.chat_prompt import chat_prompt, media_items
from mmserve.server.protocol import APIError, ChatCompletionRequest, ReasoningEffort
from mmserve.server.reasoning import ReasoningStream
from mmserve.server.routes_openai import start_generation
from mmserve.server.serving import Generation

router = APIRouter()
State = Annotated[AppState, Depends(app_state)]


class ReasoningParam(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effort: ReasoningEffort | None = None  # the chat template's `reasoning_effort`


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None  # not OpenAI's, but every other endpoint here takes it
    stream: bool = False
    store: Literal[False] | None = None  # stateless: nothing is stored for a later previous_response_id
    user: str | None = None
    metadata: dict[str, str] | None = None
    reasoning: ReasoningParam | None = None


_PARTS = {"input_text": "text", "output_text": "text", "input_image": "image_url"}


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The Responses `input` as chat messages (400 naming the item for anything else)."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if item.get("type", "message") != "message" or not isinstance(item.get("role"), str):
            raise APIError(
                400, f"{where}: only message items (role + content) are supported", "invalid_parameter"
            )
        unknown = set(item) - {"type", "role", "content"}
        if unknown:
            raise APIError(
                400,
                f"{where}: {', '.join(sorted(unknown))} not supported by this server",
                "invalid_parameter",
            )
        content = item.get("content")
        if isinstance(content, str):
            messages.append({"role": item["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(400, f"{where}.content must be a string or a list of parts", "invalid_parameter")
        parts = []
        for j, part in enumerate(content):
            kind = _PARTS.get(part.get("type")) if isinstance(part, dict) else None
            if kind == "text" and set(part) <= {"type", "text", "annotations"}:
                parts.append({"type": "text", "text": part.get("text")})
            elif kind == "image_url" and set(part) <= {"type", "image_url", "detail"}:
                parts.append(
                    {
                        "type": "image_url",
                        "image_url": {"url": part.get("image_url"), "detail": part.get("detail", "auto")},
                    }
                )
            else:
                raise APIError(
                    400,
                    f"{where}.content[{j}]: only input_text and input_image (image_url) parts are supported",
                    "invalid_parameter",
                )
        messages.append({"role": item["role"], "content": parts})
    return messages


@router.post("/v1/responses")
async def responses(request: Request, state: State):
    body: ResponsesRequest = await parse(request, ResponsesRequest)
    state.check_model(body.model)
    chat = ChatCompletionRequest(
        model=body.model,
        messages=_messages(body),
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stream=body.stream,
        user=body.user,
        metadata=body.metadata,
        reasoning_effort=body.reasoning.effort if body.reasoning else None,
    )
    state.require_cache_salt(chat)
    prompt = chat_prompt(state, chat.messages, template_kwargs=chat.template_kwargs)
    items = await media_items(state, prompt, None)
    gen, _ = await start_generation(request, state, chat, "chat", prompt.prompt_ids, items)
    head = _Head(
        f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", int(time.time()), state.cfg.served_model_name
    )
    reasoner = state.reasoning.stream(prompt.prompt_ids, chat.template_kwargs) if state.reasoning else None
    if body.stream:
        return StreamingResponse(_events(gen, head, reasoner), media_type="text/event-stream")

    async def run() -> dict[str, Any]:
        reasoning, text = [], []
        async for r, t in _split(gen, reasoner):
            reasoning.append(r)
            text.append(t)
        head.reasoning_tokens = reasoner.reasoning_tokens if reasoner else 0
        return head.response(gen, "".join(text), "completed", "".join(reasoning))

    return await state.run_with_disconnect(request, run())


async def _split(gen: Generation, reasoner: ReasoningStream | None) -> AsyncIterator[tuple[str, str]]:
    """(reasoning, answer) text of each engine message (all answer without a reasoning parser)."""
    async for ev in gen.events():
        if reasoner is None:
            yield "", ev.text
            continue
        reasoner.add_tokens(ev.token_ids)
        reasoning, text = reasoner.feed(ev.text)
        if ev.finish_reason is not None:
            held_reasoning, held_text = reasoner.finish()
            reasoning, text = reasoning + held_reasoning, text + held_text
        yield reasoning, text


class _Head:
    def __init__(self, response_id: str, message_id: str, created: int, model: str) -> None:
        self.id, self.message_id, self.created, self.model = response_id, message_id, created, model
        self.reasoning_id = f"rs_{response_id.removeprefix('resp_')}"
        self.reasoning_tokens = 0

    def reasoning(self, text: str, status: str) -> dict[str, Any]:
        """vLLM's reasoning item: the text as `reasoning_text` content, no summary."""
        content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
        return {
            "type": "reasoning",
            "id": self.reasoning_id,
            "summary": [],
            "content": content,
            "status": status,
        }

    def message(self, text: str, status: str) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": []}
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [part] if status == "completed" else [],
        }

    def response(self, gen: Generation | None, text: str, status: str, reasoning: str = "") -> dict[str, Any]:
        done = status == "completed"
        output = [self.reasoning(reasoning, "completed")] if reasoning else []
        body = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": [*output, self.message(text, "completed")] if done else [],
            "incomplete_details": None,
            "error": None,
            "parallel_tool_calls": False,
            "tool_choice": "none",
            "tools": [],
        }
        if done and gen is not None:
            if gen.finish_reason == "length":
                body["status"] = "incomplete"
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            body["usage"] = {
                "input_tokens": gen.prompt_tokens,
                "input_tokens_details": {"cached_tokens": gen.cached_tokens},
                "output_tokens": gen.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": gen.prompt_tokens + gen.completion_tokens,
            }
        return body


async def _events(gen: Generation, head: _Head, reasoner: ReasoningStream | None) -> AsyncIterator[str]:
    seq = iter(range(1 << 30))

    def event(kind: str, **data) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(seq), **data})}\n\n"

    part = {"type": "output_text", "text": "", "annotations": []}
    thought = {"type": "reasoning_text", "text": ""}
    in_reasoning = {"item_id": head.reasoning_id, "output_index": 0, "content_index": 0}
    where: dict[str, Any] = {}  # the message item's place, once it is open
    reasoning: list[str] = []
    text: list[str] = []

    def open_message() -> list[str]:
        """Close the reasoning item (if any: the answer comes after it) and open the message item."""
        out = []
        if reasoning:
            full = "".join(reasoning)
            out += [
                event("response.reasoning_text.done", text=full, **in_reasoning),
                event("response.content_part.done", part={**thought, "text": full}, **in_reasoning),
                event("response.output_item.done", output_index=0, item=head.reasoning(full, "completed")),
            ]
        where.update(item_id=head.message_id, output_index=1 if reasoning else 0, content_index=0)
        item = head.message("", "in_progress")
        out += [
            event("response.output_item.added", output_index=where["output_index"], item=item),
            event("response.content_part.added", part=part, **where),
        ]
        return out

    yield event("response.created", response=head.response(None, "", "in_progress"))
    yield event("response.in_progress", response=head.response(None, "", "in_progress"))
    try:
        async for r, t in _split(gen, reasoner):
            if r:
                if not reasoning:
                    item = head.reasoning("", "in_progress")
                    yield event("response.output_item.added", output_index=0, item=item)
                    yield event("response.content_part.added", part=thought, **in_reasoning)
                reasoning.append(r)
                yield event("response.reasoning_text.delta", delta=r, **in_reasoning)
            if t:
                if not where:
                    for opened in open_message():
                        yield opened
                text.append(t)
                yield event("response.output_text.delta", delta=t, logprobs=[], **where)
    except APIError as e:  # the engine died mid-stream
        yield event("error", code=e.code, message=e.message, param=None)
        return
    if not where:  # an answer with no text still has its item
        for opened in open_message():
            yield opened
    full = "".join(text)
    yield event("response.output_text.done", text=full, logprobs=[], **where)
    yield event("response.content_part.done", part={**part, "text": full}, **where)
    item = head.message(full, "completed")
    yield event("response.output_item.done", output_index=where["output_index"], item=item)
    head.reasoning_tokens = reasoner.reasoning_tokens if reasoner else 0
    final = head.response(gen, full, "completed", "".join(reasoning))
    yield event(
        "response.completed" if final["status"] == "completed" else "response.incomplete", response=final
    )
