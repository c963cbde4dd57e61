"""The OpenAI-compatible REST API's request and response bodies as pydantic models.

They are the API's schema (`/openapi.json`, `/docs`) and its first validation layer: types and
shapes. Values that depend on the served model (max_tokens against the context, token ids against
the vocabulary, sampling ranges) are checked by services.scheduler.gateway, which the gRPC API
shares.

`null` means the default for every optional field. A field the API does not know is a 400 naming
it (`extra="forbid"`); OpenAI fields that only have an effect we do not implement are accepted at
their no-op value and a 400 naming them otherwise (UNSUPPORTED_UNLESS).

Validation errors carry the field they are about in `ctx["param"]` when a custom validator raised
them; rest_api turns every error into OpenAI's body with that `param`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat,
                      StrictInt, ValidationInfo, field_validator, model_validator)
from pydantic_core import PydanticCustomError

from dspark.logprobs import MAX_TOP_LOGPROBS
from services.scheduler.gateway import CHAT_ROLES

MAX_STOP_STRINGS = 4
"""OpenAI's limit on `stop`."""
MAX_COMPLETION_LOGPROBS = 5
"""OpenAI's limit on the legacy completions' `logprobs`."""


def invalid(message: str, param: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_parameter", message, {"param": param})


def _number_or_null(value: Any, info: ValidationInfo) -> Any:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise invalid(f"{info.field_name} must be a number, got {value!r}", info.field_name)
    return value


def _prompt_shape(value: Any) -> Any:
    if not isinstance(value, (str, list)):
        raise invalid("'prompt' must be a string or a list of token ids (one prompt)", "prompt")
    return value


def _messages_shape(value: Any) -> Any:
    if not isinstance(value, list) or not value:
        raise invalid("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise invalid(f"messages[{i}] must be an object with a role in {CHAT_ROLES}", "messages")
        if not isinstance(m.get("content"), str):
            raise invalid(f"messages[{i}].content must be a string", "messages")
    return value


Number = Annotated[StrictInt | StrictFloat | None, BeforeValidator(_number_or_null)]
"""A JSON number or null; any other type is a 400 saying `<field> must be a number`."""
Prompt = Annotated[str | list[StrictInt] | list[str] | list[list[StrictInt]],
                   BeforeValidator(_prompt_shape)]
"""A string, a list of token ids, or a one-element list of either (OpenAI's forms)."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool | None = None
    """Send token usage with the last chunk of a streamed chat completion (completions always do)."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str
    name: str | None = Field(None, description="Not supported (send null): the target's chat "
                             "template has no place for a participant's name.")

    @field_validator("name")
    @classmethod
    def _no_name(cls, name: str | None) -> None:
        if name is not None:
            raise invalid("messages[].name is not supported (the chat template has no names)",
                          "messages")
        return None


UNSUPPORTED_UNLESS: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}
"""OpenAI fields accepted only at the value where they do nothing."""


class _GenerationRequest(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: Number = Field(None, description="Tokens to generate (default 16).")
    temperature: Number = Field(None, description="0 = greedy (default 1).")
    top_p: Number = Field(None, description="Nucleus sampling mass in (0, 1] (default 1).")
    top_k: Number = Field(None, description="Sample from the k most likely tokens; 0 = all "
                                            "(vLLM's extension, default 0).")
    seed: Number = Field(None, description="Seed of this request's sampling (reproducible "
                                           "outputs at temperature > 0).")
    stop: str | list[str] | None = Field(
        None, validate_default=True, description=f"Up to {MAX_STOP_STRINGS} strings; the output ends before the first "
                          "one it contains (finish_reason 'stop').")
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="An end-user id (recorded nowhere; accepted for "
                                               "compatibility).")
    n: Number = Field(None, description="Only 1 is supported.")
    presence_penalty: Number = Field(None, description="Only 0 is supported.")
    frequency_penalty: Number = Field(None, description="Only 0 is supported.")
    logit_bias: dict[str, float] | None = Field(None, description="Only empty is supported.")

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str]:
        strings = [value] if isinstance(value, str) else list(value or [])
        strings = [s for s in strings if s]
        if len(strings) > MAX_STOP_STRINGS:
            raise invalid(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}", "stop")
        return strings

    @model_validator(mode="after")
    def _only_supported_values(self) -> "_GenerationRequest":
        for name, allowed in UNSUPPORTED_UNLESS.items():
            value = getattr(self, name, None)
            if value not in allowed:
                if name == "n":
                    raise invalid("only n = 1 is supported", "n")
                raise invalid(f"{name} is not supported (send {allowed[-1]!r} or leave it out)",
                              name)
        return self

    def sampling(self) -> dict[str, Any]:
        """Gateway.spec's keyword arguments, defaults in place of nulls."""
        return {"temperature": _default(self.temperature, 1.0),
                "top_p": _default(self.top_p, 1.0), "top_k": _default(self.top_k, 0),
                "seed": self.seed, "max_tokens": _default(self.max_tokens, 16)}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _top_count(value: Any, name: str, limit: int) -> int | None:
    """An integer in 0..limit or None, else a 400 naming `name`."""
    if value is None:
        return None
    if isinstance(value, float) and not value.is_integer():  # also NaN and infinities
        raise invalid(f"{name} must be an integer, got {value!r}", name)
    if not 0 <= value <= limit:
        raise invalid(f"{name} must be in 0..{limit}, got {value!r}", name)
    return int(value)


class CompletionRequest(_GenerationRequest):
    prompt: Prompt
    logprobs: Number = Field(None, description=(
        f"0..{MAX_COMPLETION_LOGPROBS}: return the target's log-probability of each produced "
        "token and of this many most probable tokens at its position (raw model distribution: "
        "before temperature, top-k, top-p)."))
    echo: StrictBool | None = Field(None, description="Only false is supported.")
    best_of: Number = Field(None, description="Only 1 is supported.")
    suffix: str | None = Field(None, description="Not supported (send null).")

    @model_validator(mode="after")
    def _logprobs_range(self) -> "CompletionRequest":
        self.logprobs = _top_count(self.logprobs, "logprobs", MAX_COMPLETION_LOGPROBS)
        return self

    def sampling(self) -> dict[str, Any]:
        return {**super().sampling(), "logprobs": self.logprobs}


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], BeforeValidator(_messages_shape)]
    max_completion_tokens: Number = Field(None, description="max_tokens under its newer name.")
    logprobs: StrictBool | None = Field(None, description=(
        "Return the target's log-probability of each produced token (raw model distribution: "
        "before temperature, top-k, top-p)."))
    top_logprobs: Number = Field(None, description=(
        f"0..{MAX_TOP_LOGPROBS}: also the most probable tokens at each position (needs "
        "logprobs: true)."))

    @model_validator(mode="after")
    def _logprobs_range(self) -> "ChatCompletionRequest":
        self.top_logprobs = _top_count(self.top_logprobs, "top_logprobs", MAX_TOP_LOGPROBS)
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        return self

    def sampling(self) -> dict[str, Any]:
        out = super().sampling()
        if self.max_tokens is None and self.max_completion_tokens is not None:
            out["max_tokens"] = self.max_completion_tokens
        out["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        return out


class ResumeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stream: StrictBool | None = None


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


# -- responses ----------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class SpecDecodeMetrics(BaseModel):
    """How speculation went for one request."""

    rounds: int
    drafts_verified: int
    drafts_accepted: int
    acceptance_length: float
    """Tokens per speculative round (accepted drafts + 1)."""
    accepted_per_position: list[int]


class DsparkExtras(BaseModel):
    """Our extension of OpenAI's bodies: the token ids and speculation metrics."""

    token_ids: list[int]
    spec_decode: SpecDecodeMetrics | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


FinishReason = str
""""stop" | "length" | "abort" | "error"."""


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """The target's log-probabilities of a chat choice's tokens (services.scheduler.logprobs_view)."""

    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(BaseModel):
    """The legacy completions' form (services.scheduler.logprobs_view)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class _Response(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage | None = None
    dspark: DsparkExtras


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "dspark"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class StoredRequestView(BaseModel):
    """A stored request (dspark.serving.store): GET /v1/requests/{id}."""

    id: str
    object: Literal["dspark.request"] = "dspark.request"
    status: str
    finish_reason: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    max_tokens: int
    sampling: dict[str, Any]
    created: int


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
