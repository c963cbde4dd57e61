"""Typed configs of the three services, built from flags with environment-variable defaults.

One frozen dataclass per service, one docstring-like `help` per field, validation at
construction. `add_arguments` turns a config class into argparse flags (`--field-name`, default
from `DSPARK_<SERVICE>_<FIELD_NAME>` when set, else the field's default) and `from_args` builds
the validated config back, so flags, env and defaults are resolved in exactly one place.
Flags that set the engine (`engine_field`: the scheduler's, and deploy/ray_serve.py's) take
their defaults from `dspark.engine.EngineConfig`; `SchedulerConfig.engine_config` builds it.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from dspark.drafter_choice import parse_hidden_layer_ids

if TYPE_CHECKING:
    from dspark.engine import EngineConfig

C = TypeVar("C")

SCHEDULER_ENV_PREFIX = "DSPARK_SCHEDULER"
"""The scheduler's flags read their defaults from DSPARK_SCHEDULER_<FIELD_NAME>."""


class TraceExporter(enum.Enum):
    """Where OpenTelemetry spans go."""

    NONE = "none"
    CONSOLE = "console"
    """JSON spans on stdout (the SDK's console exporter)."""
    OTLP = "otlp"
    """OTLP/gRPC to `otlp_endpoint` (needs opentelemetry-exporter-otlp-proto-grpc)."""
    FILE = "file"
    """One JSON line per span appended to `trace_file` (tests and offline inspection)."""


def _field(default: Any, help: str, **kwargs: Any) -> Any:
    """A config field; `secret=True` keeps its value out of repr() and --help."""
    return field(default=default, metadata={"help": help, **kwargs},
                 repr=not kwargs.get("secret", False))


def engine_field(name: str, help: str, *, from_engine: Callable[[Any], Any] = lambda v: v,
                 to_engine: Callable[[Any], Any] = lambda v: v) -> Any:
    """A config field that sets the EngineConfig field `name`, in the engine's own fields or in
    one of its parts (`EngineConfig.field_path`; the part's docstring says what it does).
    Its default is EngineConfig's, so the two cannot drift; it is read when first needed, as
    dspark.engine imports torch. `from_engine` turns the engine's value into the flag's,
    `to_engine` (`SchedulerConfig.engine_config`) the flag's back."""

    def engine_default() -> Any:
        from dspark.engine import EngineConfig

        return from_engine(EngineConfig().value(name))

    return field(default_factory=engine_default,
                 metadata={"help": help, "engine_field": name, "to_engine": to_engine})


def engine_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` made by `engine_field`: those that set an EngineConfig field."""
    return [f for f in dataclasses.fields(cls) if "engine_field" in f.metadata]


def _check_port(port: int, what: str) -> None:
    if not (0 <= port <= 65535):
        raise ValueError(f"{what} must be a port number in 0..65535, got {port}")


@dataclass(frozen=True)
class TracingFields:
    trace_exporter: TraceExporter = _field(TraceExporter.NONE, "where spans go: none | console | "
                                           "otlp | file (the scheduler's metrics too, for "
                                           "console and otlp)")
    otlp_endpoint: str = _field("http://127.0.0.1:4317", "OTLP/gRPC collector (trace_exporter=otlp)")
    trace_file: str = _field("", "JSON-lines span file (trace_exporter=file)")

    def _check_tracing(self) -> None:
        if self.trace_exporter is TraceExporter.FILE and not self.trace_file:
            raise ValueError("trace_exporter=file needs --trace-file")


@dataclass(frozen=True)
class InternalTokenFields:
    internal_token: str = _field("", "shared secret the scheduler sends to the verifier and the "
                                     "drafter (metadata x-dspark-internal-token); set it by "
                                     "environment or file, not on a command line; empty = none",
                                 secret=True)
    internal_token_file: str = _field("", "file holding the internal token (overrides "
                                          "internal_token)")

    @property
    def internal_token_value(self) -> str:
        from dspark.serving.auth import read_secret_file

        return read_secret_file(self.internal_token_file) or self.internal_token


@dataclass(frozen=True)
class VerifierServiceConfig(TracingFields, InternalTokenFields):
    """The verifier service: the target model, its KV caches and lossless verification."""

    host: str = _field("127.0.0.1", "address to listen on (0.0.0.0 in containers)")
    port: int = _field(50052, "gRPC port")
    model_dir: str = _field("", "target model folder (default: the prepared SmolLM2)")
    drafter_dir: str = _field("", "drafter checkpoint whose target_layer_ids the verifier returns "
                                  "(default: the shipped checkpoint when present)")
    hidden_layer_ids: str = _field("", "comma-separated target layers to return (overrides "
                                       "--drafter-dir); 'none' = no features")
    dtype: str = _field("float32", "float32 | bfloat16")
    weights: str = _field("auto", "auto | q4 | dense: the target's linears; auto = the GGUF's own "
                                  "blocks (q4) where the model folder has its GGUF and the CPU the "
                                  "block kernel, else dense (RunnerConfig.weights)")
    device: str = _field("auto", "torch device: auto (CUDA when available), cpu, cuda, cuda:N")
    kv_cache_tokens: int = _field(0, "KV cache capacity in tokens, shared by all requests; 0 = "
                                     "by device: 65536 on a CPU, half the free memory on CUDA "
                                     "(docs/gpu.md)")
    max_context_tokens: int = _field(4096, "longest prompt + output of one request")
    cost_table: str = _field("", "SPS(B) table JSON; default: measured at start-up")
    threads: int = _field(1, "torch CPU threads")
    grace_seconds: float = _field(5.0, "on SIGTERM, seconds to finish in-flight calls")
    idle_expiry_seconds: float = _field(600.0, "free a request's KV cache after this long without "
                                               "a call (a scheduler that died); 0 = never")
    verification: str = _field("token", "token | block | drafter-invariant: how sampled "
                                         "requests' drafts are accepted, token by token, the "
                                         "whole block at once, or iff equal to the target's "
                                         "seeded Gumbel-max sample (all exact; greedy is the "
                                         "same under all)")

    def __post_init__(self) -> None:
        _check_port(self.port, "port")
        if self.idle_expiry_seconds < 0:
            raise ValueError("idle_expiry_seconds must be >= 0")
        if self.kv_cache_tokens < 0 or self.max_context_tokens < 2 or self.threads < 1:
            raise ValueError("kv_cache_tokens must be >= 0 (0: by device), threads >= 1, "
                             "max_context_tokens >= 2")
        parse_hidden_layer_ids(self.hidden_layer_ids)
        from dspark.models.runner import WEIGHT_MODES

        if self.weights not in ("auto", *WEIGHT_MODES):
            raise ValueError(f"weights must be auto or one of {', '.join(WEIGHT_MODES)}, "
                             f"got {self.weights!r}")
        from dspark.rejection import VerificationRule

        VerificationRule(self.verification)  # ValueError names the bad value
        self._check_tracing()


@dataclass(frozen=True)
class DrafterServiceConfig(TracingFields, InternalTokenFields):
    """The drafter service: the drafter model and each request's context K/V."""

    host: str = _field("127.0.0.1", "address to listen on (0.0.0.0 in containers)")
    port: int = _field(50051, "gRPC port")
    model_dir: str = _field("", "target model folder whose embedding and LM head the drafter "
                                "shares (default: the prepared SmolLM2)")
    drafter_dir: str = _field("", "drafter checkpoint folder (default: the shipped one)")
    dtype: str = _field("float32", "float32 | bfloat16")
    device: str = _field("auto", "torch device: auto (CUDA when available), cpu, cuda, cuda:N")
    threads: int = _field(1, "torch CPU threads")
    verification: str = _field("token", "token | block | drafter-invariant: the verifier's rule, "
                                        "the same as its --verification; under drafter-invariant "
                                        "sampled drafts are Gumbel-max samples with the "
                                        "target's noise, which that rule accepts iff equal to "
                                        "the target's sample")
    grace_seconds: float = _field(5.0, "on SIGTERM, seconds to finish in-flight rounds")
    idle_expiry_seconds: float = _field(600.0, "free a request's context after this long without "
                                               "a round (a scheduler that died); 0 = never")

    def __post_init__(self) -> None:
        _check_port(self.port, "port")
        if self.idle_expiry_seconds < 0:
            raise ValueError("idle_expiry_seconds must be >= 0")
        if self.threads < 1:
            raise ValueError("threads must be >= 1")
        from dspark.rejection import VerificationRule

        VerificationRule(self.verification)  # ValueError names the bad value
        self._check_tracing()


@dataclass(frozen=True)
class SchedulerConfig(TracingFields, InternalTokenFields):
    """The scheduler / gateway: client APIs, the engine loop, admission, request state."""

    host: str = _field("127.0.0.1", "address to listen on (0.0.0.0 in containers)")
    http_port: int = _field(8000, "OpenAI-compatible REST port")
    grpc_port: int = _field(50050, "gRPC Generation port")
    verifier: str = _field("127.0.0.1:50052", "verifier service address")
    drafter: str = _field("127.0.0.1:50051", "drafter service address; empty = no drafter")
    model_dir: str = _field("", "target model folder, for its tokenizer (default: prepared SmolLM2)")
    model_name: str = _field("dspark", "the model name clients send and /v1/models lists")
    # The engine's knobs: defaults from EngineConfig, which documents each in full.
    policy: str = engine_field(
        "policy", "async_topk | sync_greedy | none | fixed:N | threshold:H", from_engine=str)
    max_running: int = engine_field(
        "max_running", "requests verified together in one round (per cohort)")
    cohorts: int = _field(1, "engine loops over the same services, so one cohort drafts while "
                             "another verifies (dspark.serving.cohorts); 1 = strict alternation")
    sparse_top_k: int = engine_field(
        "sparse_top_k", "ship draft distributions as top-k; 0 = dense",
        from_engine=lambda k: k or 0, to_engine=lambda k: k or None)  # the engine's dense: None
    prefill_chunk_tokens: int = engine_field(
        "prefill_chunk_tokens", "chunked prefill: prompt tokens read per round, in the round's "
                                "verification forward; 0 = whole prompts in a forward of their "
                                "own")
    probe_requests: int = engine_field(
        "probe_requests", "async_topk: a probe (a round whose K is known to be 0) drafts at most "
                          "this many requests (those of the last probe still running, then the "
                          "newest); 0 = all")
    hold_features: bool = engine_field(
        "hold_features", "async_topk, after a fruitless probe: the verifier keeps the features "
                         "of requests a round does not draft until they are drafted")
    min_gain: float = engine_field(
        "min_gain", "async_topk: verify drafts only when the expected tokens/s gain at least "
                    "this factor over none; 1 = plain argmax")
    update_cost_table: bool = engine_field(
        "update_cost_table", "refresh SPS(B) from measured verification steps")
    max_tokens_limit: int = _field(2048, "largest max_tokens a client may ask for")
    redis_url: str = _field("", "redis://host:port/db for request state; empty = in memory")
    redis_prefix: str = _field("dspark:", "prefix of every Redis key this scheduler writes")
    api_keys: str = _field("", "comma-separated accepted Bearer keys; set it by environment, not "
                               "on a command line; empty (and no api_keys_file) = no auth",
                           secret=True)
    api_keys_file: str = _field("", "file of accepted Bearer keys, one a line (with api_keys: "
                                    "both are accepted)")
    max_waiting: int = _field(64, "requests queued beyond the running ones (all cohorts); more "
                                  "are refused with 429 / RESOURCE_EXHAUSTED and Retry-After")
    max_prompt_chars: int = _field(262144, "longest prompt text (all chat messages together) "
                                           "accepted for tokenization; longer is a 400 before "
                                           "the tokenizer runs")
    stored_request_ttl_seconds: float = _field(
        7 * 24 * 3600.0, "a finished request is forgotten this long after it finished; a "
                         "running one this long after its last round (in memory and in Redis)")
    draft_timeout_seconds: float = _field(10.0, "a round's drafts not back by then: the round "
                                                "runs as plain decoding")
    drafter_retry_seconds: float = _field(1.0, "while the drafter is down, how often to retry")
    verifier_wait_seconds: float = _field(60.0, "how long to wait for a restarting verifier")
    grace_seconds: float = _field(5.0, "on SIGTERM, seconds to finish in-flight rounds")

    def __post_init__(self) -> None:
        _check_port(self.http_port, "http_port")
        _check_port(self.grpc_port, "grpc_port")
        if self.max_running < 1 or self.max_tokens_limit < 1 or self.sparse_top_k < 0:
            raise ValueError("max_running and max_tokens_limit must be >= 1, sparse_top_k >= 0")
        if self.cohorts < 1:
            raise ValueError(f"cohorts must be >= 1, got {self.cohorts}")
        if not self.min_gain >= 1.0:
            raise ValueError(f"min_gain must be >= 1, got {self.min_gain}")
        if self.probe_requests < 0 or self.prefill_chunk_tokens < 0:
            raise ValueError("probe_requests and prefill_chunk_tokens must be >= 0")
        if self.max_waiting < 0 or self.max_prompt_chars < 1:
            raise ValueError("max_waiting must be >= 0 and max_prompt_chars >= 1")
        if not self.stored_request_ttl_seconds > 0:
            raise ValueError("stored_request_ttl_seconds must be > 0")
        from dspark.admission import AdmissionPolicy

        AdmissionPolicy.parse(self.policy)
        self._check_tracing()

    def engine_config(self, **scheduler_decided: Any) -> EngineConfig:
        """One cohort's EngineConfig: the engine fields' values, and what the scheduler decides
        from its services (`objective`, `kv_cache_tokens`, `kv_block_size`)."""
        from dspark.engine import EngineConfig

        return EngineConfig().with_values(**{f.metadata["engine_field"]: f.metadata["to_engine"](
            getattr(self, f.name)) for f in engine_fields(type(self))}, **scheduler_decided)

    @property
    def api_key_set(self) -> frozenset[str]:
        from dspark.serving.auth import parse_keys, read_secret_file

        return parse_keys(self.api_keys) | parse_keys(read_secret_file(self.api_keys_file))


# ------------------------------------------------------------------------------------------------
# dataclass <-> argparse


def _field_type(cls: type, f: dataclasses.Field) -> type:
    return typing.get_type_hints(cls)[f.name]


def _parse_value(kind: type, text: str) -> Any:
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"not a boolean: {text!r}")
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return kind(text)
    return kind(text)


def add_arguments(parser: argparse.ArgumentParser, cls: type, env_prefix: str) -> None:
    """One flag per field; the default shown comes from the environment when set there."""
    for f in dataclasses.fields(cls):
        kind = _field_type(cls, f)
        env = f"{env_prefix}_{f.name.upper()}"
        if env in os.environ:
            default = _parse_value(kind, os.environ[env])
        elif f.default is dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = f.default
        shown = repr(default.value if isinstance(default, enum.Enum) else default)
        if f.metadata.get("secret"):  # --help must not print a key taken from the environment
            shown = "set" if default else "''"
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} [env {env}; default: {shown}]"
        if kind is bool:
            parser.add_argument(flag, dest=f.name, type=lambda t: _parse_value(bool, t),
                                default=default, help=help_text)
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            parser.add_argument(flag, dest=f.name, type=kind, default=default,
                                choices=list(kind), help=help_text, metavar="{" + "|".join(
                                    e.value for e in kind) + "}")
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=default, help=help_text)


def from_args(cls: type[C], args: argparse.Namespace) -> C:
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def optional_path(text: str) -> Path | None:
    return Path(text) if text else None
