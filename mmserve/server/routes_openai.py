"""OpenAI endpoints: /v1/chat/completions, /v1/completions, /v1/models, and SageMaker's /invocations.

A request goes: parse and check the body, build the prompt (token ids and media items), admit it (capacity,
disaggregation role), start its `Generation`, then answer (mmserve.server.openai_responses). A client that
goes away at any point after the body was read aborts its engine request (`AppState.run_with_disconnect`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from functools import partial
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from pydantic.json_schema import models_json_schema

from mmserve.sampling_params import StructuredOutputs
from mmserve.server.app_state import AppState, app_state, json_object, parse, validate
from mmserve.server.chat_prompt import chat_prompt, media_items
from mmserve.server.logprob_format import token_id_strings
from mmserve.server.openai_responses import Answer, collect, handoff_payload, sse_stream
from mmserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, structured_of
from mmserve.server.serving import Generation
from mmserve.server.tools import ToolRequest, parse_tools, tool_grammar_tools
from mmserve.transport.messages import HandedOffMsg, KvTarget, MediaItemMsg

logger = logging.getLogger("mmserve.server")
router = APIRouter()
State = Annotated[AppState, Depends(app_state)]

# The OpenAI handlers read the raw Request (to answer bad JSON with our own 400), so FastAPI cannot infer
# their body schemas: `openapi_extra` references these, and `build_app` adds them to /openapi.json.
_BODY_REFS, BODY_SCHEMAS = models_json_schema(
    [(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")],
    ref_template="#/components/schemas/{model}",
)


def _json_body(model: type) -> dict[str, Any]:
    schema = _BODY_REFS[(model, "validation")]
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def model_card(state: AppState, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "mmserve",
        "root": state.client.cfg.model,  # vLLM's: the checkpoint the name serves; parent: the base of an adapter
        "parent": None,
        "max_model_len": state.max_model_len,
    }


@router.get("/v1/models")
async def models(state: State):
    return {"object": "list", "data": [model_card(state, name) for name in state.cfg.served_model_names]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, state: State):
    if model_id not in state.cfg.served_model_names:
        raise APIError(404, f"The model `{model_id}` does not exist.", "model_not_found")
    return model_card(state, model_id)


@router.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
async def chat(request: Request, state: State):
    return await _chat(request, state, await parse(request, ChatCompletionRequest))


@router.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
async def completions(request: Request, state: State):
    return await _completions(request, state, await parse(request, CompletionRequest))


@router.post("/invocations")
async def invocations(request: Request, state: State):
    """SageMaker's single inference route: the body's shape picks the API, as vLLM does."""
    raw = await json_object(request)
    if "messages" in raw:
        return await _chat(request, state, validate(raw, ChatCompletionRequest))
    if "prompt" in raw:
        return await _completions(request, state, validate(raw, CompletionRequest))
    message = (
        "/invocations takes a chat completions body (with 'messages') or a completions body (with 'prompt')"
    )
    raise APIError(400, message, "invalid_request")


async def _chat(request: Request, state: AppState, body: ChatCompletionRequest):
    state.check_model(body.model)
    state.require_cache_salt(body)
    tools = parse_tools(
        body.tools, body.tool_choice, body.parallel_tool_calls, state.cfg.enable_auto_tool_choice
    )
    echo = _echo_text(body.messages) if body.echo else None
    if state.cfg.disaggregation_mode == "decode":  # the prefill server rendered, tokenized and encoded it
        return await generate(request, state, body, "chat", [([], [])], tools, echo=echo)
    prompt = chat_prompt(
        state,
        body.messages,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        add_special_tokens=body.add_special_tokens,
        tools=tools.tools if tools else None,
        mm_processor_kwargs=body.mm_processor_kwargs,
        media_io_kwargs=body.media_io_kwargs,
        template_kwargs=body.template_kwargs,
    )
    items = await media_items(state, prompt, body.cache_salt)
    return await generate(request, state, body, "chat", [(prompt.prompt_ids, items)], tools, echo=echo)


def _echo_text(messages: list[dict[str, Any]]) -> str | None:
    """vLLM's chat `echo`: the answer starts with the last message's text when that message is the
    assistant's (the role of the answer), else with nothing."""
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return None
    content = last.get("content")
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else None


async def _completions(request: Request, state: AppState, body: CompletionRequest):
    state.check_model(body.model)
    state.require_cache_salt(body)
    prompts = body.prompts
    if len(prompts) > 1 and state.cfg.disaggregation_mode != "null":
        raise APIError(
            400, "prompt: a disaggregated deployment serves one prompt per request", "invalid_prompt"
        )
    batch = [(_completion_prompt(state, p, body.add_special_tokens, k, len(prompts)), []) for k, p in
             enumerate(prompts)]
    return await generate(request, state, body, "completion", batch)


def _completion_prompt(
    state: AppState, prompt: str | list[int], special: bool, k: int, count: int
) -> list[int]:
    where = f"prompt[{k}]" if count > 1 else "prompt"
    if isinstance(prompt, str):
        return state.tokenize(prompt, add_special_tokens=special)
    vocab = len(state.tokenizer)
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"{where}: token id {bad} is not in [0, {vocab})", "invalid_prompt")
    return list(prompt)


def disagg_role(request: Request, state: AppState, body) -> dict:
    """Generation arguments of a prefill or decode server's request (mmserve.disagg). Those servers take
    requests only from the router, which sends `kv_transfer_params` (a control-plane field: it names where
    the KV goes) with the cluster token."""
    params, mode = body.kv_transfer_params, state.cfg.disaggregation_mode
    if mode == "null":
        if params is not None:
            raise APIError(
                400,
                "kv_transfer_params: this server is not a prefill or decode server",
                "invalid_parameter",
            )
        return {}
    if params is None:
        raise APIError(
            400,
            f"this is a {mode} server of a disaggregated deployment: send requests through `mmserve router`",
            "disaggregated_server",
        )
    state.check_control_plane(request)
    if mode == "decode":
        return {"adopt_timeout_s": state.cfg.kv_adopt_timeout_s, "request_id": params.room}
    if params.decode_bootstrap is None:
        raise APIError(
            400,
            "kv_transfer_params.decode_bootstrap is required by a prefill server",
            "invalid_parameter",
        )
    backends = state.client.ready.kv_backends
    if params.backend not in backends:
        raise APIError(
            400,
            f"kv_transfer_params.backend {params.backend!r} is not available here ({backends})",
            "invalid_parameter",
        )
    return {"handoff": KvTarget(params.room, params.decode_bootstrap, params.backend)}


async def generate(
    request: Request,
    state: AppState,
    body: ChatCompletionRequest | CompletionRequest,
    kind: str,
    prompts: list[tuple[list[int], list[MediaItemMsg]]],
    tools: ToolRequest | None = None,
    echo: str | None = None,
):
    """Admit and run one request (one generation per prompt of a batch); the answer is JSON, an SSE stream,
    or (prefill server) the handoff. A batch starts all its prompts or none."""
    started: list[Generation] = []
    try:
        for prompt_ids, items in prompts:
            gen, done = await start_generation(request, state, body, kind, prompt_ids, items, tools)
            started.append(gen)
    except BaseException:
        for gen in started:
            await gen.close()
        raise
    if started[0].handoff is not None:
        return handoff_payload(started[0], done)
    base = Answer(
        kind,
        int(time.time()),
        state.cfg.served_model_name,
        token_id_strings if body.return_tokens_as_token_ids else state.token_strings,
        logprobs=started[0].params.logprobs is not None,
        tool_parser=state.tool_parser_for(tools),
        single_call=tools is not None and not tools.parallel,
        prompt_logprobs=body.prompt_logprobs is not None,
        token_ids=bool(body.return_token_ids),
        echo=echo,
    )
    answers = []
    for k, ((prompt_ids, _), gen) in enumerate(zip(prompts, started, strict=True)):
        answer = dataclasses.replace(base, index_base=k * gen.params.n)
        if kind == "completion" and body.echo:
            answer.echo, answer.echo_ids = state.tokenizer.decode(prompt_ids), list(prompt_ids)
            answer.echo_only = body.echo_only
        if kind == "chat" and state.reasoning is not None:  # a decode server knows the prompt's tail only
            answer.reasoning = partial(
                state.reasoning.stream,
                prompt_ids or gen.prompt_tail,
                body.template_kwargs,
                implicit_ends=gen.params.structured is None,  # a constraint starts at the end tag only
            )
        answers.append(answer)
    if body.stream:
        events = sse_stream(started, answers, body, state.metrics)
        return StreamingResponse(events, media_type="text/event-stream")
    return await state.run_with_disconnect(request, collect(started, answers))


async def start_generation(
    request: Request,
    state: AppState,
    body: ChatCompletionRequest | CompletionRequest,
    kind: str,
    prompt_ids: list[int],
    items: list[MediaItemMsg],
    tools: ToolRequest | None = None,
) -> tuple[Generation, HandedOffMsg | None]:
    """Check, admit and start one request (its media encoded, queued in the engine). A prefill server's
    request is also handed off: then the HandedOffMsg comes back too."""
    role = disagg_role(request, state, body)
    max_model_len = state.max_model_len
    if len(prompt_ids) >= max_model_len:
        message = f"prompt has {len(prompt_ids)} tokens; the model's context is {max_model_len}"
        raise APIError(400, message, "context_length_exceeded")
    state.max_tokens_of(body)
    if ignored := body.ignored_fields():
        logger.warning("request fields %s accepted and ignored (they cannot change the output)", ignored)
    params = body.sampling_params(tool_constraint(tools, body))
    tool_parser = state.tool_parser_class(tools)
    if tool_parser is not None and tool_parser.needs_special_tokens:
        # The format's markers are special tokens: keep them in the text (vLLM's adjust_request does too).
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    if kind == "chat" and state.reasoning is not None:  # constraints apply to the answer after the reasoning
        params = state.reasoning.constrain(params, prompt_ids, body.template_kwargs)
    if params.n > 1 and role:
        raise APIError(
            400, "n: a disaggregated deployment serves one choice per request", "invalid_parameter"
        )
    state.check_capacity()
    request_id = role.pop("request_id", None) or state.new_request_id(kind)
    if state.client.is_in_flight(request_id) or request_id in state.admitting:
        raise APIError(409, f"kv_transfer_params.room {request_id!r} is already in use", "duplicate_room")
    gen = Generation(
        state.client,
        state.tokenizer,
        state.metrics,
        request_id,
        prompt_ids,
        items,
        params,
        state.dispatcher,
        cache_salt=body.cache_salt,
        return_prompt_ids=bool(getattr(body, "return_token_ids", False)) and bool(items),
        **role,
    )
    state.admitting.add(gen.request_id)
    try:
        await state.run_with_disconnect(request, gen.start())
        if gen.handoff is not None:  # prefill server: answer once the decode engine has the request
            done = await state.run_with_disconnect(request, gen.handed_off())
    finally:
        state.admitting.discard(gen.request_id)
    return gen, done if gen.handoff is not None else None


def tool_constraint(tools: ToolRequest | None, body) -> StructuredOutputs | None:
    """The grammar that enforces tool_choice "required" or a named function (None: unconstrained)."""
    called = tool_grammar_tools(tools) if tools is not None else None
    if called is None:
        return None
    if structured_of(body) is not None:
        raise APIError(
            400,
            "tool_choice: a required or named tool choice cannot be combined with "
            "response_format or another output constraint",
            "invalid_parameter",
        )
    from mmserve.engine.grammar import tool_call_grammar

    exactly_one = tools.named is not None or not tools.parallel
    return StructuredOutputs(grammar=tool_call_grammar(called, exactly_one=exactly_one))
