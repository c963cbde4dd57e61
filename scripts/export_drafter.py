"""A training run's drafter, ready to ship: its resume checkpoint (full precision) written as a
drafter folder in bfloat16, with the run's train_config.json and logs beside it.

    .venv/bin/python scripts/export_drafter.py runs/campaign/dspark-markov runs/candidate/dspark-markov

The folder's calibration.json (if the destination has one) is left as it is: refit it with
`dspark calibrate` after exporting, since the confidence head changed.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from dspark.models.drafter_io import WEIGHTS_NAME, read_checkpoint


def export(run: Path, out: Path) -> dict:
    config, tensors = read_checkpoint(run / "checkpoint")
    out.mkdir(parents=True, exist_ok=True)
    weights = {name: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous()
               for name, t in tensors.items()}
    save_file(weights, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    config.save(out)
    for name in ("train_config.json", "train_log.jsonl", "heldout_log.jsonl"):
        if (run / name).exists():
            shutil.copyfile(run / name, out / name)
    state = torch.load(run / "checkpoint" / "trainer_state.pt", weights_only=False)
    return {"out": str(out), "step": int(state["step"]),
            "bytes": (out / WEIGHTS_NAME).stat().st_size}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a `dspark train --out` folder")
    parser.add_argument("out", type=Path, help="the drafter folder to write")
    args = parser.parse_args()
    print(json.dumps(export(args.run, args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
