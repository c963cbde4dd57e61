"""`dspark bench`'s results: per row and (temperature, concurrency), tokens/s per dataset and their
macro average, the ratio to the target-only row, tau, the time breakdown; as JSON and markdown."""

from __future__ import annotations

import math

from dspark.evaluation.speed.prepare import Setup
from dspark.evaluation.speed.rows import ROWS, RowKind
from dspark.evaluation.speed.waves import BREAKDOWN_KEYS, Tally

# Speed goals: DSpark over target-only, greedy, macro-average, by number of concurrent streams.
GOALS = {1: 2.0, 8: 1.5}
BREAKDOWN_LABELS = {"prefill": "prefill", "drafter_context": "drafter context", "draft": "draft",
                    "admission": "admission", "target_forward": "target forward",
                    "sampling_commit": "sampling + commit", "rest": "rest (Python)"}


def summarize(setup: Setup, rows: list[str], tallies: dict[str, dict[str, Tally]],
              temperature: float) -> dict[str, dict]:
    """The JSON of one (temperature, concurrency) table: per row, tokens/s per dataset, macro
    average, ratio to the target-only row, tau, time breakdown, greedy agreement with target."""
    out = {}
    base = tallies.get("target")
    base_macro = (sum(t.tokens_per_s for t in base.values()) / len(base)) if base else None
    for n in rows:
        if setup.status[n] != "ok":
            out[n] = {"status": setup.status[n], "note": setup.notes.get(n, "")}
            continue
        per = tallies[n]
        macro = sum(t.tokens_per_s for t in per.values()) / len(per)
        r = {"status": "ok", "note": setup.notes.get(n, ""),
             "datasets": {d: {"tokens": t.tokens, "seconds": round(t.seconds, 6),
                              "streams": t.streams, "tokens_per_s": round(t.tokens_per_s, 3),
                              "ratio_vs_target": (round(t.tokens_per_s / base[d].tokens_per_s, 4)
                                                  if base else None)}
                          for d, t in per.items()},
             "macro_tokens_per_s": round(macro, 3),
             "ratio_vs_target": round(macro / base_macro, 4) if base_macro else None,
             "tokens": sum(t.tokens for t in per.values()),
             "seconds": round(sum(t.seconds for t in per.values()), 6),
             "streams": sum(t.streams for t in per.values())}
        if ROWS[n].kind is RowKind.ENGINE:
            rounds = sum(t.rounds for t in per.values())
            accepted = sum(t.drafts_accepted for t in per.values())
            r["tau"] = round((accepted + rounds) / rounds, 4) if rounds else None
            breakdown = {k: sum(t.breakdown.get(k, 0.0) for t in per.values())
                         for k in BREAKDOWN_KEYS}
            breakdown["rest"] = r["seconds"] - sum(breakdown.values())
            r["breakdown_seconds"] = {k: round(v, 6) for k, v in breakdown.items()}
        if temperature == 0 and base:
            pairs = [(a, b) for d in per for a, b in zip(per[d].outputs, base[d].outputs)]
            r["greedy_same_as_target"] = (round(sum(a == b for a, b in pairs) / len(pairs), 4)
                                          if pairs else None)
        out[n] = r
    return out


def _num(x: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}f}{suffix}"


def format_table(summary: dict[str, dict], datasets: list[str], temperature: float,
                 concurrency: int, num_prompts: int, max_tokens: int) -> str:
    mode = "greedy" if temperature == 0 else f"temperature {temperature:g}"
    streams = ("1 stream (requests one after another)" if concurrency == 1
               else f"{concurrency} concurrent streams")
    lines = [f"**{mode}, {streams}: {num_prompts} prompt{'s' if num_prompts > 1 else ''} per "
             f"dataset, max {max_tokens} tokens; "
             f"output tokens/s**", "",
             "| Row | " + " | ".join(datasets)
             + " | macro | vs target | tau | same as target | note |",
             "|---|" + "---:|" * (len(datasets) + 4) + "---|"]
    for n, r in summary.items():
        label = ROWS[n].label
        if r["status"] != "ok":
            lines.append(f"| {label} | {r['status']} |" + " |" * (len(datasets) + 3)
                         + f" {r['note']} |")
            continue
        same = r.get("greedy_same_as_target")
        same = None if same is None else 100 * same
        lines.append(f"| {label} | " + " | ".join(_num(r["datasets"][d]["tokens_per_s"])
                                                  for d in datasets)
                     + f" | {_num(r['macro_tokens_per_s'])} | {_num(r['ratio_vs_target'], 2, 'x')}"
                     f" | {_num(r.get('tau'), 2)} | {_num(same, 0, '%')}"
                     f" | {r['note']} |")
    return "\n".join(lines)


def format_breakdown(summary: dict[str, dict], temperature: float, concurrency: int) -> str | None:
    rows = {n: r for n, r in summary.items() if "breakdown_seconds" in r}
    if not rows:
        return None
    keys = list(BREAKDOWN_KEYS) + ["rest"]
    mode = "greedy" if temperature == 0 else f"temperature {temperature:g}"
    streams = f"{concurrency} stream{'s' if concurrency > 1 else ''}"
    lines = [f"**Where the time goes ({mode}, {streams}): seconds (share of wall time)**", "",
             "| Row | wall s | " + " | ".join(BREAKDOWN_LABELS[k] for k in keys) + " |",
             "|---|---:|" + "---:|" * len(keys)]
    for n, r in rows.items():
        wall = r["seconds"]
        cells = [f"{r['breakdown_seconds'][k]:.2f} ({100 * r['breakdown_seconds'][k] / wall:.0f}%)"
                 if wall > 0 else "-" for k in keys]
        lines.append(f"| {ROWS[n].label} | {wall:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goals(tables: list[dict]) -> dict:
    """The speed goals (GOALS), where this run measured them (greedy, macro-average)."""
    out = {}
    for t in tables:
        rows = t["rows"]
        d = rows.get("dspark", {})
        if t["temperature"] != 0 or d.get("status") != "ok" or d.get("ratio_vs_target") is None:
            continue
        others = [r["macro_tokens_per_s"] for n, r in rows.items()
                  if n != "dspark" and r.get("status") == "ok"]
        goal = GOALS.get(t["concurrency"])
        out[f"greedy_c{t['concurrency']}"] = {
            "dspark_ratio": d["ratio_vs_target"], "goal": goal,
            "met": None if goal is None else d["ratio_vs_target"] >= goal,
            "ahead_of_every_row": all(d["macro_tokens_per_s"] > x for x in others)}
    return out
