"""OpenAI request schemas (pydantic) and the errors the API answers with.

Validation that pydantic can express lives in the models (types, ranges); everything else raises `APIError`
with the HTTP status, OpenAI error type and a message naming the parameter.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from mmserve.engine.cache_salt import MAX_CACHE_SALT_CHARS, check_cache_salt
from mmserve.engine.sampling_params import SamplingParams


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
            413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")  # fmt: skip


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


# Integers travel to the engine in msgpack and int64 tensors: out-of-range values must be a 400 here, not an
# exception in the engine process (top_k=2**63 used to kill it).
INT64_MAX = 2**63 - 1
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


IGNORED_FIELDS = ("user", "metadata", "store", "service_tier")


class KvTransferParams(BaseModel):
    """Set by `mmserve router` on the requests it sends to prefill and decode servers (mmserve.disagg): the
    room names the request on both; the prefill server also gets the decode engine's bootstrap and backend."""

    model_config = ConfigDict(extra="forbid")

    room: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    decode_bootstrap: str | None = Field(default=None, pattern=r"^tcp://[^\s/]+:[0-9]{1,5}$")
    backend: Literal["zmq", "mooncake"] = "zmq"


class _SamplingFields(BaseModel):
    # A field this server does not implement is a 400 naming it ("extra_forbidden"), never accepted and
    # ignored; the few that cannot change the output are declared below (IGNORED_FIELDS) and logged.
    model_config = ConfigDict(extra="forbid")

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
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Tenant scope of the prefix and embedding caches (vLLM's field): equal salts share hits, others never.
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    kv_transfer_params: KvTransferParams | None = None  # router -> prefill / decode servers only
    # Accepted and ignored: they cannot change the output (README, "Request fields").
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("cache_salt")
    @classmethod
    def _cache_salt_is_text(cls, salt: str | None) -> str | None:
        check_cache_salt(salt)  # e.g. a lone surrogate, which could not travel to the engine
        return salt

    def ignored_fields(self) -> list[str]:
        """The fields of IGNORED_FIELDS this request set."""
        return [name for name in IGNORED_FIELDS if getattr(self, name) is not None]

    def sampling_params(self) -> SamplingParams:
        """Validated sampling settings; max_tokens None means the rest of the context (the engine resolves
        it)."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        try:
            return SamplingParams(
                max_tokens=self.requested_max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                min_p=self.min_p or 0.0, seed=self.seed, stop=stop or None, stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
            )  # fmt: skip
        except ValueError as e:
            raise APIError(400, str(e), "invalid_parameter") from e

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[StrictInt] | list[str] = Field(min_length=1)  # strict: `true` is not token id 1
    echo: Literal[False] = False

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
