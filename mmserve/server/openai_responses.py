"""The OpenAI answer of a generation: the JSON of a finished request, the SSE chunks of a streamed one, and the
answer of a prefill server that handed its request to a decode server.

Functions of started `Generation`s (mmserve.server.serving) and the `Answer` settings of each: the kind
("chat" or "completion"), whether and how logprobs are reported, tool-call parsing (chat), echo, token ids.
A batched completions request (several prompts) has one generation per prompt; as in vLLM, choice `j` of
prompt `k` is reported under index `k * n + j`, and the usage sums the prompts'.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from mmserve.logprobs import TokenLogprobs
from mmserve.server.logprob_format import TokenStrings, chat_logprobs, completion_logprobs
from mmserve.server.metrics import ServerMetrics
from mmserve.server.protocol import APIError, usage
from mmserve.server.reasoning import ReasoningStream
from mmserve.server.serving import ChoiceDelta, Generation
from mmserve.server.tool_parsers import ToolParser, finish_reason_for
from mmserve.transport.messages import HandedOffMsg


@dataclass
class Answer:
    """How one request's answer is shaped."""

    kind: str  # "chat" | "completion"
    created: int
    model: str
    strings: TokenStrings
    logprobs: bool = False  # report the output tokens' logprobs
    # chat with tools: a fresh parser of one choice's tool calls, in the model's format (--tool-call-parser)
    tool_parser: Callable[[], ToolParser] | None = None
    single_call: bool = False  # parallel_tool_calls false: keep the first call only
    echo: str | None = (
        None  # echo: the prompt's text (chat: the last assistant message's), before each choice
    )
    echo_ids: list[int] = field(default_factory=list)  # completions: the prompt's tokens (for the logprobs)
    prompt_logprobs: bool = False  # vLLM's `prompt_logprobs` field
    token_ids: bool = False  # vLLM's `return_token_ids`: the prompt's and each choice's token ids
    index_base: int = 0  # batched completions: this prompt's first choice index (prompt index * n)
    echo_only: bool = False  # completions echo with max_tokens 0: the prompt only, no generated token
    tokens_as_ids: bool = False  # vLLM's `return_tokens_as_token_ids`: logprob tokens as "token_id:N"
    # --reasoning-parser (chat): a fresh reasoning / content split of one choice (mmserve.server.reasoning)
    reasoning: Callable[[], ReasoningStream] | None = None


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
    all_ids: list[int] = field(default_factory=list)  # EOS / stop token included
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


async def _collect_one(gen: Generation) -> dict[int, _Collected]:
    got: dict[int, _Collected] = {i: _Collected() for i in range(gen.params.n)}
    async for ev in gen.events():
        c = got[ev.index]
        c.text.append(ev.text)
        c.ids += ev.token_ids
        c.all_ids += ev.all_ids
        c.logprobs += ev.logprobs
        if ev.finish_reason is not None:
            c.finish_reason, c.stop_reason = ev.finish_reason, ev.stop_reason
    return got


async def collect(gens: list[Generation], answers: list[Answer]) -> dict[str, Any]:
    """Run non-streamed generations (one per prompt) to their ends and build their answer."""
    results = await asyncio.gather(*(_collect_one(gen) for gen in gens))
    gen, answer = gens[0], answers[0]
    payload = _head(gen, answer, "chat.completion" if answer.kind == "chat" else "text_completion")
    payload["choices"] = [
        _choice(a, a.index_base + i, c, g)
        for g, a, got in zip(gens, answers, results, strict=True)
        for i, c in got.items()
    ]
    payload["usage"] = batch_usage(gens, _reasoning_tokens(answers, results))
    if answer.kind == "chat":  # vLLM: chat reports these on the response, completions on each choice
        if answer.prompt_logprobs:
            payload["prompt_logprobs"] = _vllm_prompt_logprobs(answer, gen)
        if answer.token_ids:
            payload["prompt_token_ids"] = prompt_ids(gen)
    payload["mmserve"] = gen.extra() if len(gens) == 1 else {"prompts": [g.extra() for g in gens]}
    return payload


def prompt_ids(gen: Generation) -> list[int]:
    """The prompt as the model saw it: media expanded with the model's placeholder ids."""
    return gen.prompt_ids if gen.prompt_ids is not None else list(gen.prompt_token_ids)


def batch_usage(gens: list[Generation], reasoning_tokens: int | None = None) -> dict[str, Any]:
    return usage(
        sum(g.prompt_tokens for g in gens),
        sum(g.completion_tokens for g in gens),
        sum(g.cached_tokens for g in gens),
        reasoning_tokens,
    )


def _reasoning_tokens(answers: list[Answer], results: list[dict[int, _Collected]]) -> int | None:
    """All choices' reasoning tokens (None without a reasoning parser)."""
    if answers[0].reasoning is None:
        return None
    total = 0
    for answer, got in zip(answers, results, strict=True):
        for c in got.values():
            stream = answer.reasoning()
            stream.add_tokens(c.ids)
            total += stream.reasoning_tokens
    return total


def reasoning_fields(reasoning: str | None) -> dict[str, str | None]:
    """The reasoning on a chat message or delta. vLLM names it `reasoning` today; it used to name it
    `reasoning_content` (DeepSeek's API's name, which many clients still read) and, while renaming, sent the
    same text under both names: so does this server."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def _head(gen: Generation, answer: Answer, obj: str) -> dict[str, Any]:
    return {"id": gen.request_id, "object": obj, "created": answer.created, "model": answer.model}


def _choice(answer: Answer, index: int, c: _Collected, gen: Generation) -> dict[str, Any]:
    text = "".join(c.text)
    ids = {"token_ids": c.all_ids} if answer.token_ids else {}
    if answer.kind == "chat":
        reasoning, answered = answer.reasoning().split(text) if answer.reasoning else (None, text)
        content = (answer.echo + (answered or "")) if answer.echo else answered
        if answer.reasoning is None:
            content = content or ""  # no parser: the text as it came, "" included
        message: dict[str, Any] = {"role": "assistant", "content": content}
        finish = c.finish_reason
        if answer.tool_parser is not None:  # the calls are in the answer, after the reasoning
            content, calls = answer.tool_parser().parse(answered or "")
            calls = calls[:1] if answer.single_call else calls
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
            finish = finish_reason_for(calls, c.finish_reason)
        if answer.reasoning is not None:
            message.update(reasoning_fields(reasoning))
        logprobs = chat_logprobs(answer.strings, c.logprobs) if answer.logprobs else None
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": c.stop_reason,
            **ids,
        }
    logprobs = None
    if answer.logprobs:
        entries: list[TokenLogprobs | None] = list(c.logprobs)
        ids = list(c.ids)
        if answer.echo is not None:
            entries = list(gen.prompt_logprobs or [None] * len(answer.echo_ids)) + entries
            ids = answer.echo_ids + ids
        logprobs = completion_logprobs(answer.strings, entries, ids)
    if answer.echo_only:
        text, logprobs = "", _echo_only(logprobs)  # max_tokens 0: the one computed token is not reported
    text = (answer.echo or "") + text
    choice = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }
    if answer.prompt_logprobs:
        choice["prompt_logprobs"] = _vllm_prompt_logprobs(answer, gen)
    if answer.token_ids:
        choice["prompt_token_ids"] = prompt_ids(gen)
        choice["token_ids"] = [] if answer.echo_only else c.all_ids
    return choice


def _echo_only(logprobs: dict[str, Any] | None) -> dict[str, Any] | None:
    """Completion logprobs without their last (generated) position."""
    if logprobs is None:
        return None
    return {k: v[:-1] for k, v in logprobs.items()}


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


async def _merged(gens: list[Generation]) -> AsyncIterator[tuple[int, ChoiceDelta]]:
    """(prompt index, event) of every generation as they come. Leaving early cancels the rest, which
    aborts their engine requests."""
    if len(gens) == 1:
        async for ev in gens[0].events():
            yield 0, ev
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k: int, gen: Generation) -> None:
        try:
            async for ev in gen.events():
                await queue.put((k, ev))
        except APIError as e:
            await queue.put((k, e))
        finally:
            await queue.put((k, done))

    tasks = [asyncio.ensure_future(pump(k, gen)) for k, gen in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            k, ev = await queue.get()
            if ev is done:
                left -= 1
            elif isinstance(ev, APIError):
                raise ev
            else:
                yield k, ev
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def sse_stream(
    gens: list[Generation], answers: list[Answer], body: Any, metrics: ServerMetrics
) -> AsyncIterator[str]:
    """The `data: ...` events of a streamed request (one generation per prompt), ending with `data: [DONE]`.
    An engine failure mid-stream becomes an in-band error event (the status line was sent long ago)."""
    first = answers[0]
    chat = first.kind == "chat"
    head = _head(gens[0], first, "chat.completion.chunk" if chat else "text_completion")
    continuous = body.continuous_usage

    reasoners = {
        (k, i): a.reasoning() for k, a in enumerate(answers) if a.reasoning for i in range(gens[k].params.n)
    }

    def usage_so_far() -> dict[str, Any]:
        reasoning = sum(r.reasoning_tokens for r in reasoners.values()) if reasoners else None
        return batch_usage(gens, reasoning)

    def chunk(choices: list[dict[str, Any]], **extra) -> str:
        if continuous and choices:  # vLLM's continuous_usage_stats: the usage so far on every chunk
            extra.setdefault("usage", usage_so_far())
        return f"data: {json.dumps({**head, 'choices': choices, **extra})}\n\n"

    parsers = {
        (k, i): a.tool_parser()
        for k, a in enumerate(answers)
        if a.tool_parser is not None
        for i in range(gens[k].params.n)
    }
    try:
        for gen, answer in zip(gens, answers, strict=True):
            for i in range(gen.params.n):
                index = answer.index_base + i
                if chat:
                    delta = {"role": "assistant", "content": answer.echo or ""}
                    extra = {"prompt_token_ids": prompt_ids(gen)} if answer.token_ids and i == 0 else {}
                    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
                    yield chunk([choice], **extra)
                elif answer.echo is not None:
                    choice = _text_choice(answer, index, answer.echo, gen.prompt_logprobs, answer.echo_ids)
                    if answer.token_ids:
                        choice["prompt_token_ids"] = prompt_ids(gen)
                        choice["token_ids"] = []
                    yield chunk([choice])
                elif answer.token_ids:  # vLLM: the prompt's ids come with the choice's first chunk
                    choice = _text_choice(answer, index, "", None, [])
                    choice.update(prompt_token_ids=prompt_ids(gen), token_ids=[])
                    yield chunk([choice])
        async for k, ev in _merged(gens):
            answer = answers[k]
            if answer.echo_only and not chat:  # nothing generated is reported, only the finish
                ev = ChoiceDelta("", [], [], ev.finish_reason, ev.stop_reason, ev.index)
            reasoner = reasoners.get((k, ev.index))
            if reasoner is not None:
                reasoner.add_tokens(ev.token_ids)
            for choice in _stream_choices(answer, ev, parsers.get((k, ev.index)), reasoner):
                choice["index"] += answer.index_base
                yield chunk([choice])
        for gen, answer in zip(gens, answers, strict=True):
            if answer.prompt_logprobs:
                yield chunk([], prompt_logprobs=_vllm_prompt_logprobs(answer, gen))
        yield chunk([], mmserve=gens[0].extra() if len(gens) == 1 else {"prompts": [g.extra() for g in gens]})
        if body.include_usage:
            yield chunk([], usage=usage_so_far())
    except APIError as e:  # the engine died mid-stream: tell the client in-band
        metrics.record_error(e.status)
        yield f"data: {json.dumps(e.body())}\n\n"
    yield "data: [DONE]\n\n"


def _text_choice(answer: Answer, index: int, text: str, entries, ids: list[int]) -> dict[str, Any]:
    logprobs = None
    if answer.logprobs:
        logprobs = completion_logprobs(answer.strings, list(entries or [None] * len(ids)), ids)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}


def _stream_choices(
    answer: Answer, ev: ChoiceDelta, parser: ToolParser | None, reasoner: ReasoningStream | None
) -> list[dict]:
    """The chunk choices of one event: its reasoning, its text (or tool-call deltas), then its finish; with
    return_token_ids the event's token ids ride on its first chunk (one is sent for them even when the text is
    held back)."""
    out = _event_choices(answer, ev, parser, reasoner)
    if answer.token_ids:
        if ev.all_ids and not out:
            out.append(
                {"index": ev.index, "delta": {}} if answer.kind == "chat" else {"index": ev.index, "text": ""}
            )
            out[0].update(logprobs=None, finish_reason=None)
        for j, choice in enumerate(out):
            choice["token_ids"] = ev.all_ids if j == 0 else []
    return out


def _event_choices(
    answer: Answer, ev: ChoiceDelta, parser: ToolParser | None, reasoner: ReasoningStream | None
) -> list[dict]:
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
    text, deltas = ev.text, []
    if reasoner is not None:  # the reasoning first; only the answer after it goes on to the tool parser
        reasoning, text = reasoner.feed(ev.text) if ev.text else ("", "")
        if ev.finish_reason is not None:
            held_reasoning, held_text = reasoner.finish()
            reasoning, text = reasoning + held_reasoning, text + held_text
        if reasoning:
            deltas.append(reasoning_fields(reasoning))
    if parser is None:
        if text:
            deltas.append({"content": text})
    else:
        deltas += parser.feed(text) if text else []
        if ev.finish_reason is not None:
            deltas += parser.finish()
    empty = {"content": ""} if parser is None and reasoner is None else {}  # logprobs of held-back text
    for k, delta in enumerate(deltas or ([empty] if logprobs else [])):
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
