"""Training-data generation (dspark.training.data) on a tiny random target."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from dspark.models.runner import RunnerConfig, TargetRunner, generate_greedy
from dspark.sampling import SamplingParams
from dspark.training.data import (
    MATH_SUFFIX,
    DataGenConfig,
    generate_answers,
    generate_answers_transformers,
    read_records,
    repair_data_file,
    select_prompts,
    split_of,
    summarize,
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    folder = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_runner(tiny_folder):
    return TargetRunner(tiny_folder, RunnerConfig(kv_cache_tokens=4096))


@pytest.fixture(scope="module")
def tiny_hf_model(tiny_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()


def test_continuous_batching_answers_equal_plain_greedy(tiny_runner):
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    expected = generate_greedy(tiny_runner, prompts, max_new_tokens=12)
    got = {key: (answer, eos) for key, answer, eos in generate_answers(
        tiny_runner, [(f"p{i}", p) for i, p in enumerate(prompts)], max_new_tokens=12,
        batch_size=2, sampling=SamplingParams(temperature=0), eos_token_ids=set())}
    assert [got[f"p{i}"][0] for i in range(len(prompts))] == expected
    assert tiny_runner.num_free_blocks == tiny_runner.cache.manager.num_blocks  # all freed


def test_eos_ends_an_answer_and_is_kept(tiny_runner):
    full = generate_greedy(tiny_runner, [[1, 2, 3]], max_new_tokens=12)[0]
    eos = full[4]
    ((_, answer, finished),) = list(generate_answers(
        tiny_runner, [("a", [1, 2, 3])], max_new_tokens=12, batch_size=4,
        sampling=SamplingParams(temperature=0), eos_token_ids={eos}))
    assert answer == full[:full.index(eos) + 1] and finished


PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


def test_transformers_engine_greedy_equals_our_runner(tiny_runner, tiny_hf_model):
    """Left-padded batches of different prompt lengths give each prompt its own greedy answer."""
    expected = generate_greedy(tiny_runner, PROMPTS, max_new_tokens=12)
    got = {key: (answer, eos) for key, answer, eos in generate_answers_transformers(
        tiny_hf_model, [(f"p{i}", p) for i, p in enumerate(PROMPTS)], max_new_tokens=12,
        batch_size=3, sampling=SamplingParams(temperature=0), eos_token_ids={49}, pad_token_id=0)}
    assert set(got) == {f"p{i}" for i in range(len(PROMPTS))}
    for i, answer in enumerate(expected):
        cut = answer[:answer.index(49) + 1] if 49 in answer else answer
        assert got[f"p{i}"] == (cut, 49 in answer)


def test_transformers_engine_cuts_at_eos_and_samples_reproducibly(tiny_runner, tiny_hf_model):
    full = generate_greedy(tiny_runner, [[1, 2, 3]], max_new_tokens=12)[0]
    eos = full[4]
    ((_, answer, finished),) = list(generate_answers_transformers(
        tiny_hf_model, [("a", [1, 2, 3])], max_new_tokens=12, batch_size=4,
        sampling=SamplingParams(temperature=0), eos_token_ids={eos}, pad_token_id=0))
    assert answer == full[:full.index(eos) + 1] and finished
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9)
    runs = [list(generate_answers_transformers(
        tiny_hf_model, [(f"p{i}", p) for i, p in enumerate(PROMPTS)], max_new_tokens=8,
        batch_size=2, sampling=params, eos_token_ids=set(), pad_token_id=0, seed=s))
        for s in (3, 3, 4)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert all(len(answer) == 8 and not eos for _, answer, eos in runs[0])


def test_a_spent_time_budget_starts_no_new_work(tiny_runner, tiny_hf_model):
    prompts = [(f"p{i}", p) for i, p in enumerate(PROMPTS)]
    greedy = SamplingParams(temperature=0)
    assert list(generate_answers_transformers(
        tiny_hf_model, prompts, max_new_tokens=4, batch_size=2, sampling=greedy,
        eos_token_ids=set(), pad_token_id=0, deadline=0.0)) == []
    assert list(generate_answers(tiny_runner, prompts, max_new_tokens=4, batch_size=2,
                                 sampling=greedy, eos_token_ids=set(), deadline=0.0)) == []


def write_prompts(folder, source, domain, n):
    with open(folder / f"{domain}_{source}.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"{source}-{i}", "domain": domain, "source": source,
                                "prompt": f"question {i}\u2028line two"}) + "\n")


def test_prompt_selection_is_seeded_styled_and_mixed(tmp_path):
    write_prompts(tmp_path, "gsm8k", "math", 200)
    write_prompts(tmp_path, "nq_open", "chat", 200)
    write_prompts(tmp_path, "unknown_source", "chat", 50)  # no weight: never chosen
    a = select_prompts(tmp_path, 60, seed=1)
    assert [p.id for p in a] == [p.id for p in select_prompts(tmp_path, 60, seed=1)]
    assert [p.id for p in a] != [p.id for p in select_prompts(tmp_path, 60, seed=2)]
    sources = {p.source for p in a}
    assert sources == {"gsm8k", "nq_open"}
    # gsm8k weighs 0.20 and nq_open 0.12 in SOURCE_WEIGHTS.
    assert sum(p.source == "gsm8k" for p in a) == round(60 * 0.20 / 0.32)
    assert all(p.text.endswith(MATH_SUFFIX) for p in a if p.source == "gsm8k")
    assert all("\u2028" in p.text for p in a)  # a line separator inside a prompt survives


def test_prompt_selection_of_some_sources_only(tmp_path):
    write_prompts(tmp_path, "gsm8k", "math", 200)
    write_prompts(tmp_path, "nq_open", "chat", 200)
    write_prompts(tmp_path, "gpteacher_roleplay", "chat", 30)
    everything = select_prompts(tmp_path, 100, seed=3)
    chat = select_prompts(tmp_path, 100, seed=3, sources=("gpteacher_roleplay", "nq_open"))
    assert {p.source for p in chat} == {"gpteacher_roleplay", "nq_open"}
    # the weights renormalised over the two (0.12 each): 50 each, and roleplay gives its 30
    assert sum(p.source == "gpteacher_roleplay" for p in chat) == 30
    assert sum(p.source == "nq_open" for p in chat) == 50
    # a seed orders each source the same whether or not other sources are chosen
    # (27 nq_open prompts of 100 among three sources, 50 among two: the same first 27)
    nq_everything = {p.id for p in everything if p.source == "nq_open"}
    assert len(nq_everything) == 27 and nq_everything < {p.id for p in chat if p.source == "nq_open"}
    with pytest.raises(ValueError, match="sources"):
        DataGenConfig(model_dir=tmp_path, train_dir=tmp_path, out=tmp_path / "o.jsonl",
                      sources=("no_such_source",))


def test_split_is_a_deterministic_fraction():
    ids = [f"x-{i}" for i in range(4000)]
    held = [i for i in ids if split_of(i, 0.1) == "heldout"]
    assert held == [i for i in ids if split_of(i, 0.1) == "heldout"]
    assert 300 < len(held) < 500


def test_records_round_trip_gzip_and_summary(tmp_path):
    path = tmp_path / "d.jsonl.gz"
    rows = [{"id": "a", "source": "s", "split": "train", "prompt_ids": [1, 2], "answer_ids": [3],
             "finished": True},
            {"id": "b", "source": "s", "split": "heldout", "prompt_ids": [1], "answer_ids": [4, 5],
             "finished": False}]
    for row in rows:  # appended member by member, as a resumed run does
        with gzip.open(path, "at") as f:
            f.write(json.dumps(row) + "\n")
    assert list(read_records(path)) == rows
    stats = summarize(path)
    assert stats["answers"] == 2 and stats["answer_tokens"] == 3 and stats["prompt_tokens"] == 3
    assert stats["by_split"]["heldout"] == {"answers": 1, "answer_tokens": 2}


def test_a_cut_off_file_reads_up_to_the_cut_and_is_repaired(tmp_path):
    """A generator killed mid-write leaves a truncated gzip member (or a half line): the complete
    records before it still read, and repair_data_file makes the file whole again for appending."""
    path = tmp_path / "d.jsonl.gz"
    rows = [{"id": k, "answer_ids": [i]} for i, k in enumerate("abc")]
    for row in rows[:2]:
        with gzip.open(path, "at") as f:
            f.write(json.dumps(row) + "\n")
    member = gzip.compress((json.dumps(rows[2]) + "\n").encode())
    with open(path, "ab") as f:
        f.write(member[:len(member) // 2])  # the third member, cut off
    with pytest.raises(EOFError):
        with gzip.open(path, "rt") as f:
            f.read()
    assert list(read_records(path)) == rows[:2]
    assert repair_data_file(path) is True
    with gzip.open(path, "at") as f:
        f.write(json.dumps(rows[2]) + "\n")
    assert list(read_records(path)) == rows
    assert repair_data_file(path) is False
    plain = tmp_path / "d.jsonl"
    plain.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1])[:10])
    assert list(read_records(plain)) == rows[:1]
    assert repair_data_file(plain) is True and plain.read_text() == json.dumps(rows[0]) + "\n"


def test_cli_samples_as_told_and_skips_prompts_of_excluded_files(tmp_path, smollm2_dir, capsys):
    """`dspark data generate --temperature 0 --exclude OLD` on the real target: the excluded file's
    prompts are not answered again, and the greedy answers are transformers' greedy tokens."""
    import argparse

    from transformers import AutoModelForCausalLM

    from dspark.training import data

    prompts_dir = tmp_path / "train"
    prompts_dir.mkdir()
    write_prompts(prompts_dir, "gsm8k", "math", 6)
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps({"id": f"gsm8k-{i}", "prompt_ids": [1], "answer_ids": [2]})
                           + "\n" for i in (0, 2, 4)))
    parser = argparse.ArgumentParser()
    data.configure(parser)
    out = tmp_path / "new.jsonl.gz"
    args = parser.parse_args(["generate", "--model-dir", str(smollm2_dir), "--train-dir",
                              str(prompts_dir), "--out", str(out), "--num-prompts", "6",
                              "--max-new-tokens", "3", "--batch-size", "4", "--temperature", "0",
                              "--exclude", str(old)])
    assert data.run(args) == 0
    records = list(read_records(out))
    assert sorted(r["id"] for r in records) == ["gsm8k-1", "gsm8k-3", "gsm8k-5"]
    # each record says how it was sampled, and by weights of which dtype
    assert all(r["temperature"] == 0.0 and r["dtype"] == "float32" for r in records)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["answers"] == 3
    written = out.read_bytes()
    assert data.run(args) == 0  # every prompt answered: a run again leaves the file as it is
    assert out.read_bytes() == written
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["answers"] == 3
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for r in records:
        with torch.no_grad():
            expected = model.generate(torch.tensor([r["prompt_ids"]]), do_sample=False,
                                      max_new_tokens=3, min_new_tokens=3)[0, -3:].tolist()
        assert r["answer_ids"] == expected[:len(r["answer_ids"])]
    with pytest.raises(SystemExit):  # argparse rejects a malformed flag value
        parser.parse_args(["generate", "--top-k", "many"])
