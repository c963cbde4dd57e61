"""`dspark loadtest`: the SLA sweep.

For each admission policy (default: none, fixed:1, fixed:7, sync_greedy, async_topk) a fresh
stack is started (loadtest/stack.py), warmed up with one request, and driven by Locust (headless,
a subprocess running loadtest/locustfile.py, users back to back so concurrency = users) at each
level of a ladder of concurrent users. Per level it reads the locustfile's run summary (per-user
speed, TTFT, tokens received) and the difference of the scheduler's /metrics counters (mean
verification length). It writes to --out:

- `frontier.csv`: one row per (policy, users) (loadtest/results.py says what each column means)
- `frontier.png`: aggregate tokens/s against per-user tokens/s, one curve per policy
- `verification_length.png`: mean drafts verified per request per round against users
- `sla_throughput.csv`: the aggregate throughput each policy holds at each SLA level
- `matched_throughput.csv`: each policy's per-user speed at each other policy's aggregate
  throughputs (interpolated along its frontier), and the ratio (loadtest/results.py)
- `locust/`: Locust's own CSVs and logs per level; `logs/`: the services' logs per policy
- with `--trace`: `traces/<policy>.jsonl` (every service's spans) and `round_kinds.csv` / `.md`:
  per level, the scheduler's rounds grouped by what they did and where their time went
  (loadtest/trace_report.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# `python loadtest/sweep.py`: the checkout goes on sys.path before dspark (and so
# dspark.paths.REPO_ROOT) can be imported, hence its own path here.
if (_checkout := str(Path(__file__).resolve().parents[1])) not in sys.path:
    sys.path.insert(0, _checkout)

from dspark.paths import REPO_ROOT  # noqa: E402
from loadtest.prometheus import SpeculationDelta, counter_values, stage_seconds  # noqa: E402
from loadtest.results import LevelResult, matched_speeds, sla_table, write_csv  # noqa: E402

POLICIES = "none,fixed:1,fixed:7,sync_greedy,async_topk"
USER_CLASSES = {"rest": "ChatStreamUser", "grpc": "GrpcGenerateUser"}


def _numbers(kind):
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
        return values
    return parse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", default=POLICIES, help="comma-separated admission policies")
    parser.add_argument("--users", type=_numbers(int), default=[1, 2, 4, 8, 16],
                        help="ladder of concurrent users, e.g. 1,2,4,8")
    parser.add_argument("--duration-s", type=float, default=60.0, help="seconds per level")
    parser.add_argument("--user-class", choices=sorted(USER_CLASSES), default="rest",
                        help="REST SSE chat streams or gRPC Generate")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompt-chars", type=int, default=0,
                        help="cut prompts to this many characters (0: whole; --tiny: 200)")
    parser.add_argument("--eval-sets", default="", help="comma-separated (default: all)")
    parser.add_argument("--sla", type=_numbers(float), default=[5.0, 10.0, 20.0],
                        help="SLA levels, per-user tokens/s")
    parser.add_argument("--sla-attainment", type=float, default=0.9,
                        help="share of responses that must meet an SLA for a level to hold it")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny random target and untrained drafter (smoke runs, tests)")
    parser.add_argument("--model-dir", default="", help="target (default: prepared SmolLM2)")
    parser.add_argument("--drafter-dir", default="", help="drafter (default: the shipped one)")
    parser.add_argument("--cost-table", default="", help="SPS(B) JSON for the verifier")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the services' model dtype (not with --tiny); bfloat16 is the faster "
                             "one on a CPU with AVX512-BF16")
    parser.add_argument("--weights", default="auto", choices=["auto", "q4", "dense"],
                        help="the verifier's target linears (not with --tiny): the GGUF's own "
                             "blocks (q4), dense tensors, or auto (q4 where the GGUF and the CPU "
                             "kernel are)")
    parser.add_argument("--verifier-threads", type=int, default=0,
                        help="torch threads of the verifier (0: as dspark up splits the cores)")
    parser.add_argument("--drafter-threads", type=int, default=0,
                        help="torch threads of the drafter (0: as dspark up splits the cores)")
    parser.add_argument("--extra-scheduler-args", default="", help="space-separated")
    parser.add_argument("--out", default="", help="output folder (default: runs/loadtest-<time>)")
    parser.add_argument("--target", default="",
                        help="URL of an ingress already serving (a Ray Serve cluster: "
                             "deploy/ray_serve.py, the RayService's serve service): no stack is "
                             "started, the levels run against it with REST users; --policies "
                             "and the model flags do not apply (it serves what it was deployed "
                             "with), and its verification length is not read (the router "
                             "answers /metrics from one cell)")
    parser.add_argument("--target-label", default="target",
                        help="the policy column of the target's rows")
    parser.add_argument("--model-name", default="dspark",
                        help="the model name the --target serves (its --model-name)")
    parser.add_argument("--trace", action="store_true",
                        help="trace every service to traces/<policy>.jsonl and write the round "
                             "breakdown per level (round_kinds.csv / .md)")


def run_locust(stack, args: argparse.Namespace, model_name: str, users: int, prefix: Path
               ) -> dict:
    """One headless Locust run at `users` concurrent users; returns the locustfile's summary."""
    summary_path = prefix.with_name(prefix.name + "_summary.json")
    cmd = [sys.executable, "-m", "locust", "-f", str(REPO_ROOT / "loadtest" / "locustfile.py"),
           "--headless", "--only-summary", "--loglevel", "WARNING", "-u", str(users),
           "-r", str(users), "-t", f"{args.duration_s:g}s", "--stop-timeout", "0",
           "--exit-code-on-error", "0", "--host", stack.rest_url,
           "--grpc-target", stack.grpc_target, "--model", model_name,
           "--max-tokens", str(args.max_tokens), "--temperature", str(args.temperature),
           "--prompt-chars", str(args.prompt_chars), "--eval-sets", args.eval_sets,
           "--sla-tokens-per-s", str(min(args.sla)), "--csv", str(prefix),
           "--dspark-summary", str(summary_path), USER_CLASSES[args.user_class]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(prefix.with_name(prefix.name + "_locust.log"), "wb") as log:
        subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                       timeout=args.duration_s + 120, check=True)
    if not summary_path.is_file():
        raise RuntimeError(f"locust wrote no summary; see {prefix}_locust.log")
    return json.loads(summary_path.read_text())


def sweep_policy(policy: str, models, args: argparse.Namespace, out: Path
                 ) -> tuple[list[LevelResult], list[dict]]:
    """The policy's levels, and (with --trace) its round breakdown rows per level."""
    from loadtest.stack import RemoteTarget, start_stack

    safe = policy.replace(":", "-")
    trace_file = out / "traces" / f"{safe}.jsonl" if args.trace else None
    if args.target:
        print(f"loadtest: driving {args.target}", file=sys.stderr, flush=True)
        stack = RemoteTarget(args.target)
    else:
        print(f"loadtest: starting the stack for policy {policy}", file=sys.stderr, flush=True)
        if trace_file is not None:
            trace_file.parent.mkdir(parents=True, exist_ok=True)
            trace_file.unlink(missing_ok=True)
        stack = start_stack(models, policy, out / "logs" / safe,
                            tuple(args.extra_scheduler_args.split()), trace_file)
    results, windows = [], []
    try:
        stack.warm_up(models.model_name)
        for users in args.users:
            started_ns = time.time_ns()
            text = stack.metrics_text()
            before, stages_before = counter_values(text), stage_seconds(text)
            summary = run_locust(stack, args, models.model_name, users,
                                 out / "locust" / f"{safe}_u{users}")
            text = stack.metrics_text()
            delta = SpeculationDelta.between(before, counter_values(text), stages_before,
                                             stage_seconds(text))
            result = LevelResult.from_run(policy, users, summary, delta, args.sla)
            if result.responses == 0:
                raise RuntimeError(
                    f"policy {policy}, {users} users: no response completed in "
                    f"{args.duration_s:g} s ({result.errors} errors, first: "
                    f"{summary['first_errors'][:1]}); raise --duration-s or lower --max-tokens "
                    f"(Locust log: {out / 'locust' / f'{safe}_u{users}_locust.log'})")
            results.append(result)
            windows.append((users, started_ns, time.time_ns()))
            print(f"loadtest: {policy:>12} users={users:<3} per-user "
                  f"{result.per_user_tokens_per_s:7.1f} tok/s  aggregate "
                  f"{result.aggregate_tokens_per_s:7.1f} tok/s  verification length "
                  f"{result.mean_verification_length:.2f}", file=sys.stderr, flush=True)
    finally:
        stack.stop()  # (the services flush their spans as they exit)
    return results, [] if trace_file is None else round_kind_rows(policy, trace_file, windows)


def round_kind_rows(policy: str, trace_file: Path, windows: list[tuple[int, int, int]]
                    ) -> list[dict]:
    """Rows of round_kinds.csv: one per (level, round kind)."""
    from loadtest.trace_report import classify_rounds, read_spans

    spans = read_spans(trace_file)
    rows = []
    for users, since_ns, until_ns in windows:
        kinds = classify_rounds(spans, since_ns, until_ns)
        total = sum(k.seconds for k in kinds) or 1.0
        rows += [{"policy": policy, "users": users, "kind": k.kind, "rounds": k.rounds,
                  "seconds": round(k.seconds, 4), "share": round(k.seconds / total, 4),
                  "ms_per_round": round(k.ms_per_round, 2),
                  "verifier_seconds": round(k.verifier_seconds, 4),
                  "drafter_seconds": round(k.drafter_seconds, 4),
                  "rest_seconds": round(k.rest_seconds, 4)} for k in kinds]
    return rows


def choose_models(args: argparse.Namespace, out: Path):
    from loadtest.stack import real_models, tiny_models

    if args.tiny:
        if args.prompt_chars == 0:
            args.prompt_chars = 200  # the tiny target's context is short
        models = tiny_models(out / "tiny_models")
    else:
        models = real_models(args.model_dir, args.drafter_dir, args.cost_table, args.dtype,
                             args.weights)
    asked = {k: v for k, v in (("verifier_threads", args.verifier_threads),
                               ("drafter_threads", args.drafter_threads)) if v}
    return dataclasses.replace(models, **asked)


def target_models(args: argparse.Namespace):
    """What the Locust users need to know of a --target: the model name it serves."""
    from loadtest.stack import ModelChoice

    return ModelChoice("", "", "", args.model_name)


def write_outputs(results: list[LevelResult], args: argparse.Namespace, out: Path) -> None:
    from loadtest.plots import plot_frontier, plot_verification_length

    write_csv(out / "frontier.csv", [r.row() for r in results])
    holds = sla_table(results, args.sla, args.sla_attainment)
    write_csv(out / "sla_throughput.csv", [
        {"policy": h.policy, "sla_tokens_per_s": h.sla_tokens_per_s,
         "attainment": h.attainment, "aggregate_tokens_per_s": round(h.aggregate_tokens_per_s, 3),
         "users": "" if h.users is None else h.users} for h in holds])
    matched = matched_speeds(results)
    if matched:  # (one policy alone has nothing to match)
        write_csv(out / "matched_throughput.csv", [m.row() for m in matched])
    plot_frontier(results, out / "frontier.png")
    plot_verification_length(results, out / "verification_length.png")


def write_round_kinds(rows: list[dict], out: Path) -> None:
    """round_kinds.csv, and round_kinds.md: one markdown table per (policy, users)."""
    from loadtest.trace_report import RoundKind, format_table

    write_csv(out / "round_kinds.csv", rows)
    sections = []
    for key in dict.fromkeys((r["policy"], r["users"]) for r in rows):
        kinds = [RoundKind(r["kind"], r["rounds"], r["seconds"], r["verifier_seconds"],
                           r["drafter_seconds"]) for r in rows if (r["policy"], r["users"]) == key]
        sections.append(f"### {key[0]}, {key[1]} users\n\n{format_table(kinds)}\n")
    (out / "round_kinds.md").write_text("\n".join(sections))


def run(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or args.duration_s <= 0 or args.max_tokens < 1 \
            or not 0 < args.sla_attainment <= 1:
        print("loadtest: need policies, --duration-s > 0, --max-tokens >= 1 and "
              "0 < --sla-attainment <= 1", file=sys.stderr)
        return 2
    if args.tiny and args.dtype != "float32":
        print("loadtest: --dtype applies to the real models; the --tiny ones are float32",
              file=sys.stderr)
        return 2
    if args.target:
        if not args.target.startswith(("http://", "https://")) or args.trace \
                or args.user_class != "rest":
            print("loadtest: --target needs an http(s):// URL and REST users, without --trace "
                  "(the target's services trace where they run)", file=sys.stderr)
            return 2
        policies = [args.target_label]
    from dspark.admission import AdmissionPolicy

    for p in policies if not args.target else []:
        try:
            AdmissionPolicy.parse(p)
        except ValueError as e:
            print(f"loadtest: bad policy {p!r}: {e}", file=sys.stderr)
            return 2
    from loadtest.prompts import DEFAULT_EVAL_DIR, load_first_turns

    # The Locust users read these in their on_start; a missing set would only show there, as a
    # level where no response completed.
    eval_dir = Path(os.environ.get("DSPARK_EVAL_DIR", DEFAULT_EVAL_DIR))
    sets = tuple(s.strip() for s in args.eval_sets.split(",") if s.strip())
    try:
        load_first_turns(eval_dir, sets, args.prompt_chars)
    except FileNotFoundError as e:
        print(f"loadtest: {e} (--eval-sets, or DSPARK_EVAL_DIR for another folder)",
              file=sys.stderr)
        return 2
    out = Path(args.out or REPO_ROOT / "runs" / time.strftime("loadtest-%Y%m%d-%H%M%S"))
    (out / "locust").mkdir(parents=True, exist_ok=True)
    models = choose_models(args, out) if not args.target else target_models(args)
    results, kind_rows = [], []
    try:
        for policy in policies:
            levels, rows = sweep_policy(policy, models, args, out)
            results += levels
            kind_rows += rows
    except (RuntimeError, TimeoutError, subprocess.SubprocessError) as e:
        print(f"loadtest: {e}", file=sys.stderr)
        return 1
    write_outputs(results, args, out)
    if args.trace:
        write_round_kinds(kind_rows, out)
    print(f"loadtest: wrote {out}/frontier.csv, frontier.png, verification_length.png, "
          f"sla_throughput.csv, matched_throughput.csv", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.sweep",
                                     description=__doc__.split("\n")[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
