"""OpenAI request schemas (pydantic) and the errors the API answers with.

Validation that pydantic can express lives in the models (types, ranges); everything else raises `APIError`
with the HTTP status, OpenAI error type and a message naming the parameter.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator, model_validator

from mmserve.engine.cache_salt import MAX_CACHE_SALT_CHARS, check_cache_salt
from mmserve.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    SamplingParams,
    StructuredOutputs,
)


class APIError(Exception):
    """An error the client gets as `{"error": {"message", "type", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, code: str | None = None, err_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type = err_type or _default_type(status)
        self.headers = headers

    @classmethod
    def of(cls, failure) -> APIError:
        """The HTTP error for a Failure (mmserve.transport.messages) from the engine or an encoder."""
        headers = {"Retry-After": "1"} if failure.status == 503 else None
        return cls(failure.status, failure.message, failure.code, headers=headers)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": None}}


def _default_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")  # fmt: skip


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


# Integers travel to the engine in msgpack and int64 tensors: out-of-range values must be a 400 here, not an
# exception in the engine process (top_k=2**63 used to kill it).
INT64_MAX = 2**63 - 1
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


# `prediction` (OpenAI's predicted outputs) only speeds up what the model would write anyway.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "prediction")
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
# Keys of chat_template_kwargs that would replace what the server itself passes to the template.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
# A batched completions request starts one engine request per prompt (vLLM caps it the same way).
MAX_BATCH_PROMPTS = 256


class KvTransferParams(BaseModel):
    """Set by `mmserve router` on the requests it sends to prefill and decode servers (mmserve.disagg): the
    room names the request on both; the prefill server also gets the decode engine's bootstrap and backend."""

    model_config = ConfigDict(extra="forbid")

    room: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    decode_bootstrap: str | None = Field(default=None, pattern=r"^tcp://[^\s/]+:[0-9]{1,5}$")
    backend: Literal["zmq", "mooncake"] = "zmq"


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="response", max_length=64)
    description: str | None = None
    # `schema` shadows a BaseModel attribute: stored as schema_ and read and written as "schema" in JSON.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` extra (one constraint)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[StrictStr] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _SamplingFields(BaseModel):
    # A field this server does not implement is a 400 naming it ("extra_forbidden"), never accepted and
    # ignored; the few that cannot change the output are declared below (IGNORED_FIELDS) and logged.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-INT64_MAX - 1, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(
        default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY
    )
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    min_tokens: int = Field(default=0, ge=0)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM's extra
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None  # vLLM's extras, old and new spelling
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[StrictStr] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # SGLang's top-level constraints (the same grammar engine as structured_outputs.regex / .grammar)
    regex: str | None = None
    ebnf: str | None = None
    # vLLM's fields for RL rollouts: the exact token ids of prompt and completion; logprob tokens as token_id:N
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # Tenant scope of the prefix and embedding caches (vLLM's field): equal salts share hits, others never.
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    kv_transfer_params: KvTransferParams | None = None  # router -> prefill / decode servers only
    # Accepted and ignored: they cannot change the output (README, "Request fields").
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @field_validator("cache_salt")
    @classmethod
    def _cache_salt_is_text(cls, salt: str | None) -> str | None:
        check_cache_salt(salt)  # e.g. a lone surrogate, which could not travel to the engine
        return salt

    def ignored_fields(self) -> list[str]:
        """The fields of IGNORED_FIELDS this request set."""
        return [name for name in IGNORED_FIELDS if getattr(self, name) is not None]

    def sampling_params(self, structured: StructuredOutputs | None = None) -> SamplingParams:
        """Validated sampling settings; max_tokens None means the rest of the context (the engine resolves
        it). `structured` (tool calls) overrides the request's own constraint."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        try:
            return SamplingParams(
                max_tokens=self.requested_max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                min_p=self.min_p or 0.0,
                seed=self.seed,
                stop=stop or None,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                n=self.n,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias=self._logit_bias(),
                min_tokens=self.min_tokens,
                logprobs=self.requested_logprobs,
                prompt_logprobs=self.requested_prompt_logprobs,
                structured=structured or structured_of(self),
            )
        except ValueError as e:
            raise APIError(400, str(e), "invalid_parameter") from e

    def _logit_bias(self) -> dict[int, float]:
        bias, bad = {}, []
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if token < 0 or str(token) != key.strip():
                bad.append(key)
            bias[token] = value
        if bad:  # every bad key at once: a client fixing them one 400 at a time is no fun
            keys = ", ".join(map(repr, bad))
            raise APIError(400, f"logit_bias: keys must be token ids, got {keys}", "invalid_parameter")
        return bias

    @property
    def requested_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # vLLM's extra: the family's per-request processor settings (Qwen-Omni: {"use_audio_in_video": true}).
    mm_processor_kwargs: dict[str, Any] | None = None
    # vLLM's extra: media loading options per modality ({"video": {"num_frames": 4}}), checked by chat_prompt.
    media_io_kwargs: dict[str, Any] | None = None
    # vLLM's chat-template controls (assistant prefill: continue the last message instead of closing it)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # the answer starts with the last message's content when it is the assistant's
    add_special_tokens: bool = False  # on top of what the template adds
    chat_template_kwargs: dict[str, Any] | None = None  # template variables, e.g. {"enable_thinking": false}
    modalities: list[StrictStr] | None = None  # OpenAI's output modalities: only ["text"] here
    # OpenAI's field, passed to the chat template as the variable `reasoning_effort` (as vLLM does; over a
    # `reasoning_effort` in chat_template_kwargs). The values are the openai SDK's `ReasoningEffort`.
    reasoning_effort: ReasoningEffort | None = None

    @model_validator(mode="after")
    def _chat_fields(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "continue_final_message: cannot be combined with add_generation_prompt (set it to false)"
            )
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            raise ValueError("modalities: this server produces text only (['text'])")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} are set by the server")
        return self

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables: chat_template_kwargs, and reasoning_effort when set."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", "invalid_parameter")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    # One prompt (text or token ids) or a batch of them; strict: `true` is not token id 1.
    prompt: str | list[StrictInt] | list[StrictStr] | list[list[StrictInt]] = Field(min_length=1)
    echo: bool = False  # the prompt is prepended to the text (and its logprobs to the logprobs)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # 0 only with echo (vLLM): the prompt and its logprobs come back and nothing is generated.
    max_tokens: int | None = Field(default=None, ge=0)
    add_special_tokens: bool = True  # vLLM's: e.g. BOS, for a text prompt

    @model_validator(mode="after")
    def _completion_fields(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: must be at least 1 (0 only with echo)")
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            if len(self.prompt) > MAX_BATCH_PROMPTS:
                raise ValueError(f"prompt: a batch holds at most {MAX_BATCH_PROMPTS} prompts")
            if any(len(p) == 0 for p in self.prompt):
                raise ValueError("prompt: every prompt of a batch must be non-empty")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch's."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: one token is computed (the engine always samples one) and dropped."""
        return self.echo and self.max_tokens == 0

    @property
    def requested_max_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def requested_prompt_logprobs(self) -> int | None:
        # echo with logprobs reports the prompt's logprobs too (what lm-eval's loglikelihood requests read)
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


def structured_of(body: _SamplingFields) -> StructuredOutputs | None:
    """The request's output constraint, from whichever spelling it used; more than one is a 400."""
    found: list[tuple[str, StructuredOutputs]] = []

    def schema_text(where: str, schema: dict[str, Any] | str) -> str:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise APIError(400, f"{where}: not valid JSON: {e}", "invalid_parameter") from e
        check_json_schema(where, schema)
        return json.dumps(schema)

    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", StructuredOutputs(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise APIError(
                400, "response_format.json_schema: required for type json_schema", "invalid_parameter"
            )
        schema = schema_text("response_format.json_schema.schema", rf.json_schema.schema_)
        found.append(("response_format", StructuredOutputs(json=schema)))
    if body.guided_json is not None:
        found.append(("guided_json", StructuredOutputs(json=schema_text("guided_json", body.guided_json))))
    if body.guided_regex is not None:
        found.append(
            ("guided_regex", StructuredOutputs(regex=check_regex("guided_regex", body.guided_regex)))
        )
    if body.guided_choice is not None:
        found.append(("guided_choice", StructuredOutputs(choice=tuple(body.guided_choice))))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", StructuredOutputs(grammar=body.guided_grammar)))
    if body.regex is not None:
        found.append(("regex", StructuredOutputs(regex=check_regex("regex", body.regex))))
    if body.ebnf is not None:
        found.append(("ebnf", StructuredOutputs(grammar=body.ebnf)))
    so = body.structured_outputs
    if so is not None:
        set_ = {k: v for k, v in so.model_dump(by_alias=True).items() if v not in (None, False)}
        if len(set_) != 1:
            raise APIError(
                400,
                "structured_outputs: set exactly one of json, regex, choice, grammar, json_object",
                "invalid_parameter",
            )
        key, value = next(iter(set_.items()))
        where = f"structured_outputs.{key}"
        spec = {
            "json": lambda: StructuredOutputs(json=schema_text(where, value)),
            "regex": lambda: StructuredOutputs(regex=check_regex(where, value)),
            "choice": lambda: StructuredOutputs(choice=tuple(value)),
            "grammar": lambda: StructuredOutputs(grammar=value),
            "json_object": lambda: StructuredOutputs(json_object=True),
        }[key]()
        found.append(("structured_outputs", spec))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(400, f"{names}: at most one output constraint per request", "invalid_parameter")
    return found[0][1] if found else None


def check_json_schema(where: str, schema: Any) -> None:
    """400 naming `where` unless `schema` is a JSON schema (draft 2020-12 meta-schema)."""
    import jsonschema

    if not isinstance(schema, dict):
        raise APIError(400, f"{where}: a JSON schema must be an object", "invalid_parameter")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise APIError(400, f"{where}: invalid JSON schema: {e.message}", "invalid_parameter") from e


def check_regex(where: str, pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as e:
        raise APIError(400, f"{where}: invalid regular expression: {e}", "invalid_parameter") from e
    return pattern


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage; `reasoning_tokens` (with a reasoning parser) as `completion_tokens_details`."""
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body
