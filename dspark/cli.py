"""The `dspark` command (docs/design.md section 10).

Each subcommand lives in its own module, which defines

    def configure(parser: argparse.ArgumentParser) -> None   # add the subcommand's flags
    def run(args: argparse.Namespace) -> int                  # do it; return the exit code

Modules are imported only when their subcommand runs, so `dspark --help` stays fast and a
subcommand's heavy imports (torch, transformers) cost nothing to the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "fetch-model": ("dspark.fetch", "prepare the demo target model offline and print its folder"),
    "profile": ("dspark.profiling", "measure the target's steps per second SPS(B); write the cost table and plot"),
    "generate": ("dspark.generate", "stream a generation from the embedded engine"),
    "bench": ("dspark.evaluation.speed.bench_cli",
              "end-to-end speed tables: tokens/s per method vs target-only and transformers peers"),
    "demo": ("dspark.demo", "show lossless verification on a toy target and drafter"),
    "data": ("dspark.training.data", "generate the drafter's training data: the target answers prompts"),
    "eval": ("dspark.evaluation.eval_cli",
             "acceptance per method: tau, per-position conditional acceptance, ECE/AUC"),
    "calibrate": ("dspark.evaluation.calibrate_cli",
                  "fit STS on the held-out split; write calibration.json beside the drafter"),
    "train": ("dspark.training.train_cli",
              "train a drafter (DSpark, DFlash or Eagle-style) with the target as an online teacher"),
    "serve": ("dspark.serving.serve_cli",
              "run one service: drafter | verifier | scheduler (gRPC; the scheduler also REST)"),
    "up": ("dspark.serving.up_cli",
           "the whole service stack as local processes on loopback; Ctrl-C stops it cleanly"),
    "loadtest": ("loadtest.sweep", "SLA sweep with Locust per policy: Pareto frontier CSV/PNG, verification length"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(_module=module_name)
        # Flags are added lazily (below) only for the chosen subcommand.
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # Find the subcommand first, then let its module add its flags and parse again.
    if argv and argv[0] in COMMANDS:
        module = importlib.import_module(COMMANDS[argv[0]][0])
        sub_parser = argparse.ArgumentParser(prog=f"dspark {argv[0]}",
                                             description=COMMANDS[argv[0]][1])
        module.configure(sub_parser)
        args = sub_parser.parse_args(argv[1:])
        return int(module.run(args) or 0)
    parser.parse_args(argv)  # prints usage / errors for unknown commands
    return 2


if __name__ == "__main__":
    sys.exit(main())
