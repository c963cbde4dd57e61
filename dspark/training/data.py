"""`dspark data generate`: the target answers the training prompts itself (docs/design.md section 4).

The drafter must learn the target's behaviour, so its training answers are the target's own,
sampled with the chat template at temperature 0.7, top-p 0.8, top-k 20 through our target runner,
many prompts at once in one flattened batch (continuous batching: a finished answer's slot is
refilled at the next step).

Prompts come from the shared `data/train/` (`dspark.paths.TRAIN_PROMPTS_DIR`: math, code, chat),
mixed per source with caps so the short one-liner sources (nl2bash, nq_open) do not dominate; math
prompts get the eval sets' "reason step by step" suffix and code prompts the HumanEval prefix, so
answers come in the style the eval prompts ask for. The evaluation prompts are never used here.

On a GPU our runner's per-request attention loop is launch-bound, so `--engine transformers`
answers with transformers' batched `generate` instead (left-padded batches of similar prompt
length, the same temperature / top-k / top-p applied in the same order): the same distribution,
many times the throughput there. `--time-budget-s` stops starting new batches after that long.

Output: one JSON object per answered prompt, appended to a `.jsonl` as soon as it finishes, so an
interrupted run resumes where it stopped (prompts already in the file are skipped):
`{"id", "source", "split", "prompt_ids", "answer_ids", "finished", "temperature", "dtype"}`, where
`split` is `train` or `heldout` (a deterministic hash of the id; the held-out split calibrates the
confidence head), `temperature` is the sampling temperature the answer was drawn at (0: greedy)
and `dtype` the target's weights' dtype (records written before it existed were float32).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from dspark.devices import add_device_argument, resolve_device
from dspark.paths import TRAIN_PROMPTS_DIR, require_folder
from dspark.sampling import SamplingParams, SamplingTensors, probs_from_logits, sample_from_probs

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CODE_PREFIX = "Write a solution to the following problem and make sure that it passes the tests:\n"

# Share of prompts per source. nl2bash and nq_open are mostly one-line answers: capped low.
SOURCE_WEIGHTS: dict[str, float] = {
    "gsm8k": 0.20, "math": 0.15,
    "gpteacher_codegen": 0.12, "mbpp": 0.05, "exercism": 0.02, "conala": 0.06, "nl2bash": 0.04,
    "gpteacher_roleplay": 0.12, "awesome_chatgpt_prompts": 0.08, "self_instruct_seed": 0.04,
    "nq_open": 0.12,
}


ENGINES = ("runner", "transformers")


@dataclass(frozen=True)
class DataGenConfig:
    """What `dspark data generate` produces."""

    model_dir: Path
    """The target (Hugging Face format folder)."""
    train_dir: Path
    """Folder of training prompt files (`<domain>_<source>.jsonl`)."""
    out: Path
    """Output `.jsonl` (or `.jsonl.gz`); appended to, so a run resumes."""
    num_prompts: int = 1000
    max_new_tokens: int = 256
    batch_size: int = 64
    """Concurrent answers in flight (one flattened batch). 64 answers 1.34x the tokens/s of 16 on a
    2-core AVX2 EPYC (float32, 128 new tokens: 133.6 against 99.8), as a step's weight reads are
    shared by more rows."""
    sampling: SamplingParams = field(
        default_factory=lambda: SamplingParams(temperature=0.7, top_p=0.8, top_k=20))
    heldout_fraction: float = 0.1
    seed: int = 0
    dtype: str = "float32"
    engine: str = "runner"
    """"runner" (our target runner, continuous batching) or "transformers" (batched `generate`)."""
    device: str = "cpu"
    """Where the transformers engine runs ("cuda" on a GPU); the runner always runs on the CPU."""
    time_budget_s: float | None = None
    """Stop starting new work after this many seconds (None: answer every prompt)."""
    exclude: tuple[Path, ...] = ()
    """Data files whose prompts are skipped (their ids count as done)."""
    sources: tuple[str, ...] | None = None
    """Only these prompt sources (SOURCE_WEIGHTS names), in their weights' proportions; None: all."""

    def __post_init__(self) -> None:
        if self.sources is not None:
            unknown = sorted(set(self.sources) - set(SOURCE_WEIGHTS))
            if not self.sources or unknown:
                raise ValueError(f"sources must name one or more of {sorted(SOURCE_WEIGHTS)}, "
                                 f"got {list(self.sources)}")
        if self.num_prompts < 1 or self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError("num_prompts, max_new_tokens and batch_size must be >= 1")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError("heldout_fraction must be in [0, 1)")


@dataclass
class Prompt:
    id: str
    source: str
    domain: str
    text: str  # the user message as sent (suffix/prefix applied)


def split_of(prompt_id: str, heldout_fraction: float) -> str:
    """Deterministic train/held-out assignment from the id alone."""
    h = int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:8], "big") / 2.0 ** 64
    return "heldout" if h < heldout_fraction else "train"


def styled(domain: str, source: str, text: str) -> str:
    if domain == "math":
        return text + MATH_SUFFIX
    if domain == "code" and source in ("mbpp", "exercism", "gpteacher_codegen"):
        return CODE_PREFIX + text
    return text


def select_prompts(train_dir: Path, num_prompts: int, seed: int,
                   sources: Sequence[str] | None = None) -> list[Prompt]:
    """A seeded mix of the training prompts following SOURCE_WEIGHTS (sources without a weight
    are skipped; a source with too few prompts gives what it has); with `sources`, of those
    sources only, the weights renormalised over them. FileNotFoundError, naming the folder, when
    `train_dir` is not one."""
    weights = {s: w for s, w in SOURCE_WEIGHTS.items() if sources is None or s in sources}
    by_source: dict[str, list[Prompt]] = {}
    for path in sorted(require_folder(train_dir, "training prompts").glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:  # not splitlines(): prompts hold U+2028
            rows = [json.loads(line) for line in f if line.strip()]
        for row in rows:
            by_source.setdefault(row["source"], []).append(
                Prompt(row["id"], row["source"], row["domain"],
                       styled(row["domain"], row["source"], row["prompt"])))
    rng = random.Random(seed)
    chosen: list[Prompt] = []
    total_weight = sum(weights[s] for s in by_source if s in weights)
    for source in sorted(by_source):
        if source not in SOURCE_WEIGHTS:
            continue
        pool = by_source[source]
        rng.shuffle(pool)  # chosen or not: a seed orders each source the same with any `sources`
        if source in weights:
            chosen += pool[:round(num_prompts * weights[source] / total_weight)]
    rng.shuffle(chosen)
    return chosen[:num_prompts]


def encode_chat(tokenizer, text: str) -> list[int]:
    """Token ids of one user message under the model's chat template, ready for the answer."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def _open(path: Path, mode: str):
    return gzip.open(path, mode + "t") if str(path).endswith(".gz") else open(path, mode)


def read_records(path: Path) -> Iterator[dict]:
    """The records of a generated data file (plain or gzipped jsonl).

    A file whose writer was killed ends in a cut-off gzip stream or line: the records before the
    cut are read and the rest is dropped (`repair_data_file` rewrites such a file cleanly)."""
    if not Path(path).exists():
        return
    with _open(Path(path), "r") as f:
        try:
            for line in f:
                if not line.endswith("\n"):
                    return  # the writer stopped mid-line
                line = line.strip()
                if line:
                    yield json.loads(line)
        except EOFError:  # gzip stream cut off
            return


def repair_data_file(path: Path) -> bool:
    """Rewrite a data file that `read_records` reads only in part (see there), keeping every
    complete record; returns whether it was cut off."""
    if not Path(path).exists():
        return False
    try:
        with _open(Path(path), "r") as f:
            text = f.read()
        if text == "" or text.endswith("\n"):
            return False
    except EOFError:
        pass
    records = list(read_records(path))
    with _open(Path(path), "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return True


def generate_answers(runner, prompts: list[tuple[str, list[int]]], *, max_new_tokens: int,
                     batch_size: int, sampling: SamplingParams, eos_token_ids: set[int],
                     generator: torch.Generator | None = None, deadline: float | None = None
                     ) -> Iterator[tuple[str, list[int], bool]]:
    """Answer many prompts with continuous batching through the target runner.

    prompts: (key, prompt token ids). Yields (key, answer ids, finished_by_eos) as each finishes.
    """
    from dspark.models.runner import ForwardItem

    pending = list(reversed(prompts))
    active: dict[str, list[int]] = {}  # key -> answer so far
    row_params = None
    while pending or active:
        items = []
        if deadline is not None and time.monotonic() > deadline:
            pending = []  # finish what is in flight, admit nothing new
            if not active:
                return
        while pending and len(active) < batch_size:
            key, ids = pending.pop()
            active[key] = []
            runner.add_request(key)
            items.append(ForwardItem(key, ids, logits_from=len(ids) - 1))
        for key, answer in active.items():
            if answer:  # not just admitted: feed the last sampled token
                items.append(ForwardItem(key, [answer[-1]], logits_from=0))
        out = runner.forward(items)  # one logit row per item, in item order
        if row_params is None or row_params.temperature.shape[0] != len(items):
            row_params = SamplingTensors.from_params([sampling] * len(items), out.logits.device)
        probs = probs_from_logits(out.logits, row_params)  # [num_items, vocab_size]
        uniforms = torch.rand(len(items), generator=generator).to(probs.device)  # [num_items]
        tokens = sample_from_probs(probs, uniforms).tolist()
        for item, token in zip(items, tokens):
            answer = active[item.request_id]
            answer.append(token)
            eos = token in eos_token_ids
            if eos or len(answer) >= max_new_tokens:
                runner.free(item.request_id)
                del active[item.request_id]
                yield item.request_id, answer, eos


def generate_answers_transformers(model, prompts: list[tuple[str, list[int]]], *,
                                  max_new_tokens: int, batch_size: int, sampling: SamplingParams,
                                  eos_token_ids: set[int], pad_token_id: int, seed: int = 0,
                                  deadline: float | None = None
                                  ) -> Iterator[tuple[str, list[int], bool]]:
    """Answer many prompts with transformers' `generate` in left-padded batches.

    prompts: (key, prompt token ids), batched by length so a batch pads little, the batches in a
    seeded random order. Yields
    (key, answer ids up to and including the first EOS, finished_by_eos) per prompt, a batch at a
    time. Sampling applies temperature, then top-k, then top-p, as `dspark.sampling` does
    (temperature 0 = greedy). Batch b is seeded with seed + b.
    """
    from transformers import GenerationConfig

    greedy = sampling.temperature == 0.0
    # A fresh config: the model folder's generation_config.json must not add its own defaults.
    gen_config = GenerationConfig(
        do_sample=not greedy, max_new_tokens=max_new_tokens, eos_token_id=sorted(eos_token_ids),
        pad_token_id=pad_token_id,
        **({} if greedy else {"temperature": sampling.temperature, "top_k": sampling.top_k or None,
                              "top_p": sampling.top_p}))
    by_length = sorted(prompts, key=lambda kp: len(kp[1]))
    batches = [by_length[i:i + batch_size] for i in range(0, len(by_length), batch_size)]
    random.Random(seed).shuffle(batches)  # a time budget must not keep only the short prompts
    for b, chunk in enumerate(batches):
        if deadline is not None and time.monotonic() > deadline:
            return
        width = max(len(ids) for _, ids in chunk)
        input_ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.int64)  # [n, width]
        attention_mask = torch.zeros(len(chunk), width, dtype=torch.int64)
        for row, (_, ids) in enumerate(chunk):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = 1
        torch.manual_seed(seed + b)
        with torch.no_grad():
            out = model.generate(input_ids=input_ids.to(model.device),
                                 attention_mask=attention_mask.to(model.device),
                                 generation_config=gen_config)  # [n, width + new]
        for (key, _), row in zip(chunk, out[:, width:].tolist()):
            answer: list[int] = []
            finished = False
            for token in row[:max_new_tokens]:
                answer.append(token)
                if token in eos_token_ids:
                    finished = True
                    break
            yield key, answer, finished


def run_generation(config: DataGenConfig) -> dict:
    """Generate (or resume) the data file; returns counts."""
    from transformers import AutoTokenizer
    from tqdm import tqdm

    from dspark.models.runner import RunnerConfig, TargetRunner

    tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
    prompts = select_prompts(config.train_dir, config.num_prompts, config.seed, config.sources)
    if repair_data_file(config.out):  # a killed run: appending after the cut would hide the rest
        print(f"{config.out}: an earlier run was cut off; kept its complete records", flush=True)
    done = {r["id"] for path in (config.out, *config.exclude) for r in read_records(path)}
    todo = [p for p in prompts if p.id not in done]
    if not todo:  # nothing to answer: leave the file as it is (an append adds an empty gzip member)
        return summarize(config.out)
    by_id = {p.id: p for p in todo}
    encoded = [(p.id, encode_chat(tokenizer, p.text)) for p in todo]
    prompt_ids = dict(encoded)
    eos = {tokenizer.eos_token_id} | {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    eos.discard(None)
    deadline = None if config.time_budget_s is None else time.monotonic() + config.time_budget_s
    if config.engine == "transformers":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            config.model_dir, dtype=getattr(torch, config.dtype)).to(config.device).eval()
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
        answers = generate_answers_transformers(
            model, encoded, max_new_tokens=config.max_new_tokens, batch_size=config.batch_size,
            sampling=config.sampling, eos_token_ids=eos, pad_token_id=pad, seed=config.seed,
            deadline=deadline)
    else:
        runner = TargetRunner(config.model_dir, RunnerConfig(
            device=config.device, dtype=config.dtype, kv_cache_tokens=config.batch_size * 2048))
        answers = generate_answers(
            runner, encoded, max_new_tokens=config.max_new_tokens, batch_size=config.batch_size,
            sampling=config.sampling, eos_token_ids=eos,
            generator=torch.Generator().manual_seed(config.seed), deadline=deadline)
    config.out.parent.mkdir(parents=True, exist_ok=True)
    new_tokens = 0
    with _open(config.out, "a") as f, tqdm(total=len(prompts), initial=len(prompts) - len(todo),
                                           desc="answers", unit="ans") as bar:
        for key, answer, finished in answers:
            p = by_id[key]
            f.write(json.dumps({"id": p.id, "source": p.source,
                                "split": split_of(p.id, config.heldout_fraction),
                                "prompt_ids": prompt_ids[key], "answer_ids": answer,
                                "finished": finished,
                                "temperature": config.sampling.temperature,
                                "dtype": config.dtype}) + "\n")
            f.flush()
            new_tokens += len(answer)
            bar.update(1)
            bar.set_postfix(tokens=new_tokens)
    return summarize(config.out)


def summarize(path: Path) -> dict:
    """Counts of a data file: answers and answer tokens per split."""
    stats = {"answers": 0, "answer_tokens": 0, "prompt_tokens": 0, "by_split": {}}
    for r in read_records(path):
        stats["answers"] += 1
        stats["answer_tokens"] += len(r["answer_ids"])
        stats["prompt_tokens"] += len(r["prompt_ids"])
        s = stats["by_split"].setdefault(r["split"], {"answers": 0, "answer_tokens": 0})
        s["answers"] += 1
        s["answer_tokens"] += len(r["answer_ids"])
    return stats


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["generate", "stats"],
                        help="generate: answer prompts with the target; stats: count a data file")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="target model folder (default: the prepared SmolLM2)")
    parser.add_argument("--train-dir", type=Path, default=TRAIN_PROMPTS_DIR,
                        help="training prompts folder (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("data/smollm2_answers.jsonl.gz"))
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=DataGenConfig.batch_size,
                        help="answers in flight, one flattened batch (default: %(default)s)")
    parser.add_argument("--heldout-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--engine", default="runner", choices=ENGINES,
                        help="runner: our target runner (CPU); transformers: batched generate "
                             "(the fast path on a GPU)")
    add_device_argument(parser, help_suffix="; the runner engine and the transformers one alike")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="stop starting new answers after this many seconds")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="sampling temperature of the answers (0 = greedy)")
    parser.add_argument("--top-p", type=float, default=0.8, help="nucleus mass (1 = off)")
    parser.add_argument("--top-k", type=int, default=20, help="top-k (0 = off)")
    parser.add_argument("--exclude", type=Path, action="append", default=[],
                        help="skip prompts already answered in this data file (repeatable): a "
                             "second file then adds new prompts, not new answers to old ones")
    parser.add_argument("--sources", default=None,
                        help="answer only these prompt sources, comma-separated (default: all; "
                             f"the sources: {', '.join(SOURCE_WEIGHTS)})")


def run(args: argparse.Namespace) -> int:
    if args.action == "stats":
        print(json.dumps(summarize(args.out)))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model_dir
    if model_dir is None:
        from dspark.fetch import ensure_model
        model_dir = ensure_model()
    config = DataGenConfig(model_dir=Path(model_dir), train_dir=args.train_dir,
                           out=args.out, num_prompts=args.num_prompts,
                           max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                           heldout_fraction=args.heldout_fraction, seed=args.seed, dtype=args.dtype,
                           engine=args.engine, device=resolve_device(args.device),
                           time_budget_s=args.time_budget_s,
                           sampling=SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                                   top_k=args.top_k),
                           exclude=tuple(args.exclude),
                           sources=None if args.sources is None else tuple(
                               s.strip() for s in args.sources.split(",") if s.strip()))
    print(json.dumps(run_generation(config)))
    return 0
