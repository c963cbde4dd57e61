"""Every `bench/` script runs to its final JSON line on tiny sizes, so that a benchmark that no
longer matches the code fails here instead of on the day someone needs its numbers.

The scripts run in this process (`runpy`, as `__main__`, with their own argv), on a tiny random
Llama target, an untrained DSpark drafter, four one-line eval sets and a tiny answers file; only
`bench/eval_suite.py` starts subprocesses (`dspark eval`, as it always does). Two scripts are
exempt, each for the reason given in EXEMPT; a new script must join one of the two lists.
"""

from __future__ import annotations

import gzip
import json
import random
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import torch

from dspark.paths import REPO_ROOT

from .conftest import tiny_dspark

BENCH = REPO_ROOT / "bench"

EXEMPT = {
    "services.py": "starts the drafter, verifier and scheduler processes twice (one and two "
                   "cohorts): about two minutes even with `--tiny`; the service tests cover the "
                   "stack it times",
    "loadtest_paired.py": "two service stacks under Locust; tests/loadtest/test_paired.py runs it "
                          "with `--tiny`",
    "drafter_invariant.py": "tau of two rules on the real model and the shipped drafter; the rule "
                            "is tested in tests/test_rejection.py and tests/test_seeded_repeats.py",
    "seeded_repeat.py": "the real model beside other requests; tests/test_seeded_repeats.py runs "
                        "the same check on the tiny target",
    "seeded_tau.py": "tau of seeded against unseeded requests on the real model and the shipped "
                     "drafter; tests/test_seeded_repeats.py tests the seeded path on the tiny "
                     "target",
    "draft_processing.py": "tau with and without processed drafts on the real target and drafter (its "
                           "JSON case needs a tokenizer that can spell JSON); "
                           "tests/models/test_draft_processing.py tests the processing",
    "draft_processing_services.py": "two service stacks of the real target and drafter, one with an "
                                    "older checkout's drafter service; "
                                    "tests/services/test_draft_processing_through_services.py "
                                    "tests the drafter service's processing",
    "fork_prefill.py": "n samples of a 500-token prompt on the real target and the shipped drafter; "
                       "tests/test_forks.py tests forks on the tiny target",
    "grammar_mask.py": "a JSON grammar needs a tokenizer that can spell JSON (the real target's); "
                       "tests/test_structured_output.py tests the masks",
    "q4_kernel_versions.py": "builds two versions of the block kernel and times them on the real "
                             "model's GGUF blocks; tests/models/test_block_linear.py tests the kernel",
    "int4pack_mm.py": "torch's 4-bit matmul on the real model's GGUF blocks against the block kernel; "
                      "tests/models/test_int4pack_mapping.py tests its mapping of the blocks",
    "q4_linear.py": "times the block kernel on the real model's GGUF layer shapes; "
                    "tests/models/test_block_linear.py tests the kernel",
    "q4_step_rows.py": "times a step's products on the real model's GGUF blocks and their packed float32 "
                       "weights; tests/models/test_block_linear.py tests the kernel",
    "q4_decode_interleaved.py": "decode steps of the real model's GGUF blocks; "
                                "tests/models/test_runner_q4_smollm2.py tests q4 decoding",
    "q4_step_profile.py": "profiles passes of the real model's GGUF blocks (weights=q4); "
                          "tests/models/test_runner_q4_smollm2.py tests q4 decoding",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """Paths the scripts take: target, checkpoints folder, drafter checkpoints, eval sets, data."""
    from transformers import AutoTokenizer

    from dspark.models.drafter_io import save_drafter
    from loadtest.tiny_models import VOCAB, build_tiny_models

    root = tmp_path_factory.mktemp("bench_smoke")
    models = build_tiny_models(root / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(models.target_dir)
    tokenizer.eos_token = f"t{VOCAB - 1}"  # the benchmarks stop generations at EOS
    tokenizer.save_pretrained(models.target_dir)
    checkpoints = root / "checkpoints"
    shutil.copytree(models.drafter_dir, checkpoints / "dspark-markov")

    # The training-based probes read the teacher's features below its final layer (which
    # transformers already normalises), so their drafter takes layers 0-2 of the 4.
    save_drafter(tiny_dspark(1, target_layer_ids=[0, 1, 2]), root / "probe_drafter")
    # A drafter with a reduced draft vocabulary (the even ids), as the shipped one has.
    reduced = tiny_dspark(2, draft_vocab_size=VOCAB // 2)
    hidden = reduced.config.hidden_size
    reduced.set_target_weights(torch.randn(VOCAB, hidden), torch.randn(VOCAB, hidden),
                               draft_token_ids=torch.arange(0, VOCAB, 2))
    save_drafter(reduced, root / "reduced_drafter")

    eval_dir = root / "eval"
    eval_dir.mkdir()
    for name in ("gsm8k", "humaneval", "math500", "mt-bench"):
        (eval_dir / f"{name}.jsonl").write_text('{"turns": ["t5 t6 t7 t8 t9"]}\n'
                                                '{"turns": ["t10 t11 t12"]}\n')
    rng = random.Random(0)
    data = root / "answers.jsonl.gz"
    with gzip.open(data, "wt") as f:  # the format of `dspark data generate`
        for i in range(12):
            f.write(json.dumps({"id": f"p{i}", "source": "tiny",
                                "split": "heldout" if i % 2 else "train",
                                "prompt_ids": [1] + [rng.randrange(4, VOCAB) for _ in range(6)] + [2, 3],
                                "answer_ids": [rng.randrange(4, VOCAB) for _ in range(24)],
                                "finished": True}) + "\n")
    train_dir = root / "train"  # the prompt files of `dspark data generate`
    train_dir.mkdir()
    (train_dir / "math_gsm8k.jsonl").write_text("".join(
        json.dumps({"id": f"gsm8k-{i}", "source": "gsm8k", "domain": "math",
                    "prompt": f"t{5 + i} t{6 + i} t7"}) + "\n" for i in range(6)))
    return {"target": models.target_dir, "checkpoints": checkpoints,
            "drafter": checkpoints / "dspark-markov", "probe_drafter": root / "probe_drafter",
            "cost_table": models.cost_table, "eval": eval_dir, "data": data, "out": root / "out",
            "train": train_dir, "reduced_drafter": root / "reduced_drafter"}


def tiny_argv(script: str, p: dict[str, Path]) -> list[str]:
    """The arguments that make `script` small."""
    t, one = str(p["target"]), ["--threads", "1"]
    return {
        "attention_backends.py": ["--device", "cpu", "--backends", "paged,padded,flex,triton",
                                  "--batches", "1,2", "--new-tokens", "3,1", "--context", "20",
                                  "--chunk", "16", "--layers", "2", "--repeats", "1", *one],
        "core_ops.py": ["--requests", "8", "--gamma", "4", "--repeats", "3", "--verify-requests",
                        "2", "--verify-gamma", "3", "--vocab", "64", "--sparse-k", "8",
                        "--verify-repeats", "1"],
        "e2e.py": ["--model-dir", t, "--checkpoints", str(p["checkpoints"]), "--eval-dir",
                   str(p["eval"]), "--datasets", "gsm8k", "--limit", "1", "--max-tokens", "4",
                   "--temperatures", "0", "--concurrency", "1", "--methods", "target,dspark",
                   "--cost-table", str(p["cost_table"]), *one],
        "eval_suite.py": ["--model-dir", t, "--checkpoints", str(p["checkpoints"]), "--methods",
                          "dspark", "--eval-dir", str(p["eval"]), "--sets", "gsm8k", "--limit",
                          "2", "--max-tokens", "16", *one],
        "round_modes.py": ["--model-dir", t, "--drafter-dir", str(p["drafter"]), "--answers", str(p["data"]),
                           "--heldout", "2", "--max-tokens", "4", "--repeats", "1", "--variant",
                           "fresh_trim=False", *one],
        "speculation_ceiling.py": ["--model-dir", t, "--drafter-dir", str(p["probe_drafter"]), "--eval-dir",
                                   str(p["eval"]), "--limit", "1", "--max-tokens", "12", *one],
        "target_decode.py": ["--model-dir", t, "--eval-dir", str(p["eval"]), "--new-tokens", "2",
                             "--repeats", "1", "--streams", "1", "--dtypes", "float32", *one],
        "data_generate.py": ["--model-dir", t, "--train-dir", str(p["train"]), "--prompts", "4",
                             "--batch-size", "2", "--max-new-tokens", "3", *one],
        "closed_loop.py": ["--model-dir", t, "--eval-dir", str(p["eval"]), "--users", "2",
                           "--max-tokens", "3", "--prompts", "4", "--warmup-s", "0.2", "--seconds",
                           "0.5", "--repeats", "1", *one],
        "admission_rounds.py": ["--model-dir", t, "--drafter-dir", str(p["drafter"]), "--eval-dir",
                                str(p["eval"]), "--users", "2", "--max-tokens", "3", "--prompts",
                                "4", "--warmup-s", "0.2", "--seconds", "0.5", "--repeats", "1",
                                "--dtype", "float32", "--out", str(p["out"] / "rounds.csv"), *one],
        "decode_breakdown.py": ["--model-dir", t, "--eval-dir", str(p["eval"]), "--streams", "2",
                                "--steps", "2", "--profile-steps", "1", "--top-ops", "3", *one],
        "draft_step.py": ["--model-dir", t, "--checkpoint", str(p["drafter"]), "--eval-dir",
                          str(p["eval"]), "--streams", "1,2", "--rounds", "2", "--profile-rounds",
                          "1", "--top-ops", "3", *one],
        "packed_weights.py": ["--model-dir", t, "--context", "8", "--repeats", "1", *one],
        "paged_attention_kernel.py": ["--streams", "2", "--context", "20", "--new-tokens", "1,3",
                                      "--repeats", "1", "--layers", "2", "--against", "HEAD", *one],
        "verify_forward.py": ["--model-dir", t, "--eval-dir", str(p["eval"]), "--streams", "2",
                              "--new-tokens", "1,3", "--dtypes", "float32", "--repeats", "1",
                              "--against", "HEAD", *one],
        "acceptance_oracle.py": ["--model-dir", t, "--checkpoint", str(p["drafter"]), "--eval-dir",
                                 str(p["eval"]), "--datasets", "gsm8k", "--limit", "2",
                                 "--max-tokens", "8", *one],
        "confidence_probe.py": ["--model-dir", t, "--checkpoint", str(p["drafter"]), "--data",
                                str(p["data"]), "--eval-dir", str(p["eval"]), "--datasets",
                                "gsm8k", "--eval-limit", "2", "--max-tokens", "8", *one],
        "heldout_answers.py": ["--model-dir", t, "--data", str(p["data"]), "--out",
                               str(p["out"] / "heldout.jsonl.gz"), "--max-new-tokens", "4",
                               "--batch-size", "2", *one],
        "drafter_context_ablation.py": ["--model-dir", t, "--checkpoint", str(p["probe_drafter"]),
                                        "--data", str(p["data"]), "--batches", "1", *one],
        "draft_temperature.py": ["--model-dir", t, "--checkpoint", str(p["probe_drafter"]),
                                 "--data", str(p["data"]), "--scales", "0.9,1.0", "--examples",
                                 "2", "--anchors", "4", "--target-dtype", "float32", *one],
        "train_step.py": ["--model-dir", t, "--data", str(p["data"]), "--init-layers", "1,2",
                          "--target-layers", "0,1,2", "--draft-vocab", "32", "--steps", "1",
                          "--warmup", "0", "--setups", "recipe,bf16-a128", *one],
        "served_vs_teacher_forced.py": ["--model-dir", t, "--checkpoint", str(p["probe_drafter"]),
                                        "--data", str(p["data"]), "--prompts", "2", "--max-tokens",
                                        "12", *one],
        "draft_vocab_coverage.py": ["--checkpoint", str(p["reduced_drafter"]), "--answers",
                                    str(p["data"]), "--sizes", "40", "--widened-out",
                                    str(p["out"] / "widened")],
        "block_verification.py": ["--model-dir", t, "--checkpoint", str(p["drafter"]),
                                  "--eval-dir", str(p["eval"]), "--sets", "gsm8k,mt-bench",
                                  "--limit", "2", "--max-tokens", "8", "--dtype", "float32",
                                  "--timed-batches", "2", "--verify-len", "3", *one],
        "drafter_attention_probe.py": ["--model-dir", t, "--checkpoint", str(p["probe_drafter"]),
                                       "--data", str(p["data"]), "--qk-scales", "1", *one],
    }[script]


def scripts() -> list[str]:
    return sorted(p.name for p in BENCH.glob("*.py"))


def test_every_bench_script_is_smoked_or_exempt_with_a_reason():
    smoked = [s for s in scripts() if s not in EXEMPT]
    for script in smoked:
        tiny_argv(script, {k: Path(k) for k in ("target", "checkpoints", "drafter", "probe_drafter",
                                                 "cost_table", "eval", "data", "out", "train",
                                                 "reduced_drafter")})
    assert set(EXEMPT) <= set(scripts())
    assert all(reason for reason in EXEMPT.values())


@pytest.mark.parametrize("script", [s for s in scripts() if s not in EXEMPT])
def test_bench_script_runs_on_tiny_sizes(script, tiny, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(BENCH / script), *tiny_argv(script, tiny)])
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.syspath_prepend(str(BENCH))  # as when run as a script: siblings import each other
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    except SystemExit as stop:
        assert stop.code in (0, None), f"{script} exited with {stop.code}"
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines, f"{script} printed nothing"
    summary = json.loads(lines[-1])  # a benchmark ends with one JSON line
    assert summary["bench"] == script.removesuffix(".py")


def test_widened_draft_vocabulary_keeps_the_drafter_and_loads(tiny, tmp_path, monkeypatch):
    """bench/draft_vocab_coverage.py's widened copy: the drafter's ids plus the most frequent
    answer tokens outside them, its Markov rows kept and zero rows added, loadable as a drafter."""
    from collections import Counter

    from dspark.models.drafter_io import load_drafter, read_checkpoint
    from loadtest.tiny_models import VOCAB

    monkeypatch.syspath_prepend(str(BENCH))
    import draft_vocab_coverage as coverage

    ids = torch.arange(0, VOCAB, 2)  # the reduced drafter's vocabulary
    wider = coverage.widened_ids(ids, Counter({5: 9, 3: 4, 2: 50, 7: 1}), VOCAB // 2 + 3)
    assert wider.tolist() == sorted(ids.tolist() + [3, 5, 7])  # 2 is inside already
    coverage.write_widened(tiny["reduced_drafter"], tmp_path / "wide", wider)
    hidden = read_checkpoint(tiny["reduced_drafter"])[0].hidden_size
    embed, head = torch.randn(VOCAB, hidden), torch.randn(VOCAB, hidden)
    narrow, wide = (load_drafter(d, embed, head) for d in (tiny["reduced_drafter"], tmp_path / "wide"))
    assert wide.config.draft_vocab_size == wider.numel()
    assert torch.equal(wide.draft_to_target, wider)
    w2_narrow = narrow.markov_head.markov_w2.weight  # [V_d, r]
    w2_wide = wide.markov_head.markov_w2.weight  # [V_d + 3, r]
    kept = torch.searchsorted(wider, ids)
    assert torch.equal(w2_wide[kept], w2_narrow)
    added = torch.ones(wider.numel(), dtype=torch.bool)
    added[kept] = False
    assert not bool(w2_wide[added].any())
