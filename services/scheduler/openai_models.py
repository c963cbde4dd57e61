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
from services.scheduler.gateway import (CHAT_ROLES, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                                       InvalidRequest, check_stop_strings)
from services.scheduler.samples import MAX_CHOICES, SampleCounts, sample_counts

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
        raise invalid("'prompt' must be a string, a list of token ids, or a list of either",
                      "prompt")
    return value


def _messages_shape(value: Any) -> Any:
    if not isinstance(value, list) or not value:
        raise invalid("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise invalid(f"messages[{i}] must be an object with a role in {CHAT_ROLES}", "messages")
        if isinstance(m.get("content"), list):
            m["content"] = _text_of_parts(m["content"], i)
        if not isinstance(m.get("content"), str):
            raise invalid(f"messages[{i}].content must be a string or a list of text parts",
                          "messages")
    return value


def _text_of_parts(parts: list, i: int) -> str:
    """Content given as parts (`[{"type": "text", "text": ...}, ...]`): their texts joined by
    newlines, as vLLM joins them. Only text parts: this server serves a text model."""
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid(f"messages[{i}].content[{j}]: only text parts are supported, got "
                          f"{str(kind)[:40]!r}", "messages")
        if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise invalid(f"messages[{i}].content[{j}] must be {{\"type\": \"text\", "
                          f"\"text\": <string>}}", "messages")
        texts.append(part["text"])
    return "\n".join(texts)


Number = Annotated[StrictInt | StrictFloat | None, BeforeValidator(_number_or_null)]
"""A JSON number or null; any other type is a 400 saying `<field> must be a number`."""
Prompt = Annotated[str | list[StrictInt] | list[str] | list[list[StrictInt]],
                   BeforeValidator(_prompt_shape)]
"""A string, a list of token ids, or a list of either (several prompts: OpenAI's forms)."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool | None = None
    """Send a last chunk with empty `choices` and the whole request's token usage."""
    continuous_usage_stats: StrictBool | None = None
    """With include_usage: every chunk also carries the usage so far (vLLM's extension)."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str = Field(description="A string, or a list of text parts (joined by newlines).")
    name: str | None = Field(None, description="A participant's name: accepted and not shown "
                             "to the model (the target's chat template has no place for it, "
                             "as under vLLM with such a template).")


UNSUPPORTED_UNLESS: dict[str, tuple[Any, ...]] = {
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
        None, validate_default=True, description=f"Up to {MAX_STOP_STRINGS} strings; the output "
        "ends before the first one it contains (finish_reason 'stop').")
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="An end-user id (recorded nowhere; accepted for "
                                               "compatibility).")
    n: Number = Field(None, description=(
        "Choices to return for each prompt: independent samples of it (a seeded request's "
        "sample i uses seed + i, as vLLM's do). Default 1."))
    presence_penalty: Number = Field(None, description=(
        "In [-2, 2]: subtracted from the logit of each token the output holds (default 0)."))
    frequency_penalty: Number = Field(None, description=(
        "In [-2, 2]: subtracted from a token's logit once per time the output holds it "
        "(default 0)."))
    repetition_penalty: Number = Field(None, description=(
        "> 0: the logit of a token of the prompt or output is divided by it when positive, "
        "multiplied by it otherwise; 1 = off (vLLM's extension, default 1)."))
    logit_bias: dict[str, Number] | None = Field(None, description=(
        "Token id (as a string) -> bias in [-100, 100] added to its logit."))
    min_p: Number = Field(None, description=(
        "In [0, 1]: drop tokens less probable than min_p times the most probable one, after "
        "temperature (vLLM's extension, default 0)."))
    ignore_eos: StrictBool | None = Field(None, description=(
        "Keep generating after the model's end-of-sequence tokens, up to max_tokens (vLLM's "
        "extension; stop strings still apply)."))
    min_tokens: Number = Field(None, description=(
        "EOS and the stop tokens are not produced before this many tokens, <= max_tokens "
        "(vLLM's extension, default 0)."))
    response_format: dict[str, Any] | None = Field(None, description=(
        'Structured output: {"type": "text"} (the default), {"type": "json_object"} (any JSON '
        'object) or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}} '
        "(JSON valid under the schema, compact separators). Every token is sampled under the "
        "grammar, exactly as without speculation; the output ends with the end-of-sequence "
        "token where the JSON is complete (or at max_tokens)."))

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str]:
        try:
            return check_stop_strings([value] if isinstance(value, str) else list(value or []))
        except InvalidRequest as e:
            raise invalid(e.message, "stop") from None

    @model_validator(mode="after")
    def _choices(self) -> "_GenerationRequest":
        self.n = _count(self.n, "n", 1, MAX_CHOICES)
        return self

    @model_validator(mode="after")
    def _only_supported_values(self) -> "_GenerationRequest":
        for name, allowed in UNSUPPORTED_UNLESS.items():
            value = getattr(self, name, None)
            if value not in allowed:
                raise invalid(f"{name} is not supported (send {allowed[-1]!r} or leave it out)",
                              name)
        return self

    def sampling(self) -> dict[str, Any]:
        """Gateway.spec's keyword arguments, defaults in place of nulls."""
        return {"temperature": _default(self.temperature, 1.0),
                "top_p": _default(self.top_p, 1.0), "top_k": _default(self.top_k, 0),
                "seed": self.seed, "max_tokens": _default(self.max_tokens, 16),
                "ignore_eos": bool(self.ignore_eos), "min_p": _default(self.min_p, 0.0),
                "presence_penalty": _default(self.presence_penalty, 0.0),
                "frequency_penalty": _default(self.frequency_penalty, 0.0),
                "repetition_penalty": _default(self.repetition_penalty, 1.0),
                "logit_bias": self.logit_bias, "min_tokens": _default(self.min_tokens, 0),
                "response_format": self.response_format}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def counts(self) -> SampleCounts:
        """Generations per prompt and choices returned per prompt."""
        return sample_counts(self.n, None)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk: vLLM's continuous_usage_stats, which needs
        include_usage."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


def _count(value: Any, name: str, low: int, high: int) -> int | None:
    """An integer in low..high or None, else a 400 naming `name`."""
    if value is None:
        return None
    if isinstance(value, float) and not value.is_integer():  # also NaN and infinities
        raise invalid(f"{name} must be an integer, got {value!r}", name)
    if not low <= value <= high:
        raise invalid(f"{name} must be in {low}..{high}, got {value!r}", name)
    return int(value)


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
        "before penalties, logit bias, temperature, top-k, top-p)."))
    echo: StrictBool | None = Field(None, description=(
        "Put the prompt's text before each choice's text (not with logprobs: prompt "
        "log-probabilities are not computed)."))
    best_of: Number = Field(None, description=(
        "Generate this many samples of each prompt (>= n) and return the n whose tokens have "
        "the highest cumulative log-probability under the target (the raw model distribution, "
        "as `logprobs` reports it); not with stream. Default n."))
    suffix: str | None = Field(None, description="Not supported (send null).")

    @model_validator(mode="after")
    def _logprobs_range(self) -> "CompletionRequest":
        self.logprobs = _top_count(self.logprobs, "logprobs", MAX_COMPLETION_LOGPROBS)
        self.best_of = _count(self.best_of, "best_of", 1, MAX_CHOICES)
        try:
            counts = self.counts
        except InvalidRequest as e:
            raise invalid(e.message, e.param) from None
        if self.stream and counts.ranked:
            raise invalid("best_of > n cannot be streamed (the best are known at the end)",
                          "best_of")
        if self.echo and self.logprobs is not None:
            raise invalid("echo with logprobs is not supported (prompt log-probabilities are "
                          "not computed)", "echo")
        return self

    @property
    def counts(self) -> SampleCounts:
        """Generations per prompt (best_of, else n) and choices returned per prompt (n)."""
        return sample_counts(self.n, self.best_of)

    def sampling(self) -> dict[str, Any]:
        return {**super().sampling(), "logprobs": self.logprobs}


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], BeforeValidator(_messages_shape)]
    max_completion_tokens: Number = Field(None, description="max_tokens under its newer name.")
    logprobs: StrictBool | None = Field(None, description=(
        "Return the target's log-probability of each produced token (raw model distribution: "
        "before penalties, logit bias, temperature, top-k, top-p)."))
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


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], BeforeValidator(_messages_shape)] | None = None
    add_special_tokens: StrictBool | None = Field(None, description=(
        "Add the tokenizer's special tokens (default: true for a prompt, false for messages, "
        "whose template writes them)."))
    add_generation_prompt: StrictBool | None = Field(None, description=(
        "Messages: end with the assistant turn's opening (default true)."))
    return_token_strs: StrictBool | None = Field(None, description=(
        "Also return each token's vocabulary entry."))

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise invalid("give exactly one of prompt, messages", "prompt")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


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
    dspark: DsparkExtras | None = None
    """Our extension: the first choice's token ids and speculation metrics (absent from the
    usage-only chunk that ends a stream)."""


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
