"""`dspark bench` (and `bench/e2e.py`, the same flags): the end-to-end speed benchmark, output
tokens/s of whole generations (docs/design.md sections 9-10).

Rows (`--methods`, in this order):
- `target`: our engine with policy `none` (no drafter): the baseline every ratio is taken against;
- `mtp1`: MTP-1-like, the DSpark drafter (`checkpoints/dspark-markov`) with `fixed:1`;
- `dflash`: the DFlash drafter (`checkpoints/dflash`) verifying its full block, `fixed:gamma`;
- `dspark`: DSpark (`checkpoints/dspark-markov`, STS calibration applied) with `async_topk`;
- `dspark-paper`: the same with the paper's objective Theta = tau * SPS(B), which takes drafting
  as free (`ThetaObjective.PAPER`); `dspark` charges a round that verifies drafts for drafting
  them too (`SHARED_DEVICE`, the engine's default), as drafter and target share this CPU;
- `dspark-full`: the same drafter verifying its full block every round (`fixed:gamma`): what
  `async_topk`'s choice of how many drafts to verify is measured against;
- `dspark-fixed2`, `dspark-fixed3`: the same drafter verifying its first 2 or 3 drafts every round
  (`fixed:N`; `mtp1` is N = 1): the fixed lengths between one draft and the full block;
- `dspark-block`: `dspark` with sampled requests verified by the block rule
  (`--verification block` for this row alone, `dspark.block_verification`), so that the two
  rules take turns wave by wave in one run;
- `dspark-sync`: the same drafter with `sync_greedy` (the paper's Algorithm 1: drafts every
  round, then admits by Theta with SPS(B));
- `hf-generate`: transformers `generate` on the same weights in this process;
- `hf-prompt-lookup`: transformers prompt-lookup decoding (`prompt_lookup_num_tokens`).
A row whose drafter checkpoint is missing is reported as missing.

Workload: the first turn of the first prompts of each eval file (gsm8k, humaneval, mt-bench) under
the chat template; greedy and temperature 1.0 (each request its own seed); generation stops at EOS
/ end of turn or `--max-tokens`. Concurrency C: the prompts of a dataset run in waves of C streams
submitted together (C = 1: requests one after another). Each dataset contributes C * ceil(limit / C)
prompts at concurrency C, so every wave is full. transformers peers run a wave as one batched
`generate` with left padding; prompt lookup supports batch 1 only, so its C streams run one after
another (said in the table).

Speed = output tokens (stop token included) / wall seconds of the waves, prefill included;
the macro average is the mean over datasets of each dataset's tokens/s. The rows take turns wave by
wave, so a load change on the shared machine hits every row alike, and every ratio is against the
target-only row of the same (temperature, concurrency) run (docs/design.md 9: compare as ratios).

Time breakdown of the engine rows (sums over the timed waves of the steps' `RoundStats.seconds`):
- prefill: target forward over the prompts and the first token (a prompt chunk that rides in a
  verification forward counts its tokens' share of it);
- drafter context: the drafter absorbing committed tokens' target features (`append_context`;
  features the verifier held are handed over just before drafting and count as draft);
- draft: drafting the blocks; admission: the policy's decision;
- target forward: the flattened verification forward;
- sampling + commit: the rest of the verifier's call: rejection sampling, KV cache truncation,
  feature slicing;
- rest: wall time minus all of the above = the round loop's Python overhead.

stdout: a markdown table per (temperature, concurrency), the breakdowns, and one final JSON line.
Progress goes to stderr. Usage:
    .venv/bin/python bench/e2e.py [--limit 4] [--max-tokens 128] [--temperatures 0,1.0]
        [--concurrency 1,8] [--methods target,mtp1,dflash,dspark,hf-generate,hf-prompt-lookup]
"""

from __future__ import annotations

import argparse
import enum
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from dspark.cost_table import ThetaObjective
from dspark.cpu_info import cpu_line
from dspark.devices import add_device_argument, resolve_device
from dspark.methods import checkpoint_folder, parse_names
from dspark.paths import EVAL_PROMPTS_DIR, require_folder

if TYPE_CHECKING:
    from dspark.engine import Engine
    from dspark.step_result import StageSeconds

DEFAULT_DATASETS = ("gsm8k", "humaneval", "mt-bench")
# Speed goals: DSpark over target-only, greedy, macro-average, by number of concurrent streams.
GOALS = {1: 2.0, 8: 1.5}
# Verification batch sizes measured for the cost table SPS(B) at start-up (up to 8 streams x 8).
PROFILE_SIZES = (1, 2, 4, 8, 16, 32, 64)


def _log(message: str) -> None:
    print(f"[dspark bench] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------- rows
class RowKind(enum.Enum):
    ENGINE = "engine"
    """Our embedded engine (target runner + optional drafter + admission policy)."""
    HF_GENERATE = "hf_generate"
    """transformers `generate`, batched with left padding."""
    HF_PROMPT_LOOKUP = "hf_prompt_lookup"
    """transformers prompt-lookup decoding, batch 1."""


FULL_BLOCK = "fixed:gamma"
"""Policy placeholder resolved to `fixed:<the drafter's gamma>` once the drafter is loaded."""


@dataclass(frozen=True)
class RowSpec:
    """One row of the tables."""

    name: str
    """Key in `--methods` and in the JSON."""
    label: str
    kind: RowKind
    method: str | None = None
    """`dspark.methods.METHODS` key naming the drafter's checkpoint folder."""
    policy: str = "none"
    """Admission policy of engine rows."""
    objective: ThetaObjective | None = None
    """What engine rows' admission maximises (AdmissionConfig.objective; None: its default, the
    one served; only async_topk and sync_greedy read it)."""
    drafter_dtype: str | None = None
    """The drafter's dtype; None: `dspark.loading.drafter_dtype`'s choice, as served."""
    verification: str | None = None
    """How engine rows verify sampled drafts (`VerificationRule`); None: `--verification`."""


ROWS: dict[str, RowSpec] = {r.name: r for r in (
    RowSpec("target", "target only (our engine)", RowKind.ENGINE),
    RowSpec("mtp1", "MTP-1-like (fixed:1)", RowKind.ENGINE, "mtp1", "fixed:1"),
    RowSpec("dflash", "DFlash (full block)", RowKind.ENGINE, "dflash", FULL_BLOCK),
    RowSpec("dspark", "DSpark (async_topk)", RowKind.ENGINE, "dspark", "async_topk"),
    RowSpec("dspark-paper", "DSpark (async_topk, drafting taken as free)", RowKind.ENGINE, "dspark",
            "async_topk", ThetaObjective.PAPER),
    RowSpec("dspark-fp32-drafter", "DSpark (async_topk, float32 drafter)", RowKind.ENGINE,
            "dspark", "async_topk", drafter_dtype="float32"),
    RowSpec("dspark-block", "DSpark (async_topk, block verification)", RowKind.ENGINE, "dspark",
            "async_topk", verification="block"),
    RowSpec("dspark-sync", "DSpark (sync_greedy)", RowKind.ENGINE, "dspark", "sync_greedy"),
    RowSpec("dspark-full", "DSpark (full block)", RowKind.ENGINE, "dspark", FULL_BLOCK),
    *(RowSpec(f"dspark-fixed{n}", f"DSpark (fixed:{n})", RowKind.ENGINE, "dspark", f"fixed:{n}")
      for n in (2, 3)),
    RowSpec("hf-generate", "transformers generate", RowKind.HF_GENERATE),
    RowSpec("hf-prompt-lookup", "transformers prompt lookup", RowKind.HF_PROMPT_LOOKUP),
)}
ROW_ALIASES = {"none": "target", "target-only": "target", "mtp-1": "mtp1", "hf": "hf-generate",
               "sync_greedy": "dspark-sync", "dspark-sync-greedy": "dspark-sync",
               "pld": "hf-prompt-lookup", "prompt-lookup": "hf-prompt-lookup"}


def parse_rows(text: str) -> list[str]:
    """Comma-separated row names (aliases allowed) -> canonical names in table order."""
    chosen = parse_names(text, ROWS, ROW_ALIASES)
    return [name for name in ROWS if name in chosen]


def _parse_list(text: str, kind: type, what: str) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what}: cannot parse {text!r}") from None
    if not values:
        raise ValueError(f"{what}: empty")
    return list(dict.fromkeys(values))


# ------------------------------------------------------------------------------ measurement
BREAKDOWN_KEYS = ("prefill", "drafter_context", "draft", "admission", "target_forward",
                  "sampling_commit")
BREAKDOWN_LABELS = {"prefill": "prefill", "drafter_context": "drafter context", "draft": "draft",
                    "admission": "admission", "target_forward": "target forward",
                    "sampling_commit": "sampling + commit", "rest": "rest (Python)"}


@dataclass
class Tally:
    """What one row did on one dataset at one (temperature, concurrency)."""

    tokens: int = 0
    seconds: float = 0.0
    streams: int = 0
    rounds: int = 0
    """Verification rounds summed over requests (engine rows)."""
    drafts_accepted: int = 0
    breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds per BREAKDOWN_KEYS (engine rows), summed over waves."""
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    def add_breakdown(self, seconds: dict[str, float]) -> None:
        for k, v in seconds.items():
            self.breakdown[k] = self.breakdown.get(k, 0.0) + v


def truncate_at_stop(tokens: Sequence[int], stops: Sequence[int], max_tokens: int) -> list[int]:
    """Generated tokens up to and including the first stop token, at most max_tokens."""
    out = []
    for t in list(tokens)[:max_tokens]:
        out.append(int(t))
        if t in stops:
            break
    return out


def run_engine_wave(engine: Engine, prompts: Sequence[Sequence[int]], temperature: float,
                    max_tokens: int, stops: Sequence[int], seed: int, tally: Tally | None) -> None:
    """All prompts submitted at once, run to completion; adds to `tally` (None: warm-up)."""
    from dspark.sampling import SamplingParams
    from dspark.step_result import StageSeconds

    assert not engine.has_unfinished()
    seconds_by_stage = StageSeconds()
    start = time.perf_counter()
    requests = [engine.request(engine.add_request(
        p, SamplingParams(temperature=temperature, seed=seed + i), max_tokens, stops))
        for i, p in enumerate(prompts)]
    for result in engine.steps():
        seconds_by_stage.add(result.stats.seconds)
    seconds = time.perf_counter() - start
    if tally is None:
        return
    tally.seconds += seconds
    tally.streams += len(requests)
    tally.add_breakdown(breakdown(seconds_by_stage))
    for r in requests:
        tally.tokens += len(r.output_ids)
        tally.rounds += r.metrics.rounds
        tally.drafts_accepted += r.metrics.drafts_accepted
        tally.outputs.append(list(r.output_ids))


def breakdown(seconds: StageSeconds) -> dict[str, float]:
    """The engine's stage seconds under BREAKDOWN_KEYS."""
    return {"prefill": seconds.prefill, "drafter_context": seconds.drafter_context,
            "draft": seconds.draft, "admission": seconds.admission,
            "target_forward": seconds.verify, "sampling_commit": seconds.verify_call}


def hf_generation_config(temperature: float, max_tokens: int, stops: Sequence[int], pad_id: int,
                         lookup_tokens: int | None, max_ngram: int):
    from transformers import GenerationConfig

    kwargs = dict(max_new_tokens=max_tokens, eos_token_id=list(stops), pad_token_id=pad_id)
    if temperature > 0:  # the full distribution: no top-k / top-p truncation, like our rows
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False)
    if lookup_tokens is not None:
        kwargs.update(prompt_lookup_num_tokens=lookup_tokens, max_matching_ngram_size=max_ngram)
    return GenerationConfig(**kwargs)


def hf_generate(model, prompts: Sequence[Sequence[int]], config, pad_id: int) -> list[list[int]]:
    """One batched transformers `generate` (left padding); the generated ids of each prompt."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids.to(model.device),
                             attention_mask=attention_mask.to(model.device),
                             generation_config=config)
    return out[:, width:].tolist()  # [num_prompts, generated]


def run_hf_wave(model, kind: RowKind, prompts: Sequence[Sequence[int]], temperature: float,
                max_tokens: int, stops: Sequence[int], pad_id: int, seed: int, lookup_tokens: int,
                max_ngram: int, tally: Tally | None) -> None:
    config = hf_generation_config(temperature, max_tokens, stops, pad_id,
                                  lookup_tokens if kind is RowKind.HF_PROMPT_LOOKUP else None,
                                  max_ngram)
    start = time.perf_counter()
    torch.manual_seed(seed)
    if kind is RowKind.HF_PROMPT_LOOKUP:  # transformers: assisted decoding is batch-1 only
        outputs = [hf_generate(model, [p], config, pad_id)[0] for p in prompts]
    else:
        outputs = hf_generate(model, prompts, config, pad_id)
    seconds = time.perf_counter() - start
    if tally is None:
        return
    outputs = [truncate_at_stop(o, stops, max_tokens) for o in outputs]
    tally.seconds += seconds
    tally.streams += len(prompts)
    tally.tokens += sum(map(len, outputs))
    tally.outputs += outputs


# ------------------------------------------------------------------------------------ setup
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
            _log(f"{name}: missing (no drafter checkpoint at {folder})")
    configs = {}
    for name, folder in list(folders.items()):
        try:
            configs[folder] = DrafterConfig.load(folder)
        except (ValueError, KeyError, TypeError) as e:
            status[name], notes[name] = "error", f"{folder}: {e}"
            _log(f"{name}: cannot read {folder}/config.json: {e}")
            del folders[name]
    max_gamma = max([c.block_size for c in configs.values()] or [0])
    longest = max(len(p) for ps in prompts.values() for p in ps)
    kv_tokens = max(concurrencies) * (longest + args.max_tokens + 2 * max_gamma + 16) + 256

    engine_rows = [n for n in rows if ROWS[n].kind is RowKind.ENGINE and status[n] == "ok"]
    runners, drafters, engines = {}, {}, {}
    base = None
    if engine_rows:
        base = load_target(model_dir, (), kv_cache_tokens=kv_tokens, device=args.device,
                           dtype=args.dtype)
        runners[()] = base
        if args.cost_table is not None:
            table = CostTable.load(args.cost_table)
        else:
            table = startup_cost_table(base, sizes=PROFILE_SIZES)
        _log("cost table SPS(B): " + ", ".join(
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
                key = (folder, spec.drafter_dtype)
                if key not in drafters:
                    drafters[key] = load_method_drafter(
                        folder, runners[layer_ids], apply_calibration=True,
                        dtype=None if spec.drafter_dtype is None else getattr(torch, spec.drafter_dtype))
            except ValueError as e:
                status[name], notes[name] = "error", str(e)
                _log(f"{name}: cannot load {folder}: {e}")
                continue
            drafter = drafters[key]
            if policy == FULL_BLOCK:
                policy = f"fixed:{drafter.gamma}"
            drafter_dtype = str(drafter.fc.weight.dtype).removeprefix("torch.")
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


# ------------------------------------------------------------------------------------- run
def run_wave(setup: Setup, name: str, concurrency: int, prompts, temperature: float,
             max_tokens: int, args: argparse.Namespace, seed: int, tally: Tally | None) -> None:
    spec = ROWS[name]
    if spec.kind is RowKind.ENGINE:
        run_engine_wave(setup.engines[(name, concurrency)], prompts, temperature, max_tokens,
                        setup.stops, seed, tally)
    else:
        run_hf_wave(setup.hf_model, spec.kind, prompts, temperature, max_tokens, setup.stops,
                    setup.pad_id, seed, args.prompt_lookup_tokens, args.max_ngram, tally)


def measure(setup: Setup, rows: list[str], temperature: float, concurrency: int,
            args: argparse.Namespace) -> dict[str, dict[str, Tally]]:
    """row -> dataset -> Tally; the rows take turns wave by wave."""
    active = [n for n in rows if setup.status[n] == "ok"]
    tallies = {n: {d: Tally() for d in setup.prompts} for n in active}
    for d, all_prompts in setup.prompts.items():
        prompts = all_prompts[:prompts_needed(args.limit, concurrency)]
        for w in range(0, len(prompts), concurrency):
            wave = prompts[w:w + concurrency]
            for n in active:
                run_wave(setup, n, concurrency, wave, temperature, args.max_tokens, args,
                         args.seed + w, tallies[n][d])
        _log(f"T={temperature:g} C={concurrency} {d}: " + ", ".join(
            f"{n} {tallies[n][d].tokens_per_s:.1f} tok/s" for n in active))
    return tallies


def summarize(setup: Setup, rows: list[str], tallies: dict[str, dict[str, Tally]],
              temperature: float) -> dict[str, dict]:
    """The JSON of one (temperature, concurrency) table: per row, tokens/s per dataset, macro
    average, ratio to the target-only row, tau, time breakdown, greedy agreement with target."""
    out = {}
    base = tallies.get("target")
    base_macro = (sum(t.tokens_per_s for t in base.values()) / len(base)) if base else None
    for n in rows:
        if setup.status[n] != "ok":
            out[n] = {"status": setup.status[n], "note": setup.notes.get(n, "")}
            continue
        per = tallies[n]
        macro = sum(t.tokens_per_s for t in per.values()) / len(per)
        r = {"status": "ok", "note": setup.notes.get(n, ""),
             "datasets": {d: {"tokens": t.tokens, "seconds": round(t.seconds, 6),
                              "streams": t.streams, "tokens_per_s": round(t.tokens_per_s, 3),
                              "ratio_vs_target": (round(t.tokens_per_s / base[d].tokens_per_s, 4)
                                                  if base else None)}
                          for d, t in per.items()},
             "macro_tokens_per_s": round(macro, 3),
             "ratio_vs_target": round(macro / base_macro, 4) if base_macro else None,
             "tokens": sum(t.tokens for t in per.values()),
             "seconds": round(sum(t.seconds for t in per.values()), 6),
             "streams": sum(t.streams for t in per.values())}
        if ROWS[n].kind is RowKind.ENGINE:
            rounds = sum(t.rounds for t in per.values())
            accepted = sum(t.drafts_accepted for t in per.values())
            r["tau"] = round((accepted + rounds) / rounds, 4) if rounds else None
            breakdown = {k: sum(t.breakdown.get(k, 0.0) for t in per.values())
                         for k in BREAKDOWN_KEYS}
            breakdown["rest"] = r["seconds"] - sum(breakdown.values())
            r["breakdown_seconds"] = {k: round(v, 6) for k, v in breakdown.items()}
        if temperature == 0 and base:
            pairs = [(a, b) for d in per for a, b in zip(per[d].outputs, base[d].outputs)]
            r["greedy_same_as_target"] = (round(sum(a == b for a, b in pairs) / len(pairs), 4)
                                          if pairs else None)
        out[n] = r
    return out


def _num(x: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}f}{suffix}"


def format_table(summary: dict[str, dict], datasets: list[str], temperature: float,
                 concurrency: int, num_prompts: int, max_tokens: int) -> str:
    mode = "greedy" if temperature == 0 else f"temperature {temperature:g}"
    streams = ("1 stream (requests one after another)" if concurrency == 1
               else f"{concurrency} concurrent streams")
    lines = [f"**{mode}, {streams}: {num_prompts} prompt{'s' if num_prompts > 1 else ''} per "
             f"dataset, max {max_tokens} tokens; "
             f"output tokens/s**", "",
             "| Row | " + " | ".join(datasets)
             + " | macro | vs target | tau | same as target | note |",
             "|---|" + "---:|" * (len(datasets) + 4) + "---|"]
    for n, r in summary.items():
        label = ROWS[n].label
        if r["status"] != "ok":
            lines.append(f"| {label} | {r['status']} |" + " |" * (len(datasets) + 3)
                         + f" {r['note']} |")
            continue
        same = r.get("greedy_same_as_target")
        same = None if same is None else 100 * same
        lines.append(f"| {label} | " + " | ".join(_num(r["datasets"][d]["tokens_per_s"])
                                                  for d in datasets)
                     + f" | {_num(r['macro_tokens_per_s'])} | {_num(r['ratio_vs_target'], 2, 'x')}"
                     f" | {_num(r.get('tau'), 2)} | {_num(same, 0, '%')}"
                     f" | {r['note']} |")
    return "\n".join(lines)


def format_breakdown(summary: dict[str, dict], temperature: float, concurrency: int) -> str | None:
    rows = {n: r for n, r in summary.items() if "breakdown_seconds" in r}
    if not rows:
        return None
    keys = list(BREAKDOWN_KEYS) + ["rest"]
    mode = "greedy" if temperature == 0 else f"temperature {temperature:g}"
    streams = f"{concurrency} stream{'s' if concurrency > 1 else ''}"
    lines = [f"**Where the time goes ({mode}, {streams}): seconds (share of wall time)**", "",
             "| Row | wall s | " + " | ".join(BREAKDOWN_LABELS[k] for k in keys) + " |",
             "|---|---:|" + "---:|" * len(keys)]
    for n, r in rows.items():
        wall = r["seconds"]
        cells = [f"{r['breakdown_seconds'][k]:.2f} ({100 * r['breakdown_seconds'][k] / wall:.0f}%)"
                 if wall > 0 else "-" for k in keys]
        lines.append(f"| {ROWS[n].label} | {wall:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goals(tables: list[dict]) -> dict:
    """The speed goals (GOALS), where this run measured them (greedy, macro-average)."""
    out = {}
    for t in tables:
        rows = t["rows"]
        d = rows.get("dspark", {})
        if t["temperature"] != 0 or d.get("status") != "ok" or d.get("ratio_vs_target") is None:
            continue
        others = [r["macro_tokens_per_s"] for n, r in rows.items()
                  if n != "dspark" and r.get("status") == "ok"]
        goal = GOALS.get(t["concurrency"])
        out[f"greedy_c{t['concurrency']}"] = {
            "dspark_ratio": d["ratio_vs_target"], "goal": goal,
            "met": None if goal is None else d["ratio_vs_target"] >= goal,
            "ahead_of_every_row": all(d["macro_tokens_per_s"] > x for x in others)}
    return out


# ------------------------------------------------------------------------------------- CLI
def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoints", type=Path, default=None,
                        help="folder with dspark-markov/ and dflash/ (default: ./checkpoints, "
                             "else the repository's)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="target model folder (default: the prepared SmolLM2)")
    parser.add_argument("--eval-dir", type=Path, default=EVAL_PROMPTS_DIR,
                        help="folder of the eval prompt files (<dataset>.jsonl)")
    parser.add_argument("--datasets", default=",".join(DEFAULT_DATASETS),
                        help="comma-separated eval file names without .jsonl")
    parser.add_argument("--limit", type=int, default=4,
                        help="prompts per dataset (rounded up to whole waves of each concurrency)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--temperatures", default="0,1.0", help="comma-separated; 0 = greedy")
    parser.add_argument("--concurrency", default="1,8", help="comma-separated stream counts")
    parser.add_argument("--methods", default=",".join(ROWS),
                        help=f"rows to run, from {','.join(ROWS)}")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_device_argument(parser)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="of the target and the transformers peers (the drafter: dspark.loading.drafter_dtype)")
    parser.add_argument("--sparse-top-k", type=int, default=None,
                        help="engine: ship draft distributions as top-k (default dense)")
    parser.add_argument("--verification", default="token",
                        choices=["token", "block", "drafter-invariant"],
                        help="engine: how sampled drafts are accepted (dspark.rejection)")
    parser.add_argument("--cost-table", type=Path, default=None,
                        help="SPS(B) table JSON (default: measured at start-up)")
    parser.add_argument("--prompt-lookup-tokens", type=int, default=10,
                        help="transformers prompt_lookup_num_tokens")
    parser.add_argument("--max-ngram", type=int, default=2,
                        help="transformers max_matching_ngram_size for prompt lookup")
    parser.add_argument("--warmup-tokens", type=int, default=8,
                        help="each row first generates one wave of this many tokens, untimed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON here")


def run(args: argparse.Namespace) -> int:
    try:
        rows = parse_rows(args.methods)
        temperatures = _parse_list(args.temperatures, float, "--temperatures")
        concurrencies = _parse_list(args.concurrency, int, "--concurrency")
        args.datasets = _parse_list(args.datasets, str.strip, "--datasets")
        if any(t < 0 or not math.isfinite(t) for t in temperatures):
            raise ValueError("--temperatures must be finite and >= 0")
        if any(c < 1 for c in concurrencies):
            raise ValueError("--concurrency must be >= 1")
        if args.limit < 1 or args.max_tokens < 1:
            raise ValueError("--limit and --max-tokens must be >= 1")
        args.device = resolve_device(args.device)
    except ValueError as e:
        print(f"dspark bench: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    setup = load_setup(args, rows, concurrencies)
    active = [n for n in rows if setup.status[n] == "ok"]
    first = next(iter(setup.prompts.values()))
    for c in concurrencies:  # untimed: first calls allocate and pick kernels
        for n in active:
            run_wave(setup, n, c, first[:c], 0.0, min(args.warmup_tokens, args.max_tokens), args,
                     args.seed, None)

    print(f"CPU: {cpu_line()}; torch threads: {torch.get_num_threads()}, dtype: {args.dtype}, "
          f"device: {args.device}")
    tables = []
    for temperature in temperatures:
        for c in concurrencies:
            tallies = measure(setup, rows, temperature, c, args)
            summary = summarize(setup, rows, tallies, temperature)
            tables.append({"temperature": temperature, "concurrency": c,
                           "prompts_per_dataset": prompts_needed(args.limit, c), "rows": summary})
            print()
            print(format_table(summary, args.datasets, temperature, c,
                               prompts_needed(args.limit, c), args.max_tokens))
            breakdown = format_breakdown(summary, temperature, c)
            if breakdown:
                print()
                print(breakdown)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if not k.startswith("_")}
    payload = {"bench": "e2e", "threads": torch.get_num_threads(), "tables": tables,
               "goals": goals(tables), "config": config}
    line = json.dumps(payload, allow_nan=False, default=str)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(line + "\n")
    print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    configure(parser)
    return run(parser.parse_args(argv))
