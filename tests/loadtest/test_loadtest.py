"""The load test against a real stack on loopback (tiny random models, real service processes).

1. The locustfile, headless for a few seconds with one REST and one gRPC user: Locust's CSV has
   the custom ttft / tokens_per_s / sla entries with sane values, and an SLA no server can meet
   (set through its environment variable) marks every response as a miss.
2. `dspark loadtest` on a tiny ladder (2 policies x 2 levels x 2 s): one CSV row per
   (policy, level), the PNGs, the SLA table, and verification lengths that tell the policies
   apart (0 without speculation).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.paths import REPO_ROOT
from loadtest.stack import start_stack, tiny_models

MAX_TOKENS = 24
IMPOSSIBLE_SLA = 1e6  # tokens/s per user


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("loadtest_models"))


@pytest.fixture(scope="module")
def stack(models, tmp_path_factory):
    running = start_stack(models, "async_topk", tmp_path_factory.mktemp("loadtest_logs"))
    try:
        running.warm_up(models.model_name)
        yield running
    finally:
        running.stop()


def read_stats(path: Path) -> dict[tuple[str, str], dict]:
    with path.open() as f:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}


def test_locustfile_reports_ttft_speed_and_sla(stack, models, tmp_path):
    prefix, summary_path = tmp_path / "run", tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "locust", "-f", str(REPO_ROOT / "loadtest" / "locustfile.py"),
           "--headless", "--only-summary", "-u", "2", "-r", "2", "-t", "4s",
           "--exit-code-on-error", "0", "--host", stack.rest_url,
           "--grpc-target", stack.grpc_target, "--model", models.model_name,
           "--max-tokens", str(MAX_TOKENS), "--prompt-chars", "200", "--csv", str(prefix),
           "--dspark-summary", str(summary_path), "ChatStreamUser", "GrpcGenerateUser"]
    env = child_env(DSPARK_SLA_TOKENS_PER_S=str(IMPOSSIBLE_SLA))  # the SLA via its env var
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stats = read_stats(Path(f"{prefix}_stats.csv"))

    for request in [("POST", "/v1/chat/completions (SSE)"), ("gRPC", "Generation/Generate")]:
        row = stats[request]
        assert int(row["Request Count"]) >= 1 and int(row["Failure Count"]) == 0, row
        assert 0 < float(row["Average Content Size"]) <= MAX_TOKENS  # completion tokens
    for user in ("rest", "grpc"):
        ttft, speed = stats[("ttft", user)], stats[("tokens_per_s", user)]
        sla = stats[("sla", f"{user} >= {IMPOSSIBLE_SLA:g} tok/s")]
        assert int(ttft["Request Count"]) >= 1
        assert 0 < float(ttft["Min Response Time"]) <= float(ttft["Max Response Time"]) < 10_000
        assert 0 < float(speed["Average Response Time"]) < IMPOSSIBLE_SLA
        assert int(speed["Failure Count"]) == 0
        assert int(sla["Failure Count"]) == int(sla["Request Count"]) >= 1  # every one missed

    summary = json.loads(summary_path.read_text())
    assert summary["sla_tokens_per_s"] == IMPOSSIBLE_SLA and summary["errors"] == 0
    responses = summary["responses"]
    assert {r["user_class"] for r in responses} == {"rest", "grpc"}
    assert all(r["sla_met"] is False for r in responses if r["tokens_per_s"] is not None)
    assert all(0 < r["tokens"] <= MAX_TOKENS and r["ttft_ms"] > 0 for r in responses)
    assert summary["tokens_received"] >= sum(r["tokens"] for r in responses)
    assert 0 < summary["aggregate_tokens_per_s"] < 100_000


def test_bad_sla_is_refused(stack, models):
    cmd = [sys.executable, "-m", "locust", "-f", str(REPO_ROOT / "loadtest" / "locustfile.py"),
           "--headless", "-u", "1", "-t", "1s", "--host", stack.rest_url,
           "--sla-tokens-per-s", "0", "ChatStreamUser"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "--sla-tokens-per-s must be > 0" in done.stderr


def test_sweep_writes_one_row_per_policy_and_level(tmp_path):
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "dspark.cli", "loadtest", "--tiny", "--policies",
           "none,async_topk", "--users", "1,2", "--duration-s", "6",
           "--max-tokens", str(MAX_TOKENS), "--sla", "1,1000000", "--out", str(out), "--trace"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]

    with (out / "frontier.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["policy"], int(r["users"])) for r in rows] == [
        ("none", 1), ("none", 2), ("async_topk", 1), ("async_topk", 2)]
    for r in rows:
        assert int(r["responses"]) >= 1 and int(r["errors"]) == 0, r
        assert float(r["aggregate_tokens_per_s"]) > 0 and float(r["per_user_tokens_per_s"]) > 0
        assert float(r["sla_1_attainment"]) == 1.0 and float(r["sla_1e+06_attainment"]) == 0.0
    assert all(float(r["mean_verification_length"]) == 0 for r in rows if r["policy"] == "none")
    assert any(float(r["mean_verification_length"]) > 0 for r in rows
               if r["policy"] == "async_topk")
    for r in rows:  # the engine's time by stage, from the scheduler's round_seconds_total
        shares = {s: float(r[f"{s}_share"])
                  for s in ("prefill", "draft", "admission", "verify", "verify_call", "other")}
        assert sum(shares.values()) == pytest.approx(1.0, abs=1e-3) and shares["verify"] > 0, r
        assert (shares["draft"] == 0) == (r["policy"] == "none"), r

    with (out / "sla_throughput.csv").open() as f:
        holds = {(r["policy"], float(r["sla_tokens_per_s"])): r for r in csv.DictReader(f)}
    assert set(holds) == {(p, s) for p in ("none", "async_topk") for s in (1.0, 1e6)}
    for policy in ("none", "async_topk"):
        best = max(float(r["aggregate_tokens_per_s"]) for r in rows if r["policy"] == policy)
        held = float(holds[(policy, 1.0)]["aggregate_tokens_per_s"])
        assert held == pytest.approx(best, abs=1e-3)
        assert float(holds[(policy, 1e6)]["aggregate_tokens_per_s"]) == 0
        assert holds[(policy, 1e6)]["users"] == ""
    with (out / "matched_throughput.csv").open() as f:
        matched = list(csv.DictReader(f))
    assert {(m["policy"], m["baseline"]) for m in matched} == {("none", "async_topk"),
                                                               ("async_topk", "none")}
    assert len(matched) == 4
    for png in ("frontier.png", "verification_length.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # --trace: every service's spans, and the rounds of each level by kind
    assert (out / "traces" / "none.jsonl").stat().st_size > 0
    services = {json.loads(line)["service"]
                for line in (out / "traces" / "async_topk.jsonl").read_text().splitlines()}
    assert services == {"scheduler", "verifier", "drafter"}
    with (out / "round_kinds.csv").open() as f:
        kinds = list(csv.DictReader(f))
    for policy, users in [("none", 1), ("none", 2), ("async_topk", 1), ("async_topk", 2)]:
        level = [k for k in kinds if (k["policy"], int(k["users"])) == (policy, users)]
        assert level and sum(float(k["share"]) for k in level) == pytest.approx(1.0, abs=1e-3)
        assert all(int(k["rounds"]) > 0 for k in level)
        assert any("decode" in k["kind"] for k in level)
        drafted = any("drafted" in k["kind"] for k in level)
        assert drafted == (policy == "async_topk"), level
    assert "### async_topk, 2 users" in (out / "round_kinds.md").read_text()


def test_sweep_dtype_and_weights_reach_the_real_models_and_dtype_is_refused_for_tiny(tmp_path):
    import argparse

    from loadtest.sweep import choose_models

    args = argparse.Namespace(tiny=False, model_dir="", drafter_dir="", cost_table="",
                              dtype="bfloat16", weights="dense", verifier_threads=0,
                              drafter_threads=0)
    models = choose_models(args, tmp_path)
    assert (models.dtype, models.weights) == ("bfloat16", "dense")
    cmd = [sys.executable, "-m", "dspark.cli", "loadtest", "--tiny", "--dtype", "bfloat16",
           "--out", str(tmp_path / "sweep")]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--dtype applies to the real models" in done.stderr


def test_sweep_threads_reach_the_models_and_default_to_the_core_split(tmp_path):
    import argparse

    from loadtest.sweep import choose_models

    args = argparse.Namespace(tiny=False, model_dir="", drafter_dir="", cost_table="",
                              dtype="float32", weights="auto", verifier_threads=0,
                              drafter_threads=0)
    real = choose_models(args, tmp_path)
    assert (real.verifier_threads, real.drafter_threads) == (0, 0)  # 0: split_cores decides
    args.verifier_threads, args.drafter_threads = 3, 2
    real = choose_models(args, tmp_path)
    assert (real.verifier_threads, real.drafter_threads) == (3, 2)
    args.tiny, args.prompt_chars, args.verifier_threads, args.drafter_threads = True, 0, 0, 0
    tiny = choose_models(args, tmp_path)
    assert (tiny.verifier_threads, tiny.drafter_threads) == (1, 1)


def test_sweep_refuses_missing_eval_prompts_before_starting_anything(tmp_path):
    cmd = [sys.executable, "-m", "dspark.cli", "loadtest", "--tiny", "--eval-sets", "no_such_set",
           "--out", str(tmp_path / "sweep")]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "no_such_set.jsonl" in done.stderr, done.stderr
    assert not (tmp_path / "sweep").exists()


def test_sweep_drives_a_running_target_without_starting_a_stack(stack, models, tmp_path):
    """`--target URL` (a Ray Serve ingress in production; here the tiny stack's REST URL): the
    levels run against it, labelled --target-label, with no stack of the sweep's own."""
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "dspark.cli", "loadtest", "--target", stack.rest_url,
           "--target-label", "cluster", "--model-name", models.model_name, "--users", "2",
           "--duration-s", "4", "--max-tokens", str(MAX_TOKENS), "--prompt-chars", "200",
           "--sla", "1", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "starting the stack" not in done.stderr and not (out / "logs").exists()
    with (out / "frontier.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["policy"], int(r["users"])) for r in rows] == [("cluster", 2)]
    assert int(rows[0]["responses"]) >= 1 and int(rows[0]["errors"]) == 0
    assert float(rows[0]["mean_verification_length"]) == 0  # not read from a target

    refused = subprocess.run([*cmd[:4], "--target", "127.0.0.1:1", "--out", str(tmp_path / "x")],
                             cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2 and "--target needs an http(s):// URL" in refused.stderr
