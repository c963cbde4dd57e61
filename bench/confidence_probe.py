"""Is the confidence head's AUC limited by its fit or by what it sees? Linear probes on real rounds.

The DSpark confidence head is one linear layer on `[norm(h_k); W1[x_{k-1}]]` (DeepSpec's format).
This script collects, on real rounds at one temperature (full block verified, as `dspark eval`):
the head's input features, its raw logit, the draft distribution's entropy and top probability
at position k (both known before x_k is drawn, so a scheduler may use them), the oracle
acceptance probability alpha_k = sum_v min(p^t_k, p^d_k), and whether position k survived.
Rounds on the held-out training prompts fit the probes; rounds on the eval sets score them:
- `head`: the shipped head as it is;
- `head refit on alpha`: the same linear layer refitted on the serving rounds with the training
  loss's soft label alpha_k (logistic, ridge, features standardised): the best this head's inputs
  allow under its own objective;
- `head + draft entropy`: a logistic model of [head logit, entropy, log top probability,
  position] fitted on the outcomes.
Prints a markdown table of AUC at k = 1..3 and one JSON line. Usage:
    .venv/bin/python bench/confidence_probe.py [--checkpoint checkpoints/dspark-markov]
        [--heldout-limit 91] [--eval-limit 10] [--temperature 1] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from acceptance_oracle import REPO, CapturingDrafter, CapturingRunner
from dspark.devices import add_device_argument, resolve_device
from dspark.calibration.metrics import roc_auc
from dspark.cost_table import CostTable
from dspark.engine import AdmissionConfig, BatchingConfig, EngineConfig
from dspark.loading import build_engine
from dspark.step_result import RoundRecord
from dspark.paths import EVAL_PROMPTS_DIR
from dspark.sampling import SamplingParams, SamplingTensors, probs_from_logits
from dspark.verifier import TargetVerifier


class HeadInputs:
    """Forward hook on the confidence head: its inputs during the latest draft call."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []

    def __call__(self, module, inputs, output) -> None:
        x = inputs[0].detach().float()
        self.calls.append(x.reshape(x.shape[0], -1, x.shape[-1]))  # [R, positions, D]

    def block(self) -> torch.Tensor:
        return torch.cat(self.calls, dim=1)  # [R, P, D]


def collect(engine_parts, prompts, temperature: float, max_tokens: int, stops) -> dict[str, np.ndarray]:
    """At-risk positions of every round: k, raw logit, entropy, log top prob, alpha, survived, x."""
    runner, drafter, hook = engine_parts
    sampling = SamplingParams(temperature=temperature)
    rows = {"k": [], "logit": [], "entropy": [], "log_top": [], "alpha": [], "y": [], "x": []}

    def observe(record: RoundRecord) -> None:
        feats = hook.block()  # [R, P, D]
        logits = runner.logits
        target = probs_from_logits(logits, SamplingTensors.from_params([sampling] * logits.shape[0]))
        start = 0
        for i, (block, n, accepted) in enumerate(zip(drafter.blocks, record.num_admitted,
                                                     record.num_accepted)):
            draft = block.dense(runner.runner.vocab_size)[:n]  # [n, V]
            alpha = torch.minimum(target[start:start + n], draft).sum(dim=1)  # [n]
            entropy = -(draft * draft.clamp_min(1e-30).log()).sum(dim=1)  # [n]
            top = draft.max(dim=1).values  # [n]
            c = record.confidences[i].double().clamp(1e-6, 1 - 1e-6)
            for k in range(min(n, accepted + 1)):  # at risk: every earlier draft accepted
                rows["k"].append(k + 1)
                rows["logit"].append(float(torch.logit(c[k])))
                rows["entropy"].append(float(entropy[k]))
                rows["log_top"].append(float(top[k].log()))
                rows["alpha"].append(float(alpha[k]))
                rows["y"].append(int(k < accepted))
                rows["x"].append(feats[i, k].numpy())
            start += n + 1

    config = EngineConfig(AdmissionConfig(policy=f"fixed:{drafter.gamma}"),
                          batching=BatchingConfig(max_running=8), update_cost_table=False)
    engine = build_engine(TargetVerifier(runner), drafter, CostTable.from_step_seconds({1: 1.0}),
                          config)
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=temperature, seed=i), max_tokens, stops)
    for result in engine.steps():  # the runner's logits and the hook's block are this step's
        if result.stats.drafted is not None:
            observe(result.stats.drafted)
    return {name: np.array(v) for name, v in rows.items()}


def fit_logistic(x: np.ndarray, target: np.ndarray, ridge: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Logistic regression with soft or hard targets on standardised x: (mean, std, weights+bias)."""
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-6
    xs = torch.tensor((x - mean) / std, dtype=torch.float64)  # [n, D]
    t = torch.tensor(target, dtype=torch.float64)  # [n]
    w = torch.zeros(xs.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=300, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = (torch.nn.functional.binary_cross_entropy_with_logits(xs @ w[:-1] + w[-1], t)
                + ridge * (w[:-1] ** 2).sum())
        loss.backward()
        return loss

    opt.step(closure)
    return mean, std, w.detach().numpy()


def predict(model, x: np.ndarray) -> np.ndarray:
    mean, std, w = model
    return ((x - mean) / std) @ w[:-1] + w[-1]


def scalar_features(d: dict[str, np.ndarray]) -> np.ndarray:
    position = np.eye(8)[np.minimum(d["k"], 8) - 1]  # [n, 8] one-hot position
    return np.c_[d["logit"], d["entropy"], d["log_top"], position]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    parser.add_argument("--checkpoint", type=Path, default=REPO / "checkpoints" / "dspark-markov")
    parser.add_argument("--model-dir", default=None, help="the target's folder (default: dspark fetch-model's)")
    parser.add_argument("--data", type=Path, default=REPO / "data" / "smollm2_answers.jsonl.gz")
    parser.add_argument("--eval-dir", type=Path, default=EVAL_PROMPTS_DIR)
    parser.add_argument("--datasets", default="gsm8k,math500,humaneval,mt-bench")
    parser.add_argument("--heldout-limit", type=int, default=None, help="held-out prompts (all)")
    parser.add_argument("--eval-limit", type=int, default=10, help="prompts per eval set")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--ridge", type=float, default=1e-2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from dspark.evaluation.calibrate_cli import heldout_prompts
    from dspark.evaluation.eval_cli import read_eval_prompts, stop_token_ids
    from dspark.loading import load_method_drafter, load_target
    from dspark.fetch import ensure_model
    from dspark.models.drafter_config import DrafterConfig
    from dspark.training.data import encode_chat

    model_dir = args.model_dir or ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stops = stop_token_ids(tokenizer)
    sets = {"heldout": heldout_prompts(args.data, args.heldout_limit),
            "eval": [encode_chat(tokenizer, text) for name in args.datasets.split(",")
                     for text in read_eval_prompts(args.eval_dir / f"{name}.jsonl", args.eval_limit)]}
    config = DrafterConfig.load(args.checkpoint)
    longest = max(len(p) for prompts in sets.values() for p in prompts)
    runner = CapturingRunner(load_target(model_dir, tuple(config.target_layer_ids),
                                         kv_cache_tokens=8 * (longest + args.max_tokens + 32),
                                         device=resolve_device(args.device), dtype="float32"))
    inner = load_method_drafter(args.checkpoint, runner.runner)  # raw head: a probe refits its map
    if getattr(inner, "confidence_head", None) is None:
        print(f"confidence_probe: {args.checkpoint} has no confidence head", file=sys.stderr)
        return 2
    hook = HeadInputs()
    inner.confidence_head.register_forward_hook(hook)
    drafter = CapturingDrafter(inner)
    draft = drafter.draft

    def draft_fresh(requests, **kwargs):
        hook.calls.clear()
        return draft(requests, **kwargs)

    drafter.draft = draft_fresh
    data = {}
    for name, prompts in sets.items():
        start = time.perf_counter()
        data[name] = collect((runner, drafter, hook), prompts, args.temperature, args.max_tokens, stops)
        print(f"{name}: {len(prompts)} prompts, {len(data[name]['y'])} at-risk positions "
              f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)

    fit, test = data["heldout"], data["eval"]
    scores = {
        "head": test["logit"],
        "head refit on alpha": predict(fit_logistic(fit["x"], fit["alpha"], args.ridge), test["x"]),
        "head + draft entropy": predict(fit_logistic(scalar_features(fit), fit["y"], args.ridge),
                                        scalar_features(test)),
        "oracle alpha (ceiling)": test["alpha"],
    }
    positions = (1, 2, 3)
    # a position no eval round reached has no AUC (NaN, as roc_auc gives for a missing class)
    results = {name: [roc_auc(s[test["k"] == k], test["y"][test["k"] == k])
                      if (test["k"] == k).any() else float("nan") for k in positions]
               for name, s in scores.items()}
    print(f"**AUC on the eval sets at temperature {args.temperature:g} (probes fitted on "
          f"{len(fit['y'])} held-out at-risk positions)**\n")
    print("| predictor | " + " | ".join(f"k={k}" for k in positions) + " |")
    print("|---|" + "---:|" * len(positions))
    for name, aucs in results.items():
        print(f"| {name} | " + " | ".join(f"{a:.3f}" for a in aucs) + " |")
    print(json.dumps({"bench": "confidence_probe", "temperature": args.temperature,
                      "heldout_positions": int(len(fit["y"])), "eval_positions": int(len(test["y"])),
                      "auc": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
