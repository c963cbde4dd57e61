"""Where a service stack's round time goes, from its OpenTelemetry span file.

With `--trace-exporter file --trace-file F` on all three services (`dspark loadtest --trace`
does this), every scheduler round is a `scheduler.round` span, and the verifier's and the
drafter's work for it are its child spans (`verifier.verify`, `verifier.prefill`,
`drafter.round`; the trace context crosses the wire). This groups the rounds by what they did:

| kind | the round ... |
|---|---|
| `decode` | verified one token per request, no drafting |
| `+prompt` | also read prompt tokens (chunked prefill, or a separate prefill) |
| `+drafted` | asked the drafter for blocks |
| `+verified drafts` | sent drafts to the target (B > number of requests) |
| `prompt only` | read prompt tokens with nothing to decode |

and reports per kind the rounds, their wall time (the scheduler's span), the time inside the
verifier's and the drafter's spans, and the rest (the scheduler's own work and the wire).

    python -m loadtest.trace_report F [--since-ns N] [--until-ns N]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

VERIFIER_SPANS = ("verifier.verify", "verifier.prefill")
DRAFTER_SPAN = "drafter.round"


@dataclass
class RoundKind:
    """The rounds of one kind and where their time went (seconds)."""

    kind: str
    rounds: int = 0
    seconds: float = 0.0
    verifier_seconds: float = 0.0
    drafter_seconds: float = 0.0

    @property
    def rest_seconds(self) -> float:
        return self.seconds - self.verifier_seconds - self.drafter_seconds

    @property
    def ms_per_round(self) -> float:
        return 1e3 * self.seconds / self.rounds if self.rounds else 0.0


def read_spans(path: str | Path) -> list[dict]:
    """The span file: one JSON object per line (dspark.serving.tracing.FileSpanExporter)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _seconds(span: dict) -> float:
    return (span["end_ns"] - span["start_ns"]) / 1e9


def round_kind(children: list[dict]) -> str:
    """The kind of a round from its child spans (see the module docstring)."""
    verifies = [s for s in children if s["name"] == "verifier.verify"]
    prompt = any(s["name"] == "verifier.prefill" for s in children) or any(
        s["attributes"].get("dspark.prefill_tokens", 0) > 0 for s in verifies)
    decoded = sum(len(s["attributes"].get("dspark.num_accepted", ())) for s in verifies)
    if prompt and not decoded:
        return "prompt only"
    drafted = any(s["name"] == DRAFTER_SPAN and s["attributes"].get("dspark.num_requests", 0) > 0
                  for s in children)
    verified = sum(s["attributes"].get("dspark.batch_tokens", 0) for s in verifies) > decoded
    parts = ["decode"] + [name for name, on in (("prompt", prompt), ("drafted", drafted),
                                                ("verified drafts", verified)) if on]
    return " +".join(parts)


def classify_rounds(spans: list[dict], since_ns: int | None = None,
                    until_ns: int | None = None) -> list[RoundKind]:
    """Rounds that started in [since_ns, until_ns), grouped by kind, the most time first."""
    children = defaultdict(list)
    for s in spans:
        if s["name"] in (*VERIFIER_SPANS, DRAFTER_SPAN) and s.get("parent_span_id"):
            children[s["parent_span_id"]].append(s)
    kinds: dict[str, RoundKind] = {}
    for r in spans:
        if r["name"] != "scheduler.round":
            continue
        if (since_ns is not None and r["start_ns"] < since_ns) or (
                until_ns is not None and r["start_ns"] >= until_ns):
            continue
        mine = children.get(r["span_id"], [])
        name = round_kind(mine)
        kind = kinds.setdefault(name, RoundKind(name))
        kind.rounds += 1
        kind.seconds += _seconds(r)
        kind.verifier_seconds += sum(_seconds(s) for s in mine if s["name"] in VERIFIER_SPANS)
        kind.drafter_seconds += sum(_seconds(s) for s in mine if s["name"] == DRAFTER_SPAN)
    return sorted(kinds.values(), key=lambda k: -k.seconds)


def format_table(kinds: list[RoundKind]) -> str:
    total = sum(k.seconds for k in kinds) or 1.0
    lines = ["| round kind | rounds | seconds | share | ms / round | verifier s | drafter s | rest s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for k in kinds:
        lines.append(f"| {k.kind} | {k.rounds} | {k.seconds:.2f} | {k.seconds / total:.1%} | "
                     f"{k.ms_per_round:.1f} | {k.verifier_seconds:.2f} | {k.drafter_seconds:.2f} | "
                     f"{k.rest_seconds:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_file")
    parser.add_argument("--since-ns", type=int, default=None, help="rounds starting at or after")
    parser.add_argument("--until-ns", type=int, default=None, help="rounds starting before")
    args = parser.parse_args(argv)
    try:
        spans = read_spans(args.trace_file)
    except (OSError, json.JSONDecodeError, KeyError) as e:
        print(f"trace_report: cannot read {args.trace_file}: {e}", file=sys.stderr)
        return 2
    kinds = classify_rounds(spans, args.since_ns, args.until_ns)
    if not kinds:
        print("trace_report: no scheduler.round spans in the window", file=sys.stderr)
        return 1
    print(format_table(kinds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
