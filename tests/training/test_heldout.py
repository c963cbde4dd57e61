"""Held-out acceptance (the learning curve's points) against brute force over the blocks, with
stand-in drafters whose acceptance is known; and the trainer's held-out log across a resume."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from dspark.training.batches import block_labels, make_batch, read_examples, sample_anchors
from dspark.training.heldout import HeldoutEvaluator
from dspark.training.trainer import TargetTeacher, TrainConfig, Trainer, read_log

GAMMA = 4


@pytest.fixture(scope="module")
def heldout_data(tmp_path_factory, data_path):
    """The toy answers, every fifth one marked held-out."""
    path = tmp_path_factory.mktemp("heldout") / "answers.jsonl"
    lines = [json.loads(ln) for ln in open(data_path)]
    with open(path, "w") as f:
        for i, obj in enumerate(lines):
            f.write(json.dumps({**obj, "split": "heldout" if i % 5 == 0 else "train"}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def teacher(target_dir):
    model = TargetTeacher.load(target_dir, torch.device("cpu"), torch.float32)
    return TargetTeacher(model, [1, 2, 3])


class TeacherLogitsDrafter(torch.nn.Module):
    """Drafts with the target's own logits at each block position: accepts everything."""

    def __init__(self, teacher, scale: float = 1.0):
        super().__init__()
        self.teacher, self.scale = teacher, scale

    def forward_train(self, input_ids, features, anchors, labels):
        _, final_hidden = self.teacher.run(input_ids, torch.ones_like(input_ids))
        B, N = anchors.shape
        pos = (anchors.unsqueeze(-1) + torch.arange(GAMMA)).clamp(max=input_ids.shape[1] - 1)
        rows = final_hidden.gather(1, pos.view(B, -1, 1).expand(-1, -1, final_hidden.shape[-1]))
        logits = torch.nn.functional.linear(rows, self.teacher.lm_head_weight).view(B, N, GAMMA, -1)
        return SimpleNamespace(draft_logits=logits * self.scale)


def brute_force(examples, teacher, drafter_probs, num_anchors, seed=1234):
    """Mean acceptance per position and mean tau, block by block in Python (T=1 and greedy)."""
    generator = torch.Generator().manual_seed(seed)
    per_pos = {"t1": [[] for _ in range(GAMMA)], "greedy": [[] for _ in range(GAMMA)]}
    taus = {"t1": [], "greedy": []}
    for i in range(0, len(examples), 4):
        batch = make_batch(examples[i: i + 4], 512)
        _, final_hidden = teacher.run(batch.input_ids, batch.attention_mask)
        anchors, keep = sample_anchors(batch.answer_mask, num_anchors, generator)
        _, valid = block_labels(batch.input_ids, anchors, batch.answer_mask, GAMMA)
        for b in range(anchors.shape[0]):
            for n in range(anchors.shape[1]):
                if not (keep[b, n] and valid[b, n, 0]):
                    continue
                survive = {"t1": 1.0, "greedy": 1.0}
                tau = {"t1": 1.0, "greedy": 1.0}
                for k in range(GAMMA):
                    if not valid[b, n, k]:
                        break
                    p_t = torch.softmax(teacher.lm_head_weight @ final_hidden[b, anchors[b, n] + k], -1)
                    p_d = drafter_probs(p_t)
                    accept = {"t1": float(1 - 0.5 * (p_d - p_t).abs().sum()),
                              "greedy": float(p_d.argmax() == p_t.argmax())}
                    for name in accept:
                        per_pos[name][k].append(accept[name])
                        survive[name] *= accept[name]
                        tau[name] += survive[name]
                for name in tau:
                    taus[name].append(tau[name])
    return ({name: [sum(v) / len(v) for v in per_pos[name]] for name in per_pos},
            {name: sum(v) / len(v) for name, v in taus.items()})


@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_heldout_acceptance_matches_brute_force(heldout_data, teacher, scale):
    """A drafter with the target's logits (scale 1: every draft accepted) or flattened ones
    (scale 0.3: same argmax, T=1 acceptance below 1), against a loop over the blocks."""
    examples = read_examples(heldout_data, "heldout")
    evaluator = HeldoutEvaluator(examples, teacher, GAMMA, num_anchors=5, max_seq_len=512,
                                 draft_ids=None, device=torch.device("cpu"))
    got = evaluator.evaluate(TeacherLogitsDrafter(teacher, scale))
    per_pos, taus = brute_force(
        examples, teacher, lambda p_t: torch.softmax(torch.log(p_t) * scale, -1), 5)
    assert got["accept_greedy"] == [1.0] * GAMMA
    # blocks near an answer's end have fewer positions, so even a perfect drafter's tau < GAMMA + 1
    assert got["tau_greedy"] == pytest.approx(taus["greedy"], abs=1e-4)
    assert got["accept_t1"] == pytest.approx(per_pos["t1"], abs=1e-4)
    assert got["tau_t1"] == pytest.approx(taus["t1"], abs=1e-4)
    if scale == 1.0:
        assert got["tau_t1"] == pytest.approx(got["tau_greedy"], abs=1e-3)
    else:
        assert got["tau_t1"] < got["tau_greedy"] - 0.2


def test_heldout_log_is_a_curve_that_survives_a_resume(target_dir, heldout_data, tmp_path):
    def cfg(steps):
        return TrainConfig(data_path=heldout_data, target_dir=target_dir, out_dir=str(tmp_path),
                           num_layers=1, num_context_layers=3, gamma=GAMMA, markov_rank=8,
                           steps=steps, batch_size=4, num_anchors=6, max_seq_len=64, lr=3e-3,
                           warmup_steps=2, log_every=1, save_every=4, eval_every=2,
                           eval_examples=8, eval_anchors=5, progress=False, device="cpu")

    Trainer(cfg(6)).run()
    first = read_log(tmp_path / "heldout_log.jsonl")
    assert [r["step"] for r in first] == [0, 2, 4, 6]
    assert all(1.0 <= r["tau_t1"] <= GAMMA + 1 and len(r["accept_greedy"]) == GAMMA for r in first)
    assert [r["anchor_blocks_seen"] for r in first] == [0, 48, 96, 144]
    assert first[-1]["tau_t1"] > first[0]["tau_t1"]  # the toy answers are easy to learn
    Trainer(cfg(8)).run()  # continues from the checkpoint of step 6 (a longer schedule)
    steps = [r["step"] for r in read_log(tmp_path / "heldout_log.jsonl")]
    assert steps == [0, 2, 4, 6, 8]
