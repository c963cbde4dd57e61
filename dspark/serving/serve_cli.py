"""`dspark serve drafter|verifier|scheduler [flags]`: run one service in this process.

The same entry points as `python -m services.<name>`, with the same flags and environment
variables (`dspark serve verifier --help`)."""

from __future__ import annotations

import argparse
import importlib

SERVICES = {
    "drafter": ("services.drafter.main", "the drafter model and each request's context K/V"),
    "verifier": ("services.verifier.main", "the target model, KV caches and lossless verification"),
    "scheduler": ("services.scheduler.main",
                  "the gateway: gRPC Generation + OpenAI REST, the engine loop, admission"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="service", metavar="SERVICE", required=True)
    for name, (module, help_text) in SERVICES.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).configure(sp)


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(SERVICES[args.service][0])
    return int(module.run(args) or 0)
