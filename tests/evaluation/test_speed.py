"""`bench/e2e.py` / `dspark bench` smoke run on a tiny random Llama target (character tokenizer with
a chat template) and an untrained DSpark drafter saved with the project's checkpoint writer; no
DFlash checkpoint, so that row must be reported missing. Checks the tables and the JSON, and
recomputes every speed, macro average and ratio from the raw token counts and seconds."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from dspark.calibration.sts_map import CALIBRATION_FILENAME, STSCalibration
from dspark.evaluation.speed import bench_cli
from dspark.evaluation.speed.rows import ROWS
from dspark.evaluation.speed.waves import BREAKDOWN_KEYS
from dspark.models.drafter_io import save_drafter
from loadtest.tiny_models import GAMMA

from ..conftest import tiny_dspark

DATASETS = ["gsm8k", "humaneval", "mt-bench"]
LIMIT, MAX_TOKENS = 1, 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory, save_tiny_chat_target):
    """(target folder, checkpoints folder with dspark-markov only, eval folder)."""
    root = tmp_path_factory.mktemp("bench_e2e")
    target = root / "target"
    save_tiny_chat_target(target)

    ckpts = root / "checkpoints"
    save_drafter(tiny_dspark(mask_token_id=0), ckpts / "dspark-markov")
    STSCalibration([1.5] * GAMMA).save(ckpts / "dspark-markov" / CALIBRATION_FILENAME)

    evals = root / "eval"
    evals.mkdir()
    for d, name in enumerate(DATASETS):
        with open(evals / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for i in range(6):
                f.write(json.dumps({"turns": [f"{name} {i}: what is {i} plus {d}?", "more?"]})
                        + "\n")
    return target, ckpts, evals


def call(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    bench_cli.configure(parser)
    return bench_cli.run(parser.parse_args(argv))


def test_bench_tables_json_and_ratios(setup, tmp_path, capsys):
    target, ckpts, evals = setup
    json_out = tmp_path / "bench.json"
    rc = call(["--checkpoints", str(ckpts), "--model-dir", str(target), "--eval-dir", str(evals),
               "--limit", str(LIMIT), "--max-tokens", str(MAX_TOKENS), "--temperatures", "0,1.0",
               "--concurrency", "1,2", "--warmup-tokens", "2", "--json-out", str(json_out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    lines = captured.out.strip().splitlines()
    result = json.loads(lines[-1])
    assert json.loads(json_out.read_text()) == result
    assert result["bench"] == "e2e" and result["threads"] == 1
    text = "\n".join(lines[:-1])

    assert [(t["temperature"], t["concurrency"]) for t in result["tables"]] == \
        [(0.0, 1), (0.0, 2), (1.0, 1), (1.0, 2)]
    assert text.count("| Row | gsm8k | humaneval | mt-bench | macro | vs target |") == 4
    assert text.count("**Where the time goes") == 4
    assert "| DFlash (full block) | missing |" in text
    for table in result["tables"]:
        c = table["concurrency"]
        prompts = c * math.ceil(LIMIT / c)  # whole waves: 1 at one stream, 2 at two
        assert table["prompts_per_dataset"] == prompts
        rows = table["rows"]
        assert list(rows) == list(ROWS)
        assert rows["dflash"]["status"] == "missing"
        assert str(ckpts / "dflash") in rows["dflash"]["note"]
        assert "batch 1 only" in rows["hf-prompt-lookup"]["note"]
        assert "STS calibrated" in rows["dspark"]["note"]
        assert rows["dspark-sync"]["note"].startswith("sync_greedy")
        assert "STS calibrated" in rows["dspark-sync"]["note"]
        assert rows["dspark-full"]["note"].startswith("fixed:")  # the drafter's whole block
        assert "float32 drafter" in rows["dspark-fp32-drafter"]["note"]
        assert rows["dspark-block"]["note"].endswith("block verification")
        assert "block verification" not in rows["dspark"]["note"]
        base = rows["target"]["datasets"]
        base_macro = sum(base[d]["tokens"] / base[d]["seconds"] for d in DATASETS) / len(DATASETS)
        for name, r in rows.items():
            if name == "dflash":
                continue
            assert r["status"] == "ok", (name, r)
            assert r["streams"] == len(DATASETS) * prompts
            assert r["streams"] <= r["tokens"] <= r["streams"] * MAX_TOKENS
            speeds = {}
            for d in DATASETS:
                ds = r["datasets"][d]
                assert ds["streams"] == prompts
                speeds[d] = ds["tokens"] / ds["seconds"]
                assert ds["tokens_per_s"] == pytest.approx(speeds[d], rel=1e-3)
                assert ds["ratio_vs_target"] == pytest.approx(
                    speeds[d] / (base[d]["tokens"] / base[d]["seconds"]), rel=2e-3)
            macro = sum(speeds.values()) / len(speeds)
            assert r["macro_tokens_per_s"] == pytest.approx(macro, rel=1e-3)
            assert r["ratio_vs_target"] == pytest.approx(macro / base_macro, rel=2e-3)
            assert r["seconds"] == pytest.approx(sum(r["datasets"][d]["seconds"] for d in DATASETS),
                                                 abs=1e-3)
            if table["temperature"] == 0 and (name.startswith("hf-") is False or c == 1):
                # lossless: every engine row, and transformers unbatched, give target's tokens
                assert r["greedy_same_as_target"] == 1.0, name
        assert rows["target"]["ratio_vs_target"] == 1.0

        for name in ("target", "mtp1", "dspark"):
            b = rows[name]["breakdown_seconds"]
            assert list(b) == list(BREAKDOWN_KEYS) + ["rest"]
            assert all(v >= -1e-3 for v in b.values()), (name, b)
            assert sum(b.values()) == pytest.approx(rows[name]["seconds"], abs=1e-3)
            assert b["prefill"] > 0 and b["target_forward"] > 0
        assert rows["target"]["breakdown_seconds"]["draft"] == 0.0
        assert rows["target"]["breakdown_seconds"]["drafter_context"] == 0.0
        assert rows["dspark"]["breakdown_seconds"]["draft"] > 0
        assert rows["target"]["tau"] == 1.0
        assert 1.0 <= rows["mtp1"]["tau"] <= 2.0
        assert 1.0 <= rows["dspark"]["tau"] <= GAMMA + 1
        assert "tau" not in rows["hf-generate"]

    greedy = {t["concurrency"]: t["rows"]["dspark"] for t in result["tables"]
              if t["temperature"] == 0}
    assert set(result["goals"]) == {"greedy_c1", "greedy_c2"}
    assert result["goals"]["greedy_c1"]["dspark_ratio"] == greedy[1]["ratio_vs_target"]
    assert result["goals"]["greedy_c1"]["met"] == (greedy[1]["ratio_vs_target"] >= 2.0)
    assert result["goals"]["greedy_c2"]["goal"] is None


def test_missing_rows_and_bad_flags(setup, tmp_path, capsys):
    target, _, evals = setup
    empty = tmp_path / "no_checkpoints"
    empty.mkdir()
    rc = call(["--checkpoints", str(empty), "--model-dir", str(target), "--eval-dir", str(evals),
               "--methods", "target,dspark,mtp1", "--limit", "1", "--max-tokens", "3",
               "--temperatures", "0", "--concurrency", "1", "--warmup-tokens", "1"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    rows = json.loads(captured.out.strip().splitlines()[-1])["tables"][0]["rows"]
    assert list(rows) == ["target", "mtp1", "dspark"]
    assert rows["dspark"]["status"] == rows["mtp1"]["status"] == "missing"
    assert rows["target"]["status"] == "ok" and rows["target"]["ratio_vs_target"] == 1.0
    assert "| DSpark (async_topk) | missing |" in captured.out

    for bad in (["--methods", "medusa"], ["--concurrency", "0"], ["--temperatures", "-1"]):
        assert call(["--model-dir", str(target), *bad]) == 2
    assert "unknown method 'medusa'" in capsys.readouterr().err
