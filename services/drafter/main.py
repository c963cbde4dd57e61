"""`python -m services.drafter`: load the drafter (sharing the target's embedding and LM head)
and serve `dspark.v1.Drafter`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dspark.serving.config import DrafterServiceConfig, add_arguments, from_args

ENV_PREFIX = "DSPARK_DRAFTER"


def configure(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser, DrafterServiceConfig, ENV_PREFIX)


def build_servicer(config: DrafterServiceConfig, tracer):
    import torch

    from dspark.loading import load_method_drafter, load_target, resolve_device
    from dspark.fetch import ensure_model
    from dspark.paths import DEFAULT_DRAFTER
    from dspark.models.drafter_config import DrafterConfig
    from services.drafter.servicer import DrafterServicer

    torch.set_num_threads(config.threads)
    model_dir = Path(config.model_dir) if config.model_dir else ensure_model()
    drafter_dir = Path(config.drafter_dir) if config.drafter_dir else DEFAULT_DRAFTER
    if not drafter_dir.is_dir():
        raise SystemExit(f"no drafter checkpoint at {drafter_dir} (pass --drafter-dir)")
    layer_ids = tuple(DrafterConfig.load(drafter_dir).target_layer_ids)
    # The target is loaded only for its embedding and LM head (shared, frozen): a tiny KV cache.
    runner = load_target(model_dir, layer_ids, kv_cache_tokens=16,
                         device=resolve_device(config.device), dtype=config.dtype)
    drafter = load_method_drafter(drafter_dir, runner, apply_calibration=True)
    return DrafterServicer(drafter, runner.vocab_size, list(layer_ids), drafter_dir.name, tracer,
                           config.idle_expiry_seconds)


def start(config: DrafterServiceConfig, tracer):
    """Load the drafter and start serving (returns at once): (server, health, servicer, port).

    `serve` below blocks on it until a signal; the Ray Serve replica (deploy/ray_serve.py) holds
    it for the replica's lifetime."""
    from dspark.serving import grpc_runtime
    from dspark.serving.protos import rpc

    servicer = build_servicer(config, tracer)
    server, health, port = grpc_runtime.start_server(
        servicer, rpc.drafter.add_DrafterServicer_to_server, "dspark.v1.Drafter", config.host, config.port,
        internal_token=config.internal_token_value)
    return server, health, servicer, port


def serve(config: DrafterServiceConfig) -> int:
    from dspark.serving import grpc_runtime
    from dspark.serving.tracing import setup_tracing

    logger = grpc_runtime.service_logger("drafter")
    tracing = setup_tracing("drafter", config)
    server, health, servicer, port = start(config, tracing.tracer)
    grpc_runtime.log_event(logger, "serving", address=f"{config.host}:{port}", drafter=servicer.name,
                           gamma=servicer.drafter.gamma, pid=os.getpid())
    grpc_runtime.wait_for_signal()
    grpc_runtime.drain(server, health, ["dspark.v1.Drafter"], config.grace_seconds, logger)
    tracing.shutdown()
    return 0


def run(args: argparse.Namespace) -> int:
    return serve(from_args(DrafterServiceConfig, args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.drafter",
                                     description="DSpark drafter service (drafter + context K/V)")
    configure(parser)
    args = parser.parse_args(argv)
    try:
        config = from_args(DrafterServiceConfig, args)
    except ValueError as e:
        parser.error(str(e))
    return serve(config)
