"""The training loop on a tiny random Llama target: the loss goes down, resuming continues exactly,
every method trains and its checkpoint loads, and `dspark train` runs."""

from __future__ import annotations

import argparse
import json
import random

import pytest
import torch
from safetensors.torch import load_file

from dspark.models.draft_types import DraftRequest
from dspark.models.drafter import DSparkDrafter
from dspark.models.drafter_io import load_drafter
from dspark.models.eagle import EagleDrafter
from dspark.sampling import SamplingParams
from dspark.training import train_cli
from dspark.training.batches import (
    Example,
    make_batch,
    read_examples,
    sample_anchors,
    select_draft_vocab,
)
from dspark.methods import DrafterKind
from dspark.training.trainer import (
    BIGRAM_START_BACKBONE_SCALE,
    TrainConfig,
    Trainer,
    lr_lambda,
    read_log,
)

VOCAB = 64


def config(target_dir, data_path, out_dir, **kw) -> TrainConfig:
    base = dict(data_path=data_path, target_dir=target_dir, out_dir=str(out_dir), num_layers=1,
                num_context_layers=3, gamma=4, markov_rank=8, steps=30, batch_size=4, num_anchors=6,
                max_seq_len=64, lr=3e-3, warmup_steps=3, log_every=1, save_every=1000,
                progress=False, device="cpu", seed=0)
    base.update(kw)
    return TrainConfig(**base)


def test_loss_goes_down(target_dir, data_path, tmp_path):
    trainer = Trainer(config(target_dir, data_path, tmp_path))
    assert trainer.teacher.layer_ids == [1, 2, 3]
    assert trainer.model.config.mask_token_id == VOCAB - 1  # highest id absent from the data
    trainer.run()
    log = read_log(tmp_path / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(1, 31))
    first = sum(r["loss"] for r in log[:5]) / 5
    last = sum(r["loss"] for r in log[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    mean = lambda key, rows: sum(r[key] for r in rows) / len(rows)
    assert mean("tv", log[-5:]) < 0.8 * mean("tv", log[:5])  # closer to the target's p^t
    assert mean("tau", log[-5:]) > 1.3 * mean("tau", log[:5])  # so more tokens per round
    assert (tmp_path / "config.json").exists() and (tmp_path / "model.safetensors").exists()
    # The final weights are stored in bfloat16 and load as a drafter.
    assert load_file(str(tmp_path / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "train_config.json").read_text())["method"] == "markov"


def test_bf16_student_trains_float32_weights_close_to_the_float32_student(target_dir, data_path,
                                                                           tmp_path):
    """Under bf16 autocast the drafter's weights, gradients and losses stay float32, the loss goes
    down as in float32, and the first step's losses agree with the float32 student's to bf16
    rounding."""
    first = {}
    for dtype in ("float32", "bfloat16"):
        trainer = Trainer(config(target_dir, data_path, tmp_path / dtype, student_dtype=dtype))
        first[dtype] = trainer.compute_losses(trainer._next_batch())
        if dtype == "bfloat16":
            trainer.run()
            assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
            log = read_log(tmp_path / dtype / "train_log.jsonl")
            assert sum(r["loss"] for r in log[-5:]) < 0.8 * sum(r["loss"] for r in log[:5])
    assert first["bfloat16"].total.dtype == torch.float32
    torch.testing.assert_close(first["bfloat16"].total, first["float32"].total, rtol=0.05, atol=0.02)
    with pytest.raises(ValueError, match="student_dtype"):
        config(target_dir, data_path, tmp_path, student_dtype="float16")


@pytest.mark.parametrize("teacher_cache", [False, True])
def test_resume_continues_identically(target_dir, data_path, tmp_path, teacher_cache):
    kw = dict(steps=8, save_every=4, teacher_cache=teacher_cache)
    straight = Trainer(config(target_dir, data_path, tmp_path / "a", **kw))
    straight.run()

    interrupted = Trainer(config(target_dir, data_path, tmp_path / "b", **kw))
    for _ in range(3):
        interrupted.train_step()
    interrupted.save_checkpoint()
    interrupted.train_step()  # lost work: done after the last checkpoint, then "crash"
    del interrupted
    resumed = Trainer(config(target_dir, data_path, tmp_path / "b", **kw))
    assert resumed.step == 3
    resumed.run()
    a = load_file(str(tmp_path / "a" / "checkpoint" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "checkpoint" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    log_a = {r["step"]: r["loss"] for r in read_log(tmp_path / "a" / "train_log.jsonl")}
    log_b = {r["step"]: r["loss"] for r in read_log(tmp_path / "b" / "train_log.jsonl")}
    assert sorted(log_b) == [4, 5, 6, 7, 8]
    assert all(log_b[s] == log_a[s] for s in log_b)


def test_teacher_cache_runs_each_example_once(target_dir, data_path, tmp_path):
    runs = {}
    for cache in (False, True):
        trainer = Trainer(config(target_dir, data_path, tmp_path / str(cache), steps=14,
                                 teacher_cache=cache))
        calls = []
        original = trainer.teacher.run
        trainer.teacher.run = lambda ids, mask: calls.append(ids.shape[0]) or original(ids, mask)
        trainer.run()
        runs[cache] = (sum(calls), read_log(tmp_path / str(cache) / "train_log.jsonl"))
    assert runs[False][0] == 14 * 4  # every sequence of every step
    assert runs[True][0] == 40  # 14 steps x 4 = 56 sequences > 1 epoch of 40: each example once
    for a, b in zip(runs[False][1], runs[True][1]):  # bfloat16 storage: nearly the same run
        assert b["loss"] == pytest.approx(a["loss"], rel=3e-2)


@pytest.mark.parametrize("method,draft_vocab", [("markov", 24), ("rnn", None), ("none", None),
                                                ("eagle", 24)])
def test_every_method_trains_and_loads(target_dir, data_path, tmp_path, method, draft_vocab):
    trainer = Trainer(config(target_dir, data_path, tmp_path, method=method, steps=3,
                             draft_vocab_size=draft_vocab, num_layers=2))
    trainer.run()
    model = load_drafter(tmp_path, trainer.teacher.embed_weight, trainer.teacher.lm_head_weight)
    assert isinstance(model, EagleDrafter if method == "eagle" else DSparkDrafter)
    assert model.config.markov_head_type.value == ("none" if method == "eagle" else method)
    if draft_vocab:
        assert torch.equal(model.draft_to_target, trainer.draft_ids)
    features = torch.randn(5, 3 * 32)
    model.append_context("r", features, torch.arange(5), torch.tensor([20, 21, 10, 11, 12]))
    block = model.draft([DraftRequest("r", 13, 5, SamplingParams(0.0))])[0]
    assert block.tokens.shape == (4,)


def test_data_helpers():
    examples = [Example([1, 2, 3], [4, 5, 6, 7]), Example([8] * 10, [9] * 20)]
    batch = make_batch(examples, max_seq_len=16)
    assert batch.input_ids.shape == (2, 16)
    assert batch.input_ids[0, :7].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert batch.answer_mask[0].tolist() == [False] * 3 + [True] * 4 + [False] * 9
    # Too long: the prompt keeps its tail (at least half the budget), the answer is cut at the end.
    assert batch.answer_mask[1].sum() == 8 and batch.attention_mask[1].sum() == 16
    anchors, keep = sample_anchors(batch.answer_mask, 5, torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 5)
    assert keep[0].tolist() == [True, True, True, False, False]  # anchors 3, 4, 5 only
    assert anchors[0, :3].tolist() == [3, 4, 5]
    for b in range(2):
        for a, k in zip(anchors[b].tolist(), keep[b].tolist()):
            if k:
                assert batch.answer_mask[b, a] and batch.answer_mask[b, a + 1]
    vocab = select_draft_vocab([Example([], [5, 5, 5, 3, 3, 9, 1])], 12, 3)
    assert vocab.tolist() == [1, 3, 5]  # ties broken by lower id: 1 and 9 both appear once


def test_learning_rate_schedule():
    lrs = [lr_lambda(s, warmup=4, total=20, min_ratio=0.1) for s in range(21)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == pytest.approx(1.0) and lrs[20] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


def test_config_validation(tmp_path):
    with pytest.raises(ValueError):
        TrainConfig(data_path="x", target_dir="y", out_dir="z", steps=0)
    with pytest.raises(ValueError):
        TrainConfig(data_path="x", target_dir="y", out_dir="z", method="crf")
    assert TrainConfig(data_path="x", target_dir="y", out_dir="z", method="eagle").loss_config.conf_weight == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(ValueError):
        read_examples(bad)


def test_reads_gzipped_data_and_only_the_train_split(tmp_path):
    import gzip

    path = tmp_path / "answers.jsonl.gz"
    records = [{"id": "a", "split": "train", "prompt_ids": [1], "answer_ids": [2, 3]},
               {"id": "b", "split": "heldout", "prompt_ids": [4], "answer_ids": [5, 6]},
               {"id": "c", "prompt_ids": [7], "answer_ids": [8]},
               {"id": "d", "split": "train", "prompt_ids": [9], "answer_ids": []}]
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    assert [e.prompt_ids for e in read_examples(path)] == [[1], [7]]
    assert [e.prompt_ids for e in read_examples(path, "heldout")] == [[4]]
    assert len(read_examples(path, None)) == 3


def test_cli(target_dir, data_path, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    train_cli.configure(parser)
    args = parser.parse_args(["--data", data_path, "--target", target_dir, "--out", str(tmp_path),
                              "--method", "none", "--layers", "1", "--target-layers", "1,3",
                              "--gamma", "3", "--intermediate-size", "24", "--steps", "2", "--batch", "2", "--anchors", "4",
                              "--max-seq-len", "48", "--device", "cpu", "--no-progress"])
    assert train_cli.run(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["steps"] == 2
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["target_layer_ids"] == [1, 3] and cfg["block_size"] == 3 and cfg["markov_rank"] == 0
    assert cfg["intermediate_size"] == 24
    assert DrafterKind(json.loads((tmp_path / "train_config.json").read_text())["method"]) == DrafterKind.DFLASH


def test_warm_start_from_target_layers_and_bigram_markov_head(target_dir, data_path, tmp_path):
    """init_layers_from copies target layers (and points fc at the deepest fused layer);
    markov_init=bigram makes the untrained drafter close to the data's bigram model (U_k small)."""
    trainer = Trainer(config(target_dir, data_path, tmp_path, num_layers=2, init_layers_from=[4, 5],
                             markov_init="bigram", markov_rank=8))
    target_layers = trainer.teacher.model.model.layers
    drafter = trainer.model
    for i, j in enumerate([4, 5]):
        assert torch.equal(drafter.layers[i].self_attn.q_proj.weight, target_layers[j].self_attn.q_proj.weight)
        assert torch.equal(drafter.layers[i].mlp.down_proj.weight, target_layers[j].mlp.down_proj.weight)
    deepest = trainer.teacher.layer_ids.index(max(trainer.teacher.layer_ids))
    d = drafter.fc.out_features
    assert torch.equal(drafter.fc.weight[:, deepest * d:(deepest + 1) * d], torch.eye(d))
    assert float(drafter.fc.weight.detach().abs().sum()) == pytest.approx(d)
    # U_k starts small, not 0: at 0 no gradient would reach the backbone.
    target_norm = trainer.teacher.model.model.norm.weight
    assert torch.allclose(drafter.norm.weight, target_norm * BIGRAM_START_BACKBONE_SCALE)
    trainer.train_step()  # every backbone layer and the context projection learn from step 1
    for name in ("layers.0.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight", "fc.weight"):
        grad = dict(drafter.named_parameters())[name].grad
        assert grad is not None and float(grad.abs().max()) > 0.0, name
    # The pattern 10 -> 11 -> ... -> 15 -> 10 is deterministic: the bigram bias predicts it.
    head = drafter.markov_head
    bias = head.markov_w1.weight[torch.tensor([10, 13, 15])] @ head.markov_w2.weight.T
    assert bias.argmax(-1).tolist() == [11, 14, 10]
    with pytest.raises(ValueError, match="init_layers_from"):
        config(target_dir, data_path, tmp_path, num_layers=2, init_layers_from=[4])
    with pytest.raises(ValueError, match="markov head"):
        config(target_dir, data_path, tmp_path, method="none", markov_init="bigram")


def test_output_norm_learning_rate_and_last_context_injection(target_dir, data_path, tmp_path):
    """The final-norm weight (the scale of the backbone's logits) has its own learning rate, and
    after one step from a bigram start it has moved by about that rate, not by `lr`; the
    injection flag reaches the saved drafter's config."""
    trainer = Trainer(config(target_dir, data_path, tmp_path, num_layers=2, init_layers_from=[4, 5],
                             markov_init="bigram", output_norm_lr_scale=30.0, warmup_steps=0,
                             inject_last_context=True, steps=2))
    groups = trainer.optimizer.param_groups
    norm_group = [g for g in groups if any(p is trainer.model.norm.weight for p in g["params"])]
    assert len(norm_group) == 1 and len(norm_group[0]["params"]) == 1
    assert norm_group[0]["lr"] == pytest.approx(30 * 3e-3)
    assert all(g["lr"] == pytest.approx(3e-3) for g in groups if g is not norm_group[0])
    before = trainer.model.norm.weight.detach().clone()
    trainer.train_step()
    moved = (trainer.model.norm.weight.detach() - before).abs().max()
    assert 3e-3 * 5 < float(moved) <= 30 * 3e-3 * 1.01  # Adam: about lr * scale per step
    trainer.run()
    assert json.loads((tmp_path / "config.json").read_text())["inject_last_context"] is True
    with pytest.raises(ValueError, match="inject_last_context"):
        config(target_dir, data_path, tmp_path, method="eagle", inject_last_context=True)
    with pytest.raises(ValueError, match="learning-rate"):
        config(target_dir, data_path, tmp_path, output_norm_lr_scale=0.0)


def test_continue_from_a_saved_drafter(target_dir, data_path, tmp_path):
    """init_from_drafter starts from the saved weights exactly (over any other start), and refuses
    a drafter of another shape."""
    first = Trainer(config(target_dir, data_path, tmp_path / "a", num_layers=2, steps=2,
                           markov_rank=8, save_dtype="float32"))
    first.run()
    again = Trainer(config(target_dir, data_path, tmp_path / "b", num_layers=2, steps=2,
                           markov_rank=8, markov_init="bigram", init_layers_from=[4, 5],
                           init_from_drafter=str(tmp_path / "a")))
    saved = first.model.state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in again.model.state_dict().items())
    assert again.step == 0 and again.scheduler.last_epoch == 0
    with pytest.raises(ValueError, match="not a drafter of this configuration"):
        Trainer(config(target_dir, data_path, tmp_path / "c", num_layers=1, markov_rank=8,
                       init_from_drafter=str(tmp_path / "a")))


def test_several_data_files_are_read_in_order(tmp_path):
    """`data_path` may name several files, comma-separated (an older answer set and a newer one)."""
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(json.dumps({"prompt_ids": [1], "answer_ids": [2]}) + "\n")
    second.write_text(json.dumps({"prompt_ids": [3], "answer_ids": [4]}) + "\n"
                      + json.dumps({"split": "heldout", "prompt_ids": [5], "answer_ids": [6]}) + "\n")
    assert [e.prompt_ids for e in read_examples(f"{first},{second}")] == [[1], [3]]
    assert [e.prompt_ids for e in read_examples(f"{second},{first}", None)] == [[3], [5], [1]]
    with pytest.raises(FileNotFoundError):
        read_examples(f"{first},{tmp_path / 'missing.jsonl'}")


def test_continuing_on_other_data_keeps_the_draft_vocabulary_and_mask_token(
        target_dir, data_path, tmp_path):
    """A drafter trained further on new answers keeps the draft vocabulary and mask token it was
    trained with, although the new data's most frequent tokens are others."""
    first = Trainer(config(target_dir, data_path, tmp_path / "a", steps=2, draft_vocab_size=16,
                           save_dtype="float32"))
    first.run()
    other = tmp_path / "other.jsonl"
    with open(other, "w") as f:
        for i in range(12):
            f.write(json.dumps({"prompt_ids": [40 + i % 5], "answer_ids": [50 + (i + j) % 14
                                                                           for j in range(30)]}) + "\n")
    fresh = Trainer(config(target_dir, str(other), tmp_path / "b", steps=2, draft_vocab_size=16))
    assert not torch.equal(fresh.draft_ids, first.draft_ids)  # this data alone picks another set
    assert fresh.model.config.mask_token_id != first.model.config.mask_token_id
    again = Trainer(config(target_dir, str(other), tmp_path / "c", steps=2, draft_vocab_size=16,
                           init_from_drafter=str(tmp_path / "a")))
    assert torch.equal(again.draft_ids, first.draft_ids)
    assert again.model.config.mask_token_id == first.model.config.mask_token_id
    saved = first.model.state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in again.model.state_dict().items())
    again.run()
    reloaded = load_drafter(tmp_path / "c", again.teacher.embed_weight.float(),
                            again.teacher.lm_head_weight.float())
    assert torch.equal(reloaded.draft_to_target, first.draft_ids)


@pytest.mark.parametrize("draft_vocab", [None, 16])
def test_target_probs_once_per_position_equal_per_block(target_dir, data_path, tmp_path, draft_vocab):
    """p^t computed once per distinct position, gathered for every block that covers it, equals
    the vocabulary-sized product run for every (block, k) on its own."""
    trainer = Trainer(config(target_dir, data_path, tmp_path, num_anchors=12,
                             draft_vocab_size=draft_vocab))
    batch = trainer._next_batch()
    _, final_hidden = trainer.teacher_outputs(batch)
    anchors, _ = sample_anchors(batch.answer_mask, 12, torch.Generator().manual_seed(3))
    gamma = trainer.cfg.gamma
    pos = (anchors.unsqueeze(-1) + torch.arange(gamma)).clamp(max=batch.input_ids.shape[1] - 1)
    p_t, outside = trainer.target_probs(final_hidden, pos)
    B, N = anchors.shape
    rows = final_hidden.gather(1, pos.view(B, -1, 1).expand(-1, -1, final_hidden.shape[-1]))
    reference = trainer.teacher.probs(rows.view(B, N, gamma, -1), trainer.cfg.target_temperature)
    if draft_vocab is None:
        assert outside is None
    else:
        kept = reference[..., trainer.draft_ids]
        torch.testing.assert_close(outside, (1.0 - kept.sum(-1)).clamp_min(0.0))
        reference = kept
    assert p_t.shape == (B, N, gamma, reference.shape[-1])
    torch.testing.assert_close(p_t, reference)
