"""What a `response_format` grammar costs a verification block: building the rows' masks and
applying them, by the number of drafts in the block.

For a json_schema on the target's own tokenizer (SmolLM2's 49,152 tokens), the matcher is
advanced through a JSON prefix the grammar accepts, then each timed call fills the masks of a
block of `l` drafts (`GrammarState.row_masks`: the matcher advanced through the drafts and
rolled back) and masks a [l + 1, V] float32 logits block with them (`mask_logits`). The drafts
are the grammar's own continuation (every draft allowed: the most rows filled, the dearest case).
Median of `--repeats` calls per `l`. Prints a markdown table and one JSON line. Usage:
    .venv/bin/python bench/grammar_mask.py [--drafts 0,1,3,7] [--repeats 50] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoTokenizer

from dspark.cpu_info import cpu_line
from dspark.fetch import ensure_model
from dspark.structured_output import GrammarCompiler, GrammarSpec, mask_logits

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "city": {"type": "string"}},
          "required": ["name", "age", "city"]}
COMMITTED_TEXT = '{"name": "Alice'
"""Output before the timed block: inside a string, where most of the vocabulary is allowed."""
CONTINUATION_TEXT = ' Smith", "age": 30, "city": "Paris"}'
"""The drafts: the grammar's own continuation of COMMITTED_TEXT, tokenised."""


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafts", default="0,1,3,7", help="block sizes l, comma-separated")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(ensure_model())
    compiler = GrammarCompiler(tokenizer=tokenizer, vocab_size=len(tokenizer))
    eos = [tokenizer.eos_token_id]
    compile_start = time.perf_counter()
    state = compiler.start(GrammarSpec.json_schema(SCHEMA), eos)
    compile_ms = (time.perf_counter() - compile_start) * 1e3
    state.observe(tokenizer.encode(COMMITTED_TEXT, add_special_tokens=False))
    continuation = tokenizer.encode(CONTINUATION_TEXT, add_special_tokens=False)

    rows = []
    for num_drafts in [int(x) for x in args.drafts.split(",")]:
        drafts = continuation[:num_drafts]
        assert len(drafts) == num_drafts, f"the continuation has only {len(continuation)} tokens"
        allowed = state.row_masks(drafts)  # [l + 1, V]
        assert bool(allowed.all(dim=1).logical_not().all()), "every row should be constrained"
        logits = torch.randn(num_drafts + 1, allowed.shape[1])  # [l + 1, V]
        build_ms = _median_ms(lambda: state.row_masks(drafts), args.repeats)
        apply_ms = _median_ms(lambda: mask_logits(logits, allowed), args.repeats)
        rows.append({"drafts": num_drafts, "rows": num_drafts + 1, "build_ms": round(build_ms, 3),
                     "apply_ms": round(apply_ms, 3)})

    print(f"# {cpu_line()}; torch {torch.__version__}, {args.threads} threads; "
          f"vocabulary {len(tokenizer)}; first compile (tokenizer read included) {compile_ms:.0f} ms")
    print("| drafts | rows | build masks ms | apply ms |")
    print("| ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['drafts']} | {row['rows']} | {row['build_ms']:.3f} | {row['apply_ms']:.3f} |")
    print(json.dumps({"bench": "grammar_mask", "cpu": cpu_line(), "threads": args.threads,
                      "compile_ms": round(compile_ms, 1), "rows": rows}))


if __name__ == "__main__":
    main()
