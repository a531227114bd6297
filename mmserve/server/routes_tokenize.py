"""vLLM's tokenizer endpoints: POST /tokenize (a prompt, or chat messages through the chat template) and
POST /detokenize.

Unlike vLLM, the chat form counts media: each item's placeholder is expanded to the tokens the model sees
(mmserve.server.media_tokens), so `count` equals the `usage.prompt_tokens` a chat completion of the same
messages reports, and `tokens` holds the model's own placeholder id once per media token.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from pydantic.json_schema import models_json_schema

from mmserve.multimodal.errors import MediaError
from mmserve.server.app_state import AppState, app_state, json_object, parse, validate
from mmserve.server.chat_prompt import chat_prompt
from mmserve.server.media_tokens import expand_media
from mmserve.server.protocol import RESERVED_TEMPLATE_KWARGS, APIError

router = APIRouter()
State = Annotated[AppState, Depends(app_state)]


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # e.g. BOS, as a completion prompt gets it
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last message open (the model continues it)
    add_special_tokens: bool = False  # on top of what the chat template adds
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # as on /v1/chat/completions, so both see one prompt


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[StrictInt]  # strict: `true` is not token id 1


_BODY_REFS, BODY_SCHEMAS = models_json_schema(
    [(m, "validation") for m in (TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest)],
    ref_template="#/components/schemas/{model}",
)


def _json_body(*models: type) -> dict[str, Any]:
    refs = [_BODY_REFS[(m, "validation")] for m in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


@router.post("/tokenize", openapi_extra=_json_body(TokenizeCompletionRequest, TokenizeChatRequest))
async def tokenize(request: Request, state: State):
    raw = await json_object(request)
    body = validate(raw, TokenizeChatRequest if "messages" in raw else TokenizeCompletionRequest)
    state.check_model(body.model)
    if isinstance(body, TokenizeCompletionRequest):
        tokens = state.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        tokens = await _chat_tokens(state, body)
    answer: dict[str, Any] = {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        answer["token_strs"] = state.tokenizer.convert_ids_to_tokens(tokens)
    return answer


async def _chat_tokens(state: AppState, body: TokenizeChatRequest) -> list[int]:
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(body.chat_template_kwargs or {}))
    if reserved:
        raise APIError(400, f"chat_template_kwargs: {', '.join(reserved)} are set by the server", "invalid_parameter")
    if body.add_generation_prompt and body.continue_final_message:
        message = "continue_final_message cannot be used with add_generation_prompt (set it to false)"
        raise APIError(400, message, "invalid_parameter")
    prompt = chat_prompt(
        state,
        body.messages,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        add_special_tokens=body.add_special_tokens,
        template_kwargs=body.chat_template_kwargs,
    )
    if not prompt.media:
        return prompt.prompt_ids
    try:  # fetching, decoding and preprocessing media is blocking CPU work
        expanded = await asyncio.to_thread(expand_media, state, prompt)
    except MediaError as e:
        raise APIError.of(e.failure) from e
    except ValueError as e:  # placeholders and items do not match (e.g. continue_final_message cut one)
        raise APIError(400, str(e), "invalid_messages") from e
    return expanded.hf_token_ids


@router.post("/detokenize", openapi_extra=_json_body(DetokenizeRequest))
async def detokenize(request: Request, state: State):
    body = await parse(request, DetokenizeRequest)
    state.check_model(body.model)
    vocab = len(state.tokenizer)
    for i, token in enumerate(body.tokens):
        if not 0 <= token < vocab:
            message = f"tokens[{i}] = {token} is not a token id of this model (ids are in [0, {vocab}))"
            raise APIError(400, message, "invalid_tokens")
    return {"prompt": state.tokenizer.decode(body.tokens)}
