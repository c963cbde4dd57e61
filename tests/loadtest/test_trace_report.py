"""loadtest/trace_report.py on a hand-made span file: each round's kind from its children, and
the time sums per kind."""

from __future__ import annotations

import json

import pytest

from loadtest.trace_report import classify_rounds, format_table, main, read_spans, round_kind

MS = 1_000_000


def span(name, span_id, start_ms, end_ms, parent=None, **attributes):
    return {"service": name.split(".")[0], "name": name, "trace_id": "t", "span_id": span_id,
            "parent_span_id": parent, "start_ns": start_ms * MS, "end_ns": end_ms * MS,
            "attributes": {f"dspark.{k}": v for k, v in attributes.items()}, "links": []}


SPANS = [
    # r1: a plain decoding round of 2 requests
    span("scheduler.round", "r1", 0, 60),
    span("verifier.verify", "v1", 5, 55, "r1", batch_tokens=2, num_accepted=[0, 0]),
    # r2: a probe (the drafter drafts, nothing verified) with a prompt chunk riding along
    span("scheduler.round", "r2", 60, 200),
    span("drafter.round", "d2", 62, 80, "r2", num_requests=1),
    span("verifier.verify", "v2", 85, 190, "r2", batch_tokens=2, prefill_tokens=40,
         num_accepted=[0, 0]),
    # r3: drafts verified (B = 5 > 2 requests)
    span("scheduler.round", "r3", 200, 290),
    span("drafter.round", "d3", 201, 221, "r3", num_requests=2),
    span("verifier.verify", "v3", 225, 285, "r3", batch_tokens=5, num_accepted=[1, 2]),
    # r4: a prompt with nothing running; and a drafter round that only released (no requests)
    span("scheduler.round", "r4", 290, 400),
    span("drafter.round", "d4", 291, 292, "r4", num_requests=0),
    span("verifier.verify", "v4", 295, 395, "r4", batch_tokens=0, prefill_tokens=100,
         num_accepted=[]),
    # r5: a separate prefill (prefill_chunk_tokens 0) then the decoding step, one plain round
    span("scheduler.round", "r5", 400, 500),
    span("verifier.prefill", "p5", 401, 440, "r5", num_requests=1),
    span("verifier.verify", "v5", 441, 495, "r5", batch_tokens=3, num_accepted=[0, 0, 0]),
    span("scheduler.request", "q", 0, 500),  # not a round
]


def test_round_kinds_and_time_sums():
    children = {r: [s for s in SPANS if s["parent_span_id"] == r] for r in ("r1", "r2", "r3", "r4", "r5")}
    assert round_kind(children["r1"]) == "decode"
    assert round_kind(children["r2"]) == "decode +prompt +drafted"
    assert round_kind(children["r3"]) == "decode +drafted +verified drafts"
    assert round_kind(children["r4"]) == "prompt only"
    assert round_kind(children["r5"]) == "decode +prompt"

    kinds = {k.kind: k for k in classify_rounds(SPANS)}
    assert set(kinds) == {"decode", "decode +prompt +drafted", "decode +drafted +verified drafts",
                          "prompt only", "decode +prompt"}
    probe = kinds["decode +prompt +drafted"]
    assert (probe.rounds, probe.seconds, probe.verifier_seconds, probe.drafter_seconds) == \
        pytest.approx((1, 0.140, 0.105, 0.018))
    assert probe.rest_seconds == pytest.approx(0.017) and probe.ms_per_round == pytest.approx(140)
    assert kinds["decode +prompt"].verifier_seconds == pytest.approx(0.039 + 0.054)
    assert kinds["prompt only"].drafter_seconds == pytest.approx(0.001)
    # the most time first; a window keeps the rounds that start inside it
    assert [k.kind for k in classify_rounds(SPANS)][0] == "decode +prompt +drafted"
    window = classify_rounds(SPANS, since_ns=60 * MS, until_ns=290 * MS)
    assert sorted(k.kind for k in window) == ["decode +drafted +verified drafts",
                                             "decode +prompt +drafted"]
    table = format_table(classify_rounds(SPANS))
    assert table.count("\n") == 6 and "| decode | 1 | 0.06 | 12.0% | 60.0 |" in table


def test_command_line(tmp_path, capsys):
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in SPANS))
    assert read_spans(path) == SPANS
    assert main([str(path), "--until-ns", str(60 * MS)]) == 0
    assert "| decode | 1 |" in capsys.readouterr().out
    assert main([str(path), "--since-ns", str(10_000 * MS)]) == 1
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
