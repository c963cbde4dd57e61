"""Make the shipped drafters on a GPU in one short, time-bounded run.

Where a GPU is at hand, this generates and trains far more than the CPU budget allows; the project
does not depend on one, and the CPU recipe in docs/drafter.md stays the way to make the drafters
without one. Stages, each bounded in time:

1. target: the GGUF that `dspark fetch-model` converts, dequantised the same way (transformers),
   with the tokenizer files of the converted folder; the weights' digest is compared with the one
   computed on the CPU machine (`--expect-digest`), so the teacher is the same model.
2. data: the target answers training prompts (`dspark data generate --engine transformers`:
   batched `generate`, T 0.7, top-p 0.8, top-k 20), until `--gen-budget-s` is spent.
3. training: DSpark-markov, DFlash and the Eagle-style drafter with the recipe of docs/drafter.md
   (same data, same batch, same number of steps for every method), one after the other, sharing
   one frozen teacher. The number of steps is sized so that the three fit `--train-budget-s`:
   every method's step is timed first (3 warm-up steps, 5 timed).
4. pack: the drafters, their logs and the data, in one tar split into parts of 15 MiB.

`--smoke` runs every stage with a random target shaped like the real one (its config.json) and
synthetic data, and prints the timings: a cheap first call that shows the real run will work and
how large it can be.

    python scripts/gpu_drafters.py --gguf G --tokenizer-dir D --prompts P --work W --out O
    (tests/training/test_gpu_drafters_script.py runs both modes on the CPU at tiny sizes)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dspark.training.data import DataGenConfig, run_generation  # noqa: E402
from dspark.methods import DrafterKind  # noqa: E402
from dspark.training.trainer import Trainer, TrainConfig  # noqa: E402

TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                   "tokenizer_config.json", "chat_template.jinja")
PART_BYTES = 15 * 2**20


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over the state dict's names and float32 bytes (sorted names)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def prepare_target(args: argparse.Namespace, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoConfig

    folder.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (args.tokenizer_dir / name).exists():
            shutil.copy(args.tokenizer_dir / name, folder / name)
    if args.smoke:  # a random model of the real shape
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    elif args.target_dir is not None:  # an already converted folder
        model = AutoModelForCausalLM.from_pretrained(args.target_dir, dtype=torch.float32)
    else:
        gguf = Path(args.gguf)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    digest = weights_digest(model)
    log(f"target weights digest {digest} (expected {args.expect_digest or '-'}): "
        f"{'MATCH' if digest == args.expect_digest else 'differs'}")
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:  # the CPU machine's config and tokenizer, not a re-conversion
        if (args.tokenizer_dir / name).exists():
            shutil.copy(args.tokenizer_dir / name, folder / name)


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    """Where the target comes from (prepare_target reads these)."""
    source = p.add_mutually_exclusive_group()
    source.add_argument("--gguf", default=None, help="the target as GGUF (dequantised here)")
    source.add_argument("--target-dir", type=Path, default=None,
                        help="the target as a transformers folder")
    p.add_argument("--tokenizer-dir", type=Path, required=True,
                   help="the converted target folder's config and tokenizer files")
    p.add_argument("--expect-digest", default=None)


def start_run(args: argparse.Namespace) -> Path:
    """Log the device, allow TF32 products, make --work and --out, write the target into
    work/target (returned)."""
    t0 = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    log(f"torch {torch.__version__}, cuda {torch.cuda.is_available()} "
        f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''}")
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.work / "target"
    prepare_target(args, target)
    log(f"target ready ({time.perf_counter() - t0:.0f} s)")
    return target


def synthetic_data(path: Path, n: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for i in range(n):
            prompt = torch.randint(3, vocab, (60,), generator=g).tolist()
            answer = torch.randint(3, 8000, (250,), generator=g).tolist()
            f.write(json.dumps({"id": f"s{i}", "split": "train" if i % 10 else "heldout",
                                "prompt_ids": prompt, "answer_ids": answer}) + "\n")


RECIPES: dict[str, dict] = {
    "dspark-markov": dict(method=DrafterKind.MARKOV, num_layers=2, markov_rank=64,
                          init_layers_from=[28, 29], markov_init="bigram",
                          inject_last_context=True, output_norm_lr_scale=30.0),
    "dflash": dict(method=DrafterKind.DFLASH, num_layers=2, init_layers_from=[28, 29],
                   inject_last_context=True),
    "eagle": dict(method=DrafterKind.EAGLE),
}


def train_config(args: argparse.Namespace, name: str, data: Path, target: Path, steps: int,
                 out: Path, **override) -> TrainConfig:
    recipe = {**RECIPES[name], **override}
    return TrainConfig(
        data_path=str(data), target_dir=str(target), out_dir=str(out), gamma=7,
        draft_vocab_size=8192, steps=steps, warmup_steps=max(30, steps // 20), lr=args.lr,
        batch_size=args.train_batch, num_anchors=args.anchors, device=args.device,
        target_dtype="float32", log_every=10, save_every=10**9, progress=False, resume=False,
        **recipe)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(cfg: TrainConfig, teacher: torch.nn.Module) -> float:
    trainer = Trainer(cfg, target=teacher)
    for _ in range(3):
        trainer.train_step()
    sync()
    start = time.perf_counter()
    for _ in range(5):
        trainer.train_step()
    sync()
    del trainer
    return (time.perf_counter() - start) / 5


def pack(work: Path, out: Path) -> None:
    """runs/ and the data (xz: JSON token lists shrink several times more than with gzip) in one
    tar, split into parts that the device tool brings back (16 MiB a file at most)."""
    import lzma

    data = work / "data" / "smollm2_answers_gpu.jsonl"
    if data.exists():
        with open(data, "rb") as src, lzma.open(work / "runs" / (data.name + ".xz"), "wb",
                                                preset=6) as dst:
            shutil.copyfileobj(src, dst)
    size = tar_in_parts(work, "runs", out, "bundle")
    log(f"packed {size / 2**20:.1f} MiB into {(size + PART_BYTES - 1) // PART_BYTES} parts")


def tar_in_parts(work: Path, folder: str, out: Path, stem: str) -> int:
    """work/folder as one tar, written to out/<stem>.tar.partNN in PART_BYTES pieces (each
    renamed into place whole; earlier parts of that name removed); returns the tar's bytes."""
    tar = work / f"{stem}.tar"
    subprocess.run(["tar", "-cf", str(tar), "-C", str(work), folder], check=True)
    blob = tar.read_bytes()
    for old in out.glob(f"{stem}.tar.part*"):
        old.unlink()
    for i in range(0, len(blob), PART_BYTES):
        part = out / f"{stem}.tar.part{i // PART_BYTES:02d}"
        part.with_suffix(".tmp").write_bytes(blob[i:i + PART_BYTES])
        part.with_suffix(".tmp").rename(part)
    return len(blob)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_arguments(p)
    p.add_argument("--prompts", type=Path, required=True, help="training prompt folder")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--num-prompts", type=int, default=16000)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--gen-batch", type=int, default=1024)
    p.add_argument("--gen-budget-s", type=float, default=150)
    p.add_argument("--train-budget-s", type=float, default=300)
    p.add_argument("--train-batch", type=int, default=64)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-steps", type=int, default=6000)
    p.add_argument("--smoke-steps", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--total-budget-s", type=float, default=None,
                   help="the whole run's time: training shrinks to end this long after the start, "
                        "less --pack-reserve-s")
    p.add_argument("--pack-reserve-s", type=float, default=45)
    p.add_argument("--min-steps", type=int, default=50)
    args = p.parse_args()
    if not args.smoke and args.gguf is None and args.target_dir is None:
        p.error("give --gguf or --target-dir (or --smoke)")

    t0 = time.perf_counter()
    target = start_run(args)

    # ---- data -----------------------------------------------------------------------------------
    (args.work / "data").mkdir(exist_ok=True)
    data = args.work / "data" / "smollm2_answers_gpu.jsonl"
    t = time.perf_counter()
    stats = run_generation(DataGenConfig(
        model_dir=target, train_dir=args.prompts, out=data, num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch, dtype="bfloat16",
        engine="transformers", device=args.device, time_budget_s=args.gen_budget_s))
    gen_s = time.perf_counter() - t
    log(f"data: {json.dumps(stats)} in {gen_s:.0f} s "
        f"({stats['answer_tokens'] / gen_s:.0f} answer tokens/s)")
    train_data = data
    if args.smoke:  # random answers carry no EOS: train on synthetic data of realistic length
        train_data = args.work / "data" / "synthetic.jsonl"
        synthetic_data(train_data, 512, 49152)

    # ---- size the training ----------------------------------------------------------------------
    from transformers import AutoModelForCausalLM
    teacher = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(args.device).eval()
    step_s = {}
    for name in RECIPES:
        override = {"markov_init": "zero"} if name == "dspark-markov" else {}  # same step cost
        try:
            step_s[name] = time_steps(train_config(args, name, train_data, target, 1000,
                                                   args.work / "timing" / name, **override), teacher)
        except Exception:
            import traceback
            traceback.print_exc()
            continue
        log(f"{name}: {step_s[name] * 1000:.0f} ms per step (batch {args.train_batch} x "
            f"{args.anchors} anchors)")
    elapsed = time.perf_counter() - t0
    budget = args.train_budget_s
    if args.total_budget_s is not None:
        budget = min(budget, args.total_budget_s - elapsed - args.pack_reserve_s)
    steps = max(args.min_steps, int(min(args.max_steps, budget / sum(step_s.values()))))
    log(f"training {steps} steps per method ({elapsed:.0f} s spent so far)")
    summary = {"data": stats, "gen_s": round(gen_s, 1), "step_ms": {k: round(v * 1000, 1) for k, v
                                                                   in step_s.items()},
               "steps": steps, "train_batch": args.train_batch, "anchors": args.anchors,
               "smoke": args.smoke,
               "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    if args.smoke:
        steps = args.smoke_steps

    # ---- train ----------------------------------------------------------------------------------
    for name in step_s:  # the methods whose timing ran
        t = time.perf_counter()
        out = args.work / "runs" / name
        try:
            trainer = Trainer(train_config(args, name, train_data, target, steps, out),
                              target=teacher)
            trainer.run()
            del trainer
        except Exception as exc:  # keep the other methods: one crash must not cost the call
            import traceback
            traceback.print_exc()
            summary[f"{name}_error"] = repr(exc)
            continue
        shutil.rmtree(out / "checkpoint", ignore_errors=True)
        summary[f"{name}_train_s"] = round(time.perf_counter() - t, 1)
        tail = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()[-10:]]
        tau = sum(r.get("tau", 0.0) for r in tail) / max(1, len(tail))
        summary[f"{name}_final_tau"] = round(tau, 4)
        log(f"{name}: {steps} steps in {summary[f'{name}_train_s']:.0f} s, "
            f"teacher-forced tau over the last 100 steps {tau:.3f}")
    (args.work / "runs").mkdir(parents=True, exist_ok=True)
    (args.work / "runs" / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if args.smoke:
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    else:
        pack(args.work, args.out)
    log(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
