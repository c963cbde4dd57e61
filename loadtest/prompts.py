"""Prompts for the load test: the first turn of every record of the eval sets.

The eval sets (`*.jsonl` of `dspark.paths.EVAL_PROMPTS_DIR`: `../shared/data/eval/`, or
`data/eval/` under `$DSPARK_SHARED_DIR`; one `{"turns": [...]}` per line) are the prompts the
acceptance numbers were measured on, so the load test exercises the drafter on the same kind of
text. `max_chars` cuts long prompts: the tiny test model has a short context, and on the 2-core
machine prefill of a long prompt would dominate the measurement.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark.paths import EVAL_PROMPTS_DIR as DEFAULT_EVAL_DIR


def load_first_turns(eval_dir: Path = DEFAULT_EVAL_DIR, sets: tuple[str, ...] = (),
                     max_chars: int = 0) -> list[str]:
    """First turns of `eval_dir/<set>.jsonl` (every set when `sets` is empty), in file order."""
    files = [eval_dir / f"{s}.jsonl" for s in sets] if sets else sorted(eval_dir.glob("*.jsonl"))
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise FileNotFoundError(f"no eval prompts: missing {missing or eval_dir}")
    prompts = []
    for path in files:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            turns = json.loads(line).get("turns") or []
            if turns and isinstance(turns[0], str) and turns[0].strip():
                prompts.append(turns[0][:max_chars] if max_chars > 0 else turns[0])
    if not prompts:
        raise ValueError(f"no first turns in {[str(f) for f in files]}")
    return prompts
