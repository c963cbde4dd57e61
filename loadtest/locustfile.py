"""Locust users for the DSpark Serve scheduler: streamed chat completions over REST (SSE) and
gRPC `Generation.Generate`.

Every response fires, besides its own request entry, three custom entries so Locust's web UI and
CSV (`--csv`) show them; their "response time" column carries the value named by the type:

| request type | name | "response time" column |
|---|---|---|
| `SSE` / `gRPC` | the route | whole response, ms (content size = completion tokens) |
| `ttft` | `rest` / `grpc` | time to first token, ms |
| `tokens_per_s` | `rest` / `grpc` | output tokens/s after the first token (not ms) |
| `sla` | `rest >= X tok/s` | the same tokens/s; a failure when below the SLA X |

so the `sla` row's failure ratio is the share of responses that missed the SLA.

Options (also environment variables, and in the web UI): `--sla-tokens-per-s`
(DSPARK_SLA_TOKENS_PER_S), `--model`, `--max-tokens`, `--temperature`, `--api-key`,
`--grpc-target` (default: the --host's host, port 50050), `--eval-dir`, `--eval-sets`,
`--prompt-chars`, `--dspark-summary` (a JSON file with every response's figures and the
run's token count, read by loadtest/sweep.py).

Headless, bounded:  locust -f loadtest/locustfile.py --headless -u 4 -r 4 -t 60s
    --host http://127.0.0.1:8000 --csv out/run ChatStreamUser
"""

from __future__ import annotations

# gRPC's C core must cooperate with gevent (Locust's concurrency) before any channel exists.
import grpc
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import itertools  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from urllib.parse import urlparse  # noqa: E402

from locust import HttpUser, User, constant, events, task  # noqa: E402

# Locust loads this file by path: the checkout goes on sys.path before loadtest (or dspark, and so
# dspark.paths.REPO_ROOT) can be imported, hence its own path here.
if (_checkout := str(Path(__file__).resolve().parents[1])) not in sys.path:
    sys.path.insert(0, _checkout)

from loadtest.prompts import DEFAULT_EVAL_DIR, load_first_turns  # noqa: E402
from loadtest.timing import ResponseRecord, RunSummary, StreamTiming  # noqa: E402


@events.init_command_line_parser.add_listener
def add_arguments(parser) -> None:
    parser.add_argument("--sla-tokens-per-s", type=float, default=10.0,
                        env_var="DSPARK_SLA_TOKENS_PER_S", include_in_web_ui=True,
                        help="per-user output speed a response must reach to meet the SLA")
    parser.add_argument("--model", default="dspark", env_var="DSPARK_LOADTEST_MODEL",
                        include_in_web_ui=True, help="model name the scheduler serves")
    parser.add_argument("--max-tokens", type=int, default=128, env_var="DSPARK_LOADTEST_MAX_TOKENS",
                        include_in_web_ui=True)
    parser.add_argument("--temperature", type=float, default=0.0,
                        env_var="DSPARK_LOADTEST_TEMPERATURE", include_in_web_ui=True)
    parser.add_argument("--api-key", default="", env_var="DSPARK_LOADTEST_API_KEY",
                        help="Bearer key, when the scheduler has keys")
    parser.add_argument("--grpc-target", default="", env_var="DSPARK_LOADTEST_GRPC_TARGET",
                        help="host:port of gRPC Generation (default: --host's host, port 50050)")
    parser.add_argument("--eval-dir", default=str(DEFAULT_EVAL_DIR), env_var="DSPARK_EVAL_DIR")
    parser.add_argument("--eval-sets", default="", env_var="DSPARK_LOADTEST_EVAL_SETS",
                        help="comma-separated set names (default: every *.jsonl)")
    parser.add_argument("--prompt-chars", type=int, default=0,
                        env_var="DSPARK_LOADTEST_PROMPT_CHARS",
                        help="cut prompts to this many characters (0: whole first turn)")
    parser.add_argument("--dspark-summary", default="", env_var="DSPARK_LOADTEST_SUMMARY",
                        help="write the run's per-response figures here as JSON at the end")


@events.init.add_listener
def attach_summary(environment, **_kwargs) -> None:
    """One RunSummary per Locust environment (the users of this process report into it)."""
    options = environment.parsed_options
    sla = options.sla_tokens_per_s if options else 10.0
    if sla <= 0:
        raise SystemExit(f"--sla-tokens-per-s must be > 0, got {sla}")
    environment.dspark_summary = RunSummary(sla_tokens_per_s=sla)


@events.test_start.add_listener
def start_window(environment, **_kwargs) -> None:
    environment.dspark_summary.start()


@events.test_stop.add_listener
def stop_window(environment, **_kwargs) -> None:
    environment.dspark_summary.stop()
    path = environment.parsed_options.dspark_summary if environment.parsed_options else ""
    if path:
        environment.dspark_summary.write(Path(path))


_USER_SEEDS = itertools.count()  # user i of this process draws prompts with seed i


class _PromptSource:
    """Prompts of the eval sets, drawn at random with a per-user seed (reproducible runs)."""

    _cache: dict[tuple, list[str]] = {}

    def __init__(self, options, seed: int) -> None:
        key = (options.eval_dir, options.eval_sets, options.prompt_chars)
        if key not in self._cache:
            sets = tuple(s for s in options.eval_sets.split(",") if s)
            self._cache[key] = load_first_turns(Path(options.eval_dir), sets, options.prompt_chars)
        self.prompts = self._cache[key]
        self.rng = random.Random(seed)

    def draw(self) -> str:
        return self.rng.choice(self.prompts)


def report(environment, user_class: str, timing: StreamTiming) -> None:
    """Fire the custom ttft / tokens_per_s / sla entries of one finished response."""
    summary: RunSummary = environment.dspark_summary
    fire = environment.events.request.fire
    ttft = timing.ttft_ms
    if ttft is None:
        return
    fire(request_type="ttft", name=user_class, response_time=ttft, response_length=0,
         exception=None, context={})
    speed = timing.tokens_per_s
    met = None
    if speed is not None:
        met = speed >= summary.sla_tokens_per_s
        fire(request_type="tokens_per_s", name=user_class, response_time=speed,
             response_length=timing.tokens, exception=None, context={})
        miss = None if met else AssertionError(
            f"{speed:.1f} tokens/s below the SLA of {summary.sla_tokens_per_s:g}")
        fire(request_type="sla", name=f"{user_class} >= {summary.sla_tokens_per_s:g} tok/s",
             response_time=speed, response_length=0, exception=miss, context={})
    summary.add(ResponseRecord(user_class, ttft, speed, timing.tokens, met))


def sse_events(response):
    """The `data:` payloads of a server-sent-events response, as each HTTP chunk arrives."""
    buffer = b""
    for piece in response.iter_content(chunk_size=None):  # one HTTP chunk at a time
        buffer += piece
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.splitlines():
                if line.startswith(b"data:"):
                    yield line[5:].strip().decode()


class ChatStreamUser(HttpUser):
    """Streams `/v1/chat/completions` (`stream: true`) back to back: concurrency = users."""

    wait_time = constant(0)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.options = options
        self.prompts = _PromptSource(options, seed=next(_USER_SEEDS))
        self.headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}

    @task
    def chat_stream(self) -> None:
        body = {"model": self.options.model, "stream": True, "max_tokens": self.options.max_tokens,
                "temperature": self.options.temperature,
                "messages": [{"role": "user", "content": self.prompts.draw()}]}
        summary: RunSummary = self.environment.dspark_summary
        timing = StreamTiming()
        with self.client.post("/v1/chat/completions", json=body, headers=self.headers,
                              stream=True, catch_response=True,
                              name="/v1/chat/completions (SSE)") as response:
            try:
                if response.status_code != 200:
                    message = f"HTTP {response.status_code}: {response.text[:300]}"
                    summary.note_error(message)
                    response.failure(message)
                    return
                for data in sse_events(response):
                    if data == "[DONE]":
                        break
                    payload = json.loads(data)
                    if "error" in payload:
                        message = payload["error"].get("message", "stream error")
                        summary.note_error(message)
                        response.failure(message)
                        return
                    n = len((payload.get("dspark") or {}).get("token_ids") or [])
                    timing.on_tokens(n)
                    summary.count_tokens(n)
                response.request_meta["response_length"] = timing.tokens
                response.request_meta["response_time"] = 1000 * (time.perf_counter()
                                                                  - timing.started)
                response.success()
            finally:
                response.close()  # a user stopped mid-stream frees the request at once
        report(self.environment, "rest", timing)


def grpc_target(options, host_url: str) -> str:
    if options.grpc_target:
        return options.grpc_target
    return f"{urlparse(host_url or 'http://127.0.0.1').hostname}:50050"


class GrpcGenerateUser(User):
    """Calls `Generation.Generate` (server streaming) back to back: concurrency = users."""

    wait_time = constant(0)

    def on_start(self) -> None:
        from dspark.serving.protos import pb, rpc

        self.pb = pb
        options = self.environment.parsed_options
        self.options = options
        self.prompts = _PromptSource(options, seed=next(_USER_SEEDS))
        self.target = grpc_target(options, self.host or self.environment.host)
        self.channel = grpc.insecure_channel(self.target)
        self.stub = rpc.generation.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {options.api_key}"),) if options.api_key else ()

    def on_stop(self) -> None:
        self.channel.close()

    @task
    def generate(self) -> None:
        pb = self.pb
        request = pb.generation.GenerateRequest(
            model=self.options.model, max_tokens=self.options.max_tokens,
            messages=[pb.generation.ChatMessage(role="user", content=self.prompts.draw())],
            sampling=pb.common.SamplingParams(temperature=self.options.temperature))
        summary: RunSummary = self.environment.dspark_summary
        timing = StreamTiming()
        error: Exception | None = None
        call = self.stub.Generate(request, metadata=self.metadata)
        try:
            for reply in call:
                timing.on_tokens(len(reply.token_ids))
                summary.count_tokens(len(reply.token_ids))
        except grpc.RpcError as e:
            error = RuntimeError(f"{e.code().name}: {e.details()}")
            summary.note_error(str(error))
        finally:
            call.cancel()  # no-op when finished; frees the request when the user is stopped
        self.environment.events.request.fire(
            request_type="gRPC", name="Generation/Generate", response_length=timing.tokens,
            response_time=1000 * (time.perf_counter() - timing.started), exception=error,
            context={})
        if error is None:
            report(self.environment, "grpc", timing)
