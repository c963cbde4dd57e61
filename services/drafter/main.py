"""`python -m services.drafter`: load the drafter (with the target's embedding and LM head, and
nothing else of the target) and serve `dspark.v1.Drafter`."""

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
    from dspark.rejection import VerificationRule
    from dspark.structured_output import GrammarCompiler
    from services.drafter.servicer import DrafterServicer

    torch.set_num_threads(config.threads)
    model_dir = Path(config.model_dir) if config.model_dir else ensure_model()
    drafter_dir = Path(config.drafter_dir) if config.drafter_dir else DEFAULT_DRAFTER
    if not drafter_dir.is_dir():
        raise SystemExit(f"no drafter checkpoint at {drafter_dir} (pass --drafter-dir)")
    layer_ids = tuple(DrafterConfig.load(drafter_dir).target_layer_ids)
    # The target is read on the host for its embedding and LM head only (the drafter has its own
    # norm); those two tensors go to the device, the target's layers are dropped with `host`.
    host = load_target(model_dir, layer_ids, kv_cache_tokens=16, device="cpu", dtype=config.dtype)
    head = target_head(host, resolve_device(config.device))
    del host
    drafter = load_method_drafter(drafter_dir, head, apply_calibration=True)
    # Structured output masks the drafts with grammars compiled over the target's tokenizer
    # (read on the first grammar), as the verifier masks the target's rows.
    return DrafterServicer(drafter, head.vocab_size, list(layer_ids), drafter_dir.name, tracer,
                           config.idle_expiry_seconds, VerificationRule(config.verification),
                           GrammarCompiler(model_dir, head.vocab_size))


def target_head(runner, device: str):
    """What a drafter needs of its target, on `device`: the embedding and LM head (one tensor
    when they are tied), the model config and the runner's hidden layers and dtype, in the
    shape `load_method_drafter` reads a runner; nothing else of the target is kept."""
    from types import SimpleNamespace

    import torch

    embed = runner.model.embed_tokens.weight.detach()
    lm_head = runner.model.lm_head.weight.detach()
    tied = lm_head.data_ptr() == embed.data_ptr()
    embed = embed.to(device)
    lm_head = embed if tied else lm_head.to(device)
    return SimpleNamespace(
        model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=embed),
                              lm_head=SimpleNamespace(weight=lm_head)),
        model_config=runner.model_config, config=runner.config, dtype=runner.dtype,
        device=torch.device(device), vocab_size=runner.vocab_size)


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
