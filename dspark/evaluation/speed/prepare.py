"""What `dspark bench` loads once: the prompts of each dataset, one engine per (row, concurrency)
on a shared target, the drafters, the transformers model, and which rows could not load."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dspark.evaluation.speed.rows import FULL_BLOCK, ROWS, RowKind
from dspark.methods import checkpoint_folder
from dspark.paths import require_folder

if TYPE_CHECKING:
    from dspark.engine import Engine

# Verification batch sizes measured for the cost table SPS(B) at start-up (up to 8 streams x 8).
PROFILE_SIZES = (1, 2, 4, 8, 16, 32, 64)


def log(message: str) -> None:
    print(f"[dspark bench] {message}", file=sys.stderr, flush=True)


@dataclass
class Setup:
    """Everything loaded once: engines per (row, concurrency), the transformers model, prompts."""

    prompts: dict[str, list[list[int]]]
    """dataset -> chat-templated prompt ids (as many as the largest concurrency needs)."""
    stops: list[int]
    pad_id: int
    engines: dict[tuple[str, int], Engine]
    hf_model: object | None
    status: dict[str, str]
    """row -> "ok" | "missing" | "error"."""
    notes: dict[str, str]
    """row -> why it is missing / what it runs."""


def prompts_needed(limit: int, concurrency: int) -> int:
    """Prompts a dataset contributes at this concurrency: whole waves of `concurrency` streams."""
    return concurrency * math.ceil(limit / concurrency)


def load_setup(args: argparse.Namespace, rows: list[str], concurrencies: list[int]) -> Setup:
    from transformers import AutoTokenizer

    from dspark.cost_table import CostTable
    from dspark.engine import AdmissionConfig, BatchingConfig, EngineConfig
    from dspark.evaluation.eval_cli import default_checkpoints, read_eval_prompts
    from dspark.loading import (build_engine, is_checkpoint, load_calibration,
                                load_method_drafter, load_target)
    from dspark.step_timing import startup_cost_table
    from dspark.stop_tokens import stop_token_ids
    from dspark.models.drafter_config import DrafterConfig
    from dspark.models.runner import RunnerConfig, TargetRunner
    from dspark.rejection import VerificationRule
    from dspark.training.data import encode_chat

    model_dir = args.model_dir
    if model_dir is None:
        from dspark.fetch import ensure_model
        model_dir = ensure_model()
    checkpoints = args.checkpoints if args.checkpoints is not None else default_checkpoints()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stops = stop_token_ids(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    count = max(prompts_needed(args.limit, c) for c in concurrencies)
    prompts = {}
    eval_dir = require_folder(args.eval_dir, "eval prompts")
    for name in args.datasets:
        texts = read_eval_prompts(eval_dir / f"{name}.jsonl", count)
        prompts[name] = [encode_chat(tokenizer, t) for t in texts]

    status, notes, folders = {}, {}, {}
    for name in rows:
        spec = ROWS[name]
        if spec.method is None:
            status[name] = "ok"
            continue
        folder = checkpoint_folder(checkpoints, spec.method)
        if is_checkpoint(folder):
            status[name], folders[name] = "ok", folder
        else:
            status[name], notes[name] = "missing", f"no checkpoint at {folder}"
            log(f"{name}: missing (no drafter checkpoint at {folder})")
    configs = {}
    for name, folder in list(folders.items()):
        try:
            configs[folder] = DrafterConfig.load(folder)
        except (ValueError, KeyError, TypeError) as e:
            status[name], notes[name] = "error", f"{folder}: {e}"
            log(f"{name}: cannot read {folder}/config.json: {e}")
            del folders[name]
    max_gamma = max([c.block_size for c in configs.values()] or [0])
    longest = max(len(p) for ps in prompts.values() for p in ps)
    kv_tokens = max(concurrencies) * (longest + args.max_tokens + 2 * max_gamma + 16) + 256

    engine_rows = [n for n in rows if ROWS[n].kind is RowKind.ENGINE and status[n] == "ok"]
    runners, drafters, engines = {}, {}, {}
    base = None
    if engine_rows:
        base = load_target(model_dir, (), kv_cache_tokens=kv_tokens, device=args.device,
                           dtype=args.dtype, weights=getattr(args, "weights", None))
        runners[()] = base
        if args.cost_table is not None:
            table = CostTable.load(args.cost_table)
        else:
            table = startup_cost_table(base, sizes=PROFILE_SIZES)
        log("cost table SPS(B): " + ", ".join(
            f"B={b}: {1000 * s:.0f} ms" for b, s in zip(table.batch_tokens, table.step_seconds)))
    for name in engine_rows:
        spec = ROWS[name]
        drafter = None
        policy = spec.policy
        if spec.method is not None:
            folder = folders[name]
            layer_ids = tuple(int(i) for i in configs[folder].target_layer_ids)
            try:
                if layer_ids not in runners:  # same weights, its own KV cache and hidden layers
                    runners[layer_ids] = TargetRunner(config=RunnerConfig(
                        device=args.device, dtype=args.dtype, hidden_layer_ids=layer_ids, kv_cache_tokens=kv_tokens),
                        model=base.model)
                drafter_weights = spec.drafter_weights or getattr(args, "drafter_weights", None)
                if spec.drafter_dtype is not None and spec.drafter_weights is None:
                    drafter_weights = "dense"  # a dtype names dense tensors
                key = (folder, spec.drafter_dtype, drafter_weights)
                if key not in drafters:
                    drafters[key] = load_method_drafter(
                        folder, runners[layer_ids], apply_calibration=True, weights=drafter_weights,
                        dtype=None if spec.drafter_dtype is None else getattr(torch, spec.drafter_dtype))
            except ValueError as e:
                status[name], notes[name] = "error", str(e)
                log(f"{name}: cannot load {folder}: {e}")
                continue
            drafter = drafters[key]
            if policy == FULL_BLOCK:
                policy = f"fixed:{drafter.gamma}"
            drafter_dtype = ("q8" if getattr(drafter, "lm_head_blocks", None) is not None
                             else str(drafter.fc.weight.dtype).removeprefix("torch."))
            notes[name] = f"{policy}, gamma {drafter.gamma}, {drafter_dtype} drafter"
            if spec.policy in ("async_topk", "sync_greedy"):  # the policies that read confidences
                calibrated = load_calibration(folder) is not None
                notes[name] += ", STS calibrated" if calibrated else ", no calibration.json"
            runner = runners[layer_ids]
        else:
            runner = base
            notes[name] = "policy none"
        rule = VerificationRule(spec.verification or args.verification)
        if rule is VerificationRule.BLOCK and spec.method is not None:
            notes[name] += ", block verification"
        objective = {} if spec.objective is None else {"objective": spec.objective}
        for c in concurrencies:
            engines[(name, c)] = build_engine(
                runner, drafter, CostTable.from_dict(table.to_dict()),
                EngineConfig(AdmissionConfig(policy=policy, **objective),
                             batching=BatchingConfig(max_running=c),
                             sparse_top_k=args.sparse_top_k), rule)

    hf_model = None
    if any(ROWS[n].kind is not RowKind.ENGINE for n in rows):
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, args.dtype)).to(args.device).eval()
        for n in rows:
            if ROWS[n].kind is RowKind.HF_PROMPT_LOOKUP:
                notes[n] = (f"prompt_lookup_num_tokens={args.prompt_lookup_tokens}; batch 1 only: "
                            f"concurrent streams run one after another")
            elif ROWS[n].kind is RowKind.HF_GENERATE:
                notes[n] = "batched, left padding"
    return Setup(prompts, list(stops), pad_id, engines, hf_model, status, notes)
