"""`python -m services.verifier`: load the target, profile SPS(B), serve `dspark.v1.Verifier`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dspark.serving.config import VerifierServiceConfig, add_arguments, from_args

ENV_PREFIX = "DSPARK_VERIFIER"
CPU_KV_CACHE_TOKENS = 65536
"""The verifier's KV cache on a CPU unless --kv-cache-tokens says otherwise (CUDA: dspark.devices)."""


def configure(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser, VerifierServiceConfig, ENV_PREFIX)


def hidden_layers(config: VerifierServiceConfig) -> tuple[int, ...]:
    """Explicit --hidden-layer-ids (`none`: no layers), else the drafter checkpoint's
    target_layer_ids, else none."""
    from dspark.drafter_choice import drafter_dir_or_shipped, parse_hidden_layer_ids
    from dspark.models.drafter_config import DrafterConfig

    explicit = parse_hidden_layer_ids(config.hidden_layer_ids)
    if explicit is not None:
        return explicit
    drafter_dir = drafter_dir_or_shipped(config.drafter_dir)
    if drafter_dir is not None and drafter_dir.is_dir():
        return tuple(DrafterConfig.load(drafter_dir).target_layer_ids)
    return ()


def build_servicer(config: VerifierServiceConfig, tracer):
    import torch

    from dspark.cost_table import CostTable
    from dspark.devices import kv_cache_tokens_for
    from dspark.loading import load_target, resolve_device
    from dspark.fetch import ensure_model
    from dspark.step_timing import startup_cost_table
    from dspark.rejection import VerificationRule
    from dspark.structured_output import GrammarCompiler
    from dspark.verifier import TargetVerifier
    from services.verifier.servicer import VerifierLimits, VerifierServicer

    torch.set_num_threads(config.threads)
    model_dir = Path(config.model_dir) if config.model_dir else ensure_model()
    device = resolve_device(config.device)
    kv_tokens = config.kv_cache_tokens or kv_cache_tokens_for(
        device, model_dir, getattr(torch, config.dtype), CPU_KV_CACHE_TOKENS)
    runner = load_target(model_dir, hidden_layers(config), kv_cache_tokens=kv_tokens,
                         device=device, dtype=config.dtype,
                         weights=None if config.weights == "auto" else config.weights)
    if config.cost_table and Path(config.cost_table).exists():
        table = CostTable.load(config.cost_table)
    else:
        table = startup_cost_table(runner)
    # Structured output compiles its grammars over the target's own tokenizer (read lazily).
    verifier = TargetVerifier(runner, VerificationRule(config.verification),
                              GrammarCompiler(model_dir, runner.vocab_size))
    return VerifierServicer(verifier, table,
                            VerifierLimits(config.max_context_tokens, config.idle_expiry_seconds), model_dir.name, tracer)


def start(config: VerifierServiceConfig, tracer):
    """Load the target and start serving (returns at once): (server, health, servicer, port).

    `serve` below blocks on it until a signal; the Ray Serve replica (deploy/ray_serve.py) holds
    it for the replica's lifetime."""
    from dspark.serving import grpc_runtime
    from dspark.serving.protos import rpc

    servicer = build_servicer(config, tracer)
    server, health, port = grpc_runtime.start_server(
        servicer, rpc.verifier.add_VerifierServicer_to_server, "dspark.v1.Verifier", config.host, config.port,
        internal_token=config.internal_token_value)
    return server, health, servicer, port


def serve(config: VerifierServiceConfig) -> int:
    from dspark.serving import grpc_runtime
    from dspark.serving.tracing import setup_tracing

    logger = grpc_runtime.service_logger("verifier")
    tracing = setup_tracing("verifier", config)
    server, health, servicer, port = start(config, tracing.tracer)
    grpc_runtime.log_event(logger, "serving", address=f"{config.host}:{port}",
                           model=servicer.name, pid=os.getpid(),
                           hidden_layer_ids=list(servicer.verifier.runner.config.hidden_layer_ids))
    grpc_runtime.wait_for_signal()
    grpc_runtime.drain(server, health, ["dspark.v1.Verifier"], config.grace_seconds, logger)
    tracing.shutdown()
    return 0


def run(args: argparse.Namespace) -> int:
    return serve(from_args(VerifierServiceConfig, args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.verifier",
                                     description="DSpark verifier service (target + lossless verification)")
    configure(parser)
    args = parser.parse_args(argv)
    try:
        config = from_args(VerifierServiceConfig, args)
    except ValueError as e:
        parser.error(str(e))
    return serve(config)
