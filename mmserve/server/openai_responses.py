"""The OpenAI answer of a generation: the JSON of a finished request, the SSE chunks of a streamed one, and the
answer of a prefill server that handed its request to a decode server.

Functions of a started `Generation` (mmserve.server.serving) and the `Answer` settings of its request: the
kind ("chat" or "completion"), whether and how logprobs are reported, tool-call parsing (chat), echo
(completions). Every choice of an n > 1 request is reported under its index.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from mmserve.logprobs import TokenLogprobs
from mmserve.server.logprob_format import TokenStrings, chat_logprobs, completion_logprobs
from mmserve.server.metrics import ServerMetrics
from mmserve.server.protocol import APIError, usage
from mmserve.server.serving import ChoiceDelta, Generation
from mmserve.server.tool_parser import ToolCallStreamParser, finish_reason_for, parse_tool_calls
from mmserve.transport.messages import HandedOffMsg


@dataclass
class Answer:
    """How one request's answer is shaped."""

    kind: str  # "chat" | "completion"
    created: int
    model: str
    strings: TokenStrings
    logprobs: bool = False  # report the output tokens' logprobs
    parse_tools: bool = False  # chat with tools: parse `<tool_call>` blocks into tool_calls
    single_call: bool = False  # parallel_tool_calls false: keep the first call only
    echo: str | None = None  # completions echo: the prompt's text, prepended to every choice
    echo_ids: list[int] = field(default_factory=list)  # ... and its tokens (for the logprobs)
    prompt_logprobs: bool = False  # vLLM's `prompt_logprobs` field


def handoff_payload(gen: Generation, done: HandedOffMsg) -> dict[str, Any]:
    """A prefill server's answer once the decode engine has the request."""
    return {
        "id": gen.request_id,
        "object": "kv_handoff",
        "kv_transfer": {
            "room": gen.handoff.room,
            "backend": gen.handoff.backend,
            "kv_bytes": done.kv_bytes,
            "transfer_s": round(done.transfer_s, 6),
            "decode_bootstrap": gen.handoff.bootstrap,
        },
        "usage": usage(gen.prompt_tokens, 0, gen.cached_tokens),
        "mmserve": gen.extra(),
    }


@dataclass
class _Collected:
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


async def collect(gen: Generation, answer: Answer) -> dict[str, Any]:
    """Run a non-streamed request to its end and build its answer."""
    got: dict[int, _Collected] = {i: _Collected() for i in range(gen.params.n)}
    async for ev in gen.events():
        c = got[ev.index]
        c.text.append(ev.text)
        c.ids += ev.token_ids
        c.logprobs += ev.logprobs
        if ev.finish_reason is not None:
            c.finish_reason, c.stop_reason = ev.finish_reason, ev.stop_reason
    payload = _head(gen, answer, "chat.completion" if answer.kind == "chat" else "text_completion")
    payload["choices"] = [_choice(answer, i, c, gen) for i, c in got.items()]
    payload["usage"] = usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)
    if answer.prompt_logprobs:
        payload["prompt_logprobs"] = _vllm_prompt_logprobs(answer, gen)
    payload["mmserve"] = gen.extra()
    return payload


def _head(gen: Generation, answer: Answer, obj: str) -> dict[str, Any]:
    return {"id": gen.request_id, "object": obj, "created": answer.created, "model": answer.model}


def _choice(answer: Answer, index: int, c: _Collected, gen: Generation) -> dict[str, Any]:
    text = "".join(c.text)
    if answer.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = c.finish_reason
        if answer.parse_tools:
            content, calls = parse_tool_calls(text)
            calls = calls[:1] if answer.single_call else calls
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
            finish = finish_reason_for(calls, c.finish_reason)
        logprobs = chat_logprobs(answer.strings, c.logprobs) if answer.logprobs else None
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": c.stop_reason,
        }
    logprobs = None
    if answer.logprobs:
        entries: list[TokenLogprobs | None] = list(c.logprobs)
        ids = list(c.ids)
        if answer.echo is not None:
            entries = list(gen.prompt_logprobs or [None] * len(answer.echo_ids)) + entries
            ids = answer.echo_ids + ids
        logprobs = completion_logprobs(answer.strings, entries, ids)
    text = (answer.echo or "") + text
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }


def _vllm_prompt_logprobs(answer: Answer, gen: Generation) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, None or {token id: {logprob, rank, decoded_token}}."""
    if gen.prompt_logprobs is None:
        return None
    out: list[dict[str, Any] | None] = []
    for e in gen.prompt_logprobs:
        if e is None:
            out.append(None)
            continue
        entry = {
            str(e.token_id): {
                "logprob": e.logprob,
                "rank": e.rank,
                "decoded_token": answer.strings(e.token_id),
            }
        }
        for rank, (t, lp) in enumerate(zip(e.top_ids, e.top_logprobs, strict=True), start=1):
            entry.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": answer.strings(t)})
        out.append(entry)
    return out


async def sse_stream(
    gen: Generation, answer: Answer, include_usage: bool, metrics: ServerMetrics
) -> AsyncIterator[str]:
    """The `data: ...` events of a streamed request, ending with `data: [DONE]`. An engine failure mid-stream
    becomes an in-band error event (the status line was sent long ago)."""
    chat = answer.kind == "chat"
    head = _head(gen, answer, "chat.completion.chunk" if chat else "text_completion")

    def chunk(choices: list[dict[str, Any]], **extra) -> str:
        return f"data: {json.dumps({**head, 'choices': choices, **extra})}\n\n"

    parsers = {i: ToolCallStreamParser() for i in range(gen.params.n)} if answer.parse_tools else {}
    try:
        for i in range(gen.params.n):
            if chat:
                yield chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            elif answer.echo is not None:
                yield chunk([_text_choice(answer, i, answer.echo, gen.prompt_logprobs, answer.echo_ids)])
        async for ev in gen.events():
            for choice in _stream_choices(answer, ev, parsers.get(ev.index)):
                yield chunk([choice])
        if answer.prompt_logprobs:
            yield chunk([], prompt_logprobs=_vllm_prompt_logprobs(answer, gen))
        yield chunk([], mmserve=gen.extra())
        if include_usage:
            yield chunk([], usage=usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens))
    except APIError as e:  # the engine died mid-stream: tell the client in-band
        metrics.record_error(e.status)
        yield f"data: {json.dumps(e.body())}\n\n"
    yield "data: [DONE]\n\n"


def _text_choice(answer: Answer, index: int, text: str, entries, ids: list[int]) -> dict[str, Any]:
    logprobs = None
    if answer.logprobs:
        logprobs = completion_logprobs(answer.strings, list(entries or [None] * len(ids)), ids)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}


def _stream_choices(answer: Answer, ev: ChoiceDelta, parser: ToolCallStreamParser | None) -> list[dict]:
    """The chunk choices of one event: its text (or tool-call deltas), then its finish."""
    out: list[dict[str, Any]] = []
    if answer.kind != "chat":
        if ev.text or ev.token_ids:
            out.append(_text_choice(answer, ev.index, ev.text, ev.logprobs, ev.token_ids))
        if ev.finish_reason is not None:
            out.append(
                {
                    "index": ev.index,
                    "text": "",
                    "logprobs": None,
                    "finish_reason": ev.finish_reason,
                    "stop_reason": ev.stop_reason,
                }
            )
        return out
    logprobs = chat_logprobs(answer.strings, ev.logprobs) if answer.logprobs and ev.logprobs else None
    if parser is None:
        if ev.text or logprobs:
            out.append(
                {
                    "index": ev.index,
                    "delta": {"content": ev.text},
                    "logprobs": logprobs,
                    "finish_reason": None,
                }
            )
    else:
        deltas = parser.feed(ev.text) if ev.text else []
        if ev.finish_reason is not None:
            deltas += parser.finish()
        for k, delta in enumerate(deltas or ([{}] if logprobs else [])):
            out.append(
                {
                    "index": ev.index,
                    "delta": delta,
                    "logprobs": logprobs if k == 0 else None,
                    "finish_reason": None,
                }
            )
    if ev.finish_reason is not None:
        finish = finish_reason_for(parser.calls, ev.finish_reason) if parser is not None else ev.finish_reason
        out.append(
            {
                "index": ev.index,
                "delta": {},
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": ev.stop_reason,
            }
        )
    return out
