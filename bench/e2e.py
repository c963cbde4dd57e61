"""End-to-end speed benchmark (docs/design.md section 10): output tokens/s of our engine with and without
drafters against transformers `generate` and prompt lookup, greedy and temperature 1.0, 1 and 8
streams; markdown tables, the time breakdown of the engine rows, and one final JSON line.
The code lives in `dspark/evaluation/speed/` (also `dspark bench`, same flags). Usage:
    .venv/bin/python bench/e2e.py [--limit 4] [--max-tokens 128] [--temperatures 0,1.0]
        [--concurrency 1,8] [--methods target,mtp1,dflash,dspark,hf-generate,hf-prompt-lookup]
        [--checkpoints DIR] [--model-dir DIR] [--threads N] [--dtype float32] [--json-out PATH]
"""

from dspark.evaluation.speed.bench_cli import main

if __name__ == "__main__":
    raise SystemExit(main())
