"""`python -m services.scheduler`: the gateway. Connects to the verifier and drafter services,
runs the engine loop over remote proxies, and serves gRPC Generation and the OpenAI REST API."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from dspark.serving.config import SCHEDULER_ENV_PREFIX, SchedulerConfig, add_arguments, from_args

ENV_PREFIX = SCHEDULER_ENV_PREFIX


def configure(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser, SchedulerConfig, ENV_PREFIX)


@dataclass
class Scheduler:
    """Everything a running scheduler holds, so that `stop` can take it down in order."""

    config: SchedulerConfig
    loop: object
    grpc_server: object
    health: object
    rest_server: object
    verifiers: list
    drafters: list
    tracing: object
    meter_provider: object | None
    logger: object
    grpc_port: int
    http_port: int
    make_app: object
    """() -> a new FastAPI app of this scheduler's REST API (one per event loop that serves it:
    Ray Serve's replica serves its own beside the uvicorn server)."""

    def stop(self) -> None:
        from dspark.serving import grpc_runtime

        grpc_runtime.set_serving(self.health, ["dspark.v1.Generation"], False)
        self.loop.stop(self.config.grace_seconds)  # drain in-flight requests
        self.rest_server.stop()
        self.grpc_server.stop(1.0).wait()
        for proxy in [*self.drafters, *self.verifiers]:
            proxy.close()
        self.tracing.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()  # flushes the last export
        grpc_runtime.log_event(self.logger, "stopped")


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@dataclass
class Cohort:
    """One engine loop's own proxies (a cohort shares the services, not the connections)."""

    verifier: object
    drafter: object | None
    engine: object


def connect_cohort(config: SchedulerConfig, metrics, logger, cost_table) -> Cohort:
    """A RemoteVerifier, a RemoteDrafter (unless none) and an Engine over them."""
    from dspark.admission import PolicyKind
    from dspark.cost_table import CostTable, ThetaObjective
    from dspark.loading import build_engine
    from dspark.serving import grpc_runtime
    from dspark.serving.remote_drafter import RemoteDrafter
    from dspark.serving.remote_verifier import RemoteVerifier

    def restored(ids: list[str]) -> None:
        metrics.add_verifier_restores(len(ids))
        grpc_runtime.log_event(logger, "verifier caches restored", requests=ids)

    def drafter_state(available: bool) -> None:
        metrics.set_drafter_available(available)
        grpc_runtime.log_event(logger, "drafter back: speculating" if available
                               else "drafter lost: plain decoding until it is back")

    token = config.internal_token_value
    verifier = RemoteVerifier(config.verifier, config.verifier_wait_seconds, on_restore=restored,
                              internal_token=token)
    # One cohort drafts and verifies in turn; several overlap one's drafting with another's
    # verification, so drafting is (roughly) free to each: the paper's objective.
    engine_config = config.engine_config(
        objective=ThetaObjective.SHARED_DEVICE if config.cohorts == 1 else ThetaObjective.PAPER,
        # The cohorts share the verifier's cache: an equal part each.
        kv_cache_tokens=verifier.kv_cache_tokens // config.cohorts,
        kv_block_size=verifier.kv_block_size)
    drafter = None
    if config.drafter and engine_config.admission.policy.kind is not PolicyKind.NONE:
        drafter = RemoteDrafter(config.drafter, config.draft_timeout_seconds,
                                config.drafter_retry_seconds, config.verifier_wait_seconds,
                                on_state_change=drafter_state, internal_token=token)
        if drafter.target_layer_ids != verifier.hidden_layer_ids:
            raise SystemExit(f"the drafter reads target layers {drafter.target_layer_ids} but the "
                             f"verifier returns {verifier.hidden_layer_ids}")
    # Each engine refreshes its own copy of SPS(B) (CostTable is not shared across threads).
    table = CostTable.from_dict(cost_table.to_dict())
    return Cohort(verifier, drafter, build_engine(verifier, drafter, table, engine_config))


def plausible_stored_table(stored: dict | None, name: str, logger):
    """The CostTable stored for `name` (a dict from the store, or None), or None when there is
    none or its profile is implausible (dspark.step_timing.implausibility): the verifier measures
    a fresh one at every start, so a table measured on a busy machine does not outlive a restart."""
    from dspark.cost_table import CostTable
    from dspark.step_timing import implausibility

    if not stored:
        return None
    table = CostTable.from_dict(stored)
    problem = implausibility(table.batch_tokens, table.step_seconds)
    if problem is None:
        return table
    logger.warning("ignoring the stored cost table %s (%s): taking the verifier's", name, problem)
    return None


def start(config: SchedulerConfig) -> Scheduler:
    from dspark.fetch import ensure_model
    from dspark.stop_tokens import stop_token_ids
    from dspark.serving import grpc_runtime
    from dspark.serving.cohorts import Cohorts
    from dspark.serving.engine_loop import EngineLoop
    from dspark.serving.metrics import SchedulerMetrics
    from dspark.serving.otel_metrics import metric_reader, setup_metrics
    from dspark.serving.protos import rpc
    from dspark.serving.remote_verifier import RemoteVerifier
    from dspark.serving.auth import ApiKeys
    from dspark.serving.store import open_store
    from dspark.serving.tracing import setup_tracing
    from services.scheduler.gateway import Gateway
    from services.scheduler.grpc_api import ApiKeyInterceptor, GenerationServicer
    from services.scheduler.rest_api import RestServer, build_app

    logger = grpc_runtime.service_logger("scheduler")
    tracing = setup_tracing("scheduler", config)
    metrics = SchedulerMetrics(config.model_name)
    meter_provider = setup_metrics("scheduler", metrics, metric_reader(config))
    store = open_store(config.redis_url, config.redis_prefix, config.stored_request_ttl_seconds)
    probe = RemoteVerifier(config.verifier, config.verifier_wait_seconds,
                           internal_token=config.internal_token_value)
    name = probe.name  # the cost table is stored under the target's name
    table = plausible_stored_table(store.load_cost_table(name), name, logger) or probe.cost_table()
    probe.close()
    store.save_cost_table(name, table.to_dict())
    cohorts = [connect_cohort(config, metrics, logger, table) for _ in range(config.cohorts)]
    model_dir = Path(config.model_dir) if config.model_dir else ensure_model()
    tokenizer = load_tokenizer(model_dir)
    loops = Cohorts([EngineLoop(c.engine, store, metrics, tracing.tracer, logger, name, cohort=i)
                     for i, c in enumerate(cohorts)])
    verifier = cohorts[0].verifier
    gateway = Gateway(loops, store, tokenizer, config.model_name, config.max_tokens_limit,
                      verifier.max_context_tokens, verifier.vocab_size, stop_token_ids(tokenizer),
                      metrics, max_waiting=config.max_waiting,
                      max_prompt_chars=config.max_prompt_chars)
    keys = ApiKeys(config.api_key_set)
    loops.start()

    # A thread per stream the gateway can admit (running + waiting), and spare ones so that
    # health checks and refusals (429) are answered while every admitted stream holds one.
    grpc_threads = config.max_running * config.cohorts + config.max_waiting + 8
    grpc_server, health = grpc_runtime.new_server(
        interceptors=(ApiKeyInterceptor(keys),), threads=grpc_threads,
        max_message_bytes=grpc_runtime.PUBLIC_MAX_MESSAGE_BYTES)
    rpc.generation.add_GenerationServicer_to_server(GenerationServicer(gateway, keys), grpc_server)
    grpc_port = grpc_runtime.bind(grpc_server, config.host, config.grpc_port)
    grpc_server.start()
    drafters = [c.drafter for c in cohorts if c.drafter is not None]

    def render_metrics() -> bytes:
        metrics.set_fallback_rounds(sum(d.fallback_rounds for d in drafters))
        return metrics.render()

    def health_body() -> dict:
        return {"status": "ok", "model": config.model_name,
                "drafter": all(d.available for d in drafters) if drafters else None,
                "cohorts": len(cohorts), "running": loops.num_running(),
                "waiting": loops.queue_depth()}

    def make_app():
        return build_app(gateway, keys, metrics, render_metrics, health_body)

    rest_server = RestServer(make_app(), config.host, config.http_port).start()
    grpc_runtime.set_serving(health, ["dspark.v1.Generation"], True)
    http_port = rest_server.port
    grpc_runtime.log_event(logger, "serving", http=f"{config.host}:{http_port}",
                           grpc=f"{config.host}:{grpc_port}", verifier=config.verifier,
                           drafter=config.drafter or None, policy=config.policy,
                           cohorts=config.cohorts,
                           store="redis" if config.redis_url else "memory", pid=os.getpid())
    return Scheduler(config, loops, grpc_server, health, rest_server,
                     [c.verifier for c in cohorts], drafters, tracing, meter_provider, logger,
                     grpc_port, http_port, make_app)


def serve(config: SchedulerConfig) -> int:
    import torch

    from dspark.serving import grpc_runtime

    torch.set_num_threads(1)  # the scheduler only routes tensors; the model work is elsewhere
    scheduler = start(config)
    grpc_runtime.wait_for_signal()
    scheduler.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    return serve(from_args(SchedulerConfig, args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.scheduler",
                                     description="DSpark scheduler / gateway (gRPC + OpenAI REST)")
    configure(parser)
    args = parser.parse_args(argv)
    try:
        config = from_args(SchedulerConfig, args)
    except ValueError as e:
        parser.error(str(e))
    return serve(config)
