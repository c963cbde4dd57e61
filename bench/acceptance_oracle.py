"""How well could any confidence head do? The oracle acceptance probability, measured in real rounds.

The rejection sampler accepts draft x_k with probability min(1, p^t(x_k) / p^d(x_k)); averaged over
x_k ~ p^d_k that is alpha_k = sum_v min(p^t_k(v), p^d_k(v)) = 1 - TV(p^t_k, p^d_k), the exact
probability that position k survives given everything before it. No predictor that sees only the
context and x_1..x_{k-1} can know more than alpha_k, so:
- AUC(alpha_k) against the observed outcomes is the ceiling for the confidence head's AUC (the
  coin flip of the sampler itself is what the oracle cannot see; at temperature 0, alpha is 0 or 1
  and the ceiling is 1);
- ECE(alpha_k) must sit at the noise floor: a check that the verifier accepts with exactly the
  probability the rejection-sampling maths says (an exactness cross-check on real rounds);
- corr(c_k, alpha_k) says how much of the oracle the trained head has learnt.

It generates the eval prompts with the full block verified every round (`fixed:gamma`, as `dspark
eval`), reads the target's logits of every verified position, and pairs alpha_k with the head's
calibrated c_k on the at-risk positions (the verified positions whose predecessors were all
accepted). Prints a markdown table per temperature and one JSON line. Usage:
    .venv/bin/python bench/acceptance_oracle.py [--checkpoint checkpoints/dspark-markov]
        [--datasets gsm8k,math500,humaneval,mt-bench] [--limit 10] [--max-tokens 128]
        [--temperatures 1] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark.devices import add_device_argument, resolve_device
from dspark.calibration.metrics import ece_noise_floor, expected_calibration_error, roc_auc
from dspark.cost_table import CostTable
from dspark.engine import AdmissionConfig, BatchingConfig, EngineConfig
from dspark.loading import build_engine
from dspark.step_result import RoundRecord
from dspark.paths import EVAL_PROMPTS_DIR
from dspark.sampling import SamplingParams, SamplingTensors, probs_from_logits
from dspark.verifier import TargetVerifier

REPO = Path(__file__).resolve().parents[1]


class CapturingDrafter:
    """The drafter, keeping the blocks of its latest call (request order = the engine's)."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter
        self.blocks: list = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.drafter, name)

    def draft(self, requests, **kwargs):
        self.blocks = self.drafter.draft(requests, **kwargs)
        return self.blocks


class CapturingRunner:
    """The target runner, keeping the logits and token counts of its latest forward."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.logits: torch.Tensor | None = None
        self.rows: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def forward(self, items):
        out = self.runner.forward(items)
        self.logits, self.rows = out.logits, [len(item.token_ids) for item in items]
        return out


class OracleCollector:
    """Round observer: per at-risk position, (k, c_k, alpha_k, survived)."""

    def __init__(self, drafter: CapturingDrafter, runner: CapturingRunner, vocab_size: int,
                 sampling: SamplingParams) -> None:
        self.drafter, self.runner, self.vocab_size, self.sampling = drafter, runner, vocab_size, sampling
        self.rows: list[tuple[int, float, float, int]] = []

    def __call__(self, record: RoundRecord) -> None:
        logits = self.runner.logits  # [sum_r (l_r + 1), V]
        target = probs_from_logits(logits, SamplingTensors.from_params([self.sampling] * logits.shape[0]))
        start = 0
        for i, (block, n, accepted) in enumerate(zip(self.drafter.blocks, record.num_admitted,
                                                     record.num_accepted)):
            rows = self.runner.rows[i]
            assert rows == n + 1, (rows, n)
            draft = block.dense(self.vocab_size)[:n]  # [n, V]
            alpha = torch.minimum(target[start:start + n], draft).sum(dim=1)  # [n]
            for k in range(min(n, accepted + 1)):  # at risk: every earlier draft accepted
                self.rows.append((k + 1, float(record.confidences[i, k]), float(alpha[k]),
                                  int(k < accepted)))
            start += rows


def summarise(rows: np.ndarray, max_position: int) -> list[dict]:
    """rows [m, 4] (k, c, alpha, survived) -> one dict per position 1..max_position."""
    out = []
    for k in range(1, max_position + 1):
        sel = rows[rows[:, 0] == k]
        if len(sel) < 20 or sel[:, 3].min() == sel[:, 3].max():
            break
        c, alpha, y = sel[:, 1], sel[:, 2], sel[:, 3]
        out.append({
            "k": k, "at_risk": int(len(sel)), "survived": float(y.mean()),
            "mean_c": float(c.mean()), "mean_alpha": float(alpha.mean()),
            "auc_c": roc_auc(c, y), "auc_alpha": roc_auc(alpha, y),
            "ece_c": expected_calibration_error(c, y), "ece_alpha": expected_calibration_error(alpha, y),
            "ece_floor_alpha": ece_noise_floor(alpha),
            "corr_c_alpha": float(np.corrcoef(c, alpha)[0, 1]) if c.std() > 0 and alpha.std() > 0 else float("nan"),
        })
    return out


def table(temperature: float, stats: list[dict]) -> str:
    lines = [f"**temperature {temperature:g}: the head's c_k against the oracle alpha_k "
             f"(at-risk positions, all datasets pooled)**", "",
             "| k | at risk | survived | mean c | mean alpha | AUC c | AUC alpha (ceiling) | "
             "corr(c, alpha) | ECE c | ECE alpha | ECE floor |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in stats:
        lines.append(f"| {s['k']} | {s['at_risk']} | {s['survived']:.3f} | {s['mean_c']:.3f} | "
                     f"{s['mean_alpha']:.3f} | {s['auc_c']:.3f} | {s['auc_alpha']:.3f} | "
                     f"{s['corr_c_alpha']:.3f} | {100 * s['ece_c']:.2f}% | {100 * s['ece_alpha']:.2f}% | "
                     f"{100 * s['ece_floor_alpha']:.2f}% |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    parser.add_argument("--checkpoint", type=Path, default=REPO / "checkpoints" / "dspark-markov")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="the target's folder (default: dspark fetch-model's)")
    parser.add_argument("--eval-dir", type=Path, default=EVAL_PROMPTS_DIR)
    parser.add_argument("--datasets", default="gsm8k,math500,humaneval,mt-bench")
    parser.add_argument("--limit", type=int, default=10, help="prompts per dataset")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperatures", default="1")
    parser.add_argument("--max-running", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from dspark.evaluation.eval_cli import read_eval_prompts, stop_token_ids
    from dspark.loading import load_method_drafter, load_target
    from dspark.fetch import ensure_model
    from dspark.models.drafter_config import DrafterConfig
    from dspark.training.data import encode_chat

    model_dir = args.model_dir or ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [encode_chat(tokenizer, text) for name in args.datasets.split(",")
               for text in read_eval_prompts(args.eval_dir / f"{name}.jsonl", args.limit)]
    config = DrafterConfig.load(args.checkpoint)
    kv_tokens = args.max_running * (max(map(len, prompts)) + args.max_tokens + 2 * config.block_size + 16)
    runner = CapturingRunner(load_target(model_dir, tuple(config.target_layer_ids),
                                         kv_cache_tokens=kv_tokens, device=resolve_device(args.device),
                                         dtype="float32"))
    drafter = CapturingDrafter(load_method_drafter(args.checkpoint, runner.runner, apply_calibration=True))
    gamma = drafter.gamma
    results = {}
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        sampling = SamplingParams(temperature=temperature)
        config = EngineConfig(AdmissionConfig(policy=f"fixed:{gamma}"),
                              batching=BatchingConfig(max_running=args.max_running),
                              update_cost_table=False)
        engine = build_engine(TargetVerifier(runner), drafter,
                              CostTable.from_step_seconds({1: 1.0}), config)
        collector = OracleCollector(drafter, runner, runner.runner.vocab_size, sampling)
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(temperature=temperature, seed=args.seed + i),
                               args.max_tokens, stop_token_ids(tokenizer))
        start = time.perf_counter()
        for result in engine.steps():  # the captured forward and drafts are this step's
            if result.stats.drafted is not None:
                collector(result.stats.drafted)
        print(f"temperature {temperature:g}: {len(prompts)} prompts, {len(collector.rows)} at-risk "
              f"positions ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
        stats = summarise(np.array(collector.rows, dtype=np.float64), gamma)
        results[f"{temperature:g}"] = stats
        print(table(temperature, stats) + "\n")
    print(json.dumps({"bench": "acceptance_oracle", "checkpoint": str(args.checkpoint),
                      "datasets": args.datasets, "limit": args.limit, "max_tokens": args.max_tokens,
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
