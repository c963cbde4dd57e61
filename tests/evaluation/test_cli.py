"""`dspark eval` and `dspark calibrate` end to end on a tiny random target (with a character-level
tokenizer and chat template) and tiny drafters saved with the project's checkpoint writer."""

from __future__ import annotations

import argparse
import gzip
import json
import shutil

import numpy as np
import pytest

from dspark.calibration.fit import fit_sts
from dspark.calibration.sts_map import CALIBRATION_FILENAME, CalibrationSet
from dspark.evaluation import calibrate_cli, eval_cli
from dspark.models.drafter_config import SequentialHead
from dspark.models.drafter_io import save_drafter
from dspark.models.eagle import EagleDrafter, eagle_config
from loadtest.tiny_models import GAMMA

from ..conftest import tiny_dspark

EAGLE_LAYER_IDS = [1, 2]  # a different layer set: the eval reloads the target for it


@pytest.fixture(scope="module")
def setup(tmp_path_factory, save_tiny_chat_target):
    """(target folder, checkpoints folder with dspark-markov, dflash, eagle; no dspark-rnn)."""
    root = tmp_path_factory.mktemp("eval_cli")
    target = root / "target"
    save_tiny_chat_target(target)
    target_config = json.loads((target / "config.json").read_text())

    ckpts = root / "checkpoints"
    for sub, head in (("dspark-markov", SequentialHead.MARKOV), ("dflash", SequentialHead.NONE)):
        drafter = tiny_dspark(noisy_confidence=True, mask_token_id=0, markov_head_type=head,
                              markov_rank=16 if head == SequentialHead.MARKOV else 0)
        save_drafter(drafter, ckpts / sub)
    save_drafter(EagleDrafter(eagle_config(target_config, target_layer_ids=EAGLE_LAYER_IDS,
                                           block_size=GAMMA)), ckpts / "eagle")
    return target, ckpts


def call(module, argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    module.configure(parser)
    return module.run(parser.parse_args(argv))


def write_eval_file(path, n: int = 4) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"turns": [f"what is {i} plus {i + 1}?", "and then?"]}) + "\n")


def test_eval_end_to_end_json(setup, tmp_path, capsys):
    target, ckpts = setup
    dataset = tmp_path / "tiny.jsonl"
    write_eval_file(dataset)
    rc = call(eval_cli, ["--dataset", str(dataset), "--limit", "3", "--max-tokens", "14",
                         "--temperature", "1.0", "--json", "--checkpoints", str(ckpts),
                         "--model-dir", str(target), "--device", "cpu",
                         "--plots", str(tmp_path / "plots")])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    lines = captured.out.strip().splitlines()
    result = json.loads(lines[-1])
    assert set(result) == {"dspark", "dflash", "eagle", "mtp1"}  # dspark-rnn: no checkpoint
    assert "dspark-rnn: missing" in captured.err and str(ckpts / "dspark-rnn") in captured.err
    table = "\n".join(lines[:-1])
    assert "| DSpark (markov) |" in table and "| DSpark (rnn) | missing |" in table
    for name, r in result.items():
        acc = r["accept_per_position"]
        assert len(acc) == (1 if name == "mtp1" else GAMMA)
        assert r["rounds"] > 0 and 1.0 <= r["tau"] <= len(acc) + 1
        # tau over full rounds = 1 + sum_k prod_{i<=k} conditional acceptance on the same rounds
        survival = np.cumprod([0.0 if a is None else a for a in acc])
        assert r["tau"] == pytest.approx(1 + survival.sum())
    for name in ("dspark", "dflash"):  # confidence heads: ECE before/after and AUC per position
        r = result[name]
        assert len(r["ece_before"]) == GAMMA and len(r["auc"]) == GAMMA
        assert r["sts_fitted"] is False and r["ece_after"] == pytest.approx(r["ece_before"])
    assert "ece_before" not in result["eagle"] and "ece_before" not in result["mtp1"]
    for png in ("acceptance.png", "reliability_dspark.png", "reliability_dflash.png"):
        assert (tmp_path / "plots" / png).stat().st_size > 1000


def test_eval_is_reproducible(setup, tmp_path, capsys):
    """Same seed, same figures (greedy and sampled): per-request seeded random streams."""
    target, ckpts = setup
    dataset = tmp_path / "tiny.jsonl"
    write_eval_file(dataset, 2)
    for temperature in ("0", "1.0"):
        runs = []
        for _ in range(2):
            rc = call(eval_cli, ["--dataset", str(dataset), "--max-tokens", "10", "--json",
                                 "--temperature", temperature, "--checkpoints", str(ckpts),
                                 "--model-dir", str(target), "--methods", "mtp1,dspark",
                                 "--device", "cpu"])
            assert rc == 0
            runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
        assert runs[0] == runs[1] and list(runs[0]) == ["mtp1", "dspark"]


def test_eval_requested_missing_checkpoint_is_an_error(setup, tmp_path, capsys):
    target, ckpts = setup
    dataset = tmp_path / "tiny.jsonl"
    write_eval_file(dataset, 1)
    rc = call(eval_cli, ["--dataset", str(dataset), "--methods", "dspark,dspark-rnn",
                         "--checkpoints", str(ckpts), "--model-dir", str(target), "--json"])
    captured = capsys.readouterr()
    assert rc == 2
    assert str(ckpts / "dspark-rnn") in captured.err
    assert captured.out == ""  # nothing evaluated, no JSON line
    rc = call(eval_cli, ["--dataset", str(dataset), "--checkpoints", str(tmp_path / "none"),
                         "--model-dir", str(target)])
    assert rc == 2 and "no drafter checkpoints" in capsys.readouterr().err
    rc = call(eval_cli, ["--dataset", str(dataset), "--methods", "medusa",
                         "--checkpoints", str(ckpts), "--model-dir", str(target)])
    assert rc == 2 and "unknown method" in capsys.readouterr().err


def write_data_file(path, rng) -> None:
    with gzip.open(path, "wt") as f:
        for i in range(10):
            split = "heldout" if i % 2 else "train"
            f.write(json.dumps({"id": str(i), "split": split,
                                "prompt_ids": rng.integers(3, 45, size=5 + i).tolist(),
                                "answer_ids": rng.integers(3, 45, size=8).tolist()}) + "\n")


def test_heldout_prompts_only(tmp_path):
    path = tmp_path / "data.jsonl.gz"
    write_data_file(path, np.random.default_rng(0))
    prompts = calibrate_cli.heldout_prompts(path)
    assert [len(p) for p in prompts] == [6, 8, 10, 12, 14]  # odd records, in file order
    assert len(calibrate_cli.heldout_prompts(path, limit=2)) == 2


def test_heldout_prompts_of_several_files_interleave_and_come_once(tmp_path):
    first, second = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz"
    write_data_file(first, np.random.default_rng(0))
    write_data_file(second, np.random.default_rng(1))
    a, b = calibrate_cli.heldout_prompts(first), calibrate_cli.heldout_prompts(second)
    both = calibrate_cli.heldout_prompts([first, second])
    assert both == [p for pair in zip(a, b) for p in pair]
    assert calibrate_cli.heldout_prompts([first, second], limit=3) == [a[0], b[0], a[1]]
    assert calibrate_cli.heldout_prompts([first, first]) == a  # a prompt held out twice: once
    parser = argparse.ArgumentParser()
    calibrate_cli.configure(parser)
    args = parser.parse_args(["--checkpoint", "x", "--data", f"{first},{second}"])
    assert args.data == [first, second]


def test_calibrate_writes_loadable_calibration_that_eval_applies(setup, tmp_path, capsys):
    target, ckpts = setup
    own = tmp_path / "checkpoints"
    shutil.copytree(ckpts / "dspark-markov", own / "dspark-markov")  # keep the shared one clean
    folder = own / "dspark-markov"
    data = tmp_path / "data.jsonl.gz"
    write_data_file(data, np.random.default_rng(1))
    rc = call(calibrate_cli, ["--checkpoint", str(folder), "--data", str(data),
                              "--max-tokens", "24", "--temperature", "1.0,0", "--model-dir",
                              str(target), "--device", "cpu", "--json",
                              "--save-records", str(tmp_path / "rounds.npz")])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    fits = CalibrationSet.load(folder)
    assert [f.sampling_temperature for f in fits.fits] == [0.0, 1.0] and fits.gamma == GAMMA
    for t in ("0", "1"):
        assert (folder / f"reliability_t{t}.png").stat().st_size > 1000
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert report["1"]["temperatures"] == fits.for_temperature(1.0).temperatures
    assert report["0"]["biases"] == fits.for_temperature(0.0).biases
    assert "sampling temperature 0:" in captured.out and "mean ECE" in captured.out
    # the saved rounds refit the same calibration without a model, and the plain fit with
    # --no-shift: both equal fit_sts on the saved arrays, per temperature
    rounds = calibrate_cli.load_records(tmp_path / "rounds.npz")
    assert [t for t, _, _ in rounds] == [1.0, 0.0]
    for t, confidences, survived in rounds:
        assert confidences.shape[1] == GAMMA and confidences.shape == survived.shape
        assert fits.for_temperature(t).temperatures == fit_sts(confidences, survived,
                                                                shift=True).temperatures
    for flags, shift in (([], True), (["--no-shift"], False)):
        rc = call(calibrate_cli, ["--checkpoint", str(folder), "--records",
                                  str(tmp_path / "rounds.npz"), "--data", "unused", *flags])
        assert rc == 0, capsys.readouterr().err
        refit = CalibrationSet.load(folder)
        for t, confidences, survived in rounds:
            expected = fit_sts(confidences, survived, shift=shift)
            assert refit.for_temperature(t).temperatures == expected.temperatures
            assert refit.for_temperature(t).biases == expected.biases
    assert not any(f.shifted for f in refit.fits)
    capsys.readouterr()

    # eval applies the fit of its own sampling temperature
    dataset = tmp_path / "tiny.jsonl"
    write_eval_file(dataset, 2)
    for t in (0.0, 1.0):
        rc = call(eval_cli, ["--dataset", str(dataset), "--max-tokens", "12", "--json",
                             "--checkpoints", str(own), "--model-dir", str(target),
                             "--methods", "dspark", "--device", "cpu", "--temperature", str(t)])
        r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["dspark"]
        assert rc == 0 and r["sts_fitted"] is True
        assert r["sts_temperatures"] == refit.for_temperature(t).temperatures
        assert r["sts_biases"] == refit.for_temperature(t).biases


def test_calibrate_errors(setup, tmp_path, capsys):
    target, ckpts = setup
    data = tmp_path / "data.jsonl.gz"
    write_data_file(data, np.random.default_rng(2))
    assert call(calibrate_cli, ["--checkpoint", str(tmp_path / "nothing"), "--data", str(data),
                                "--model-dir", str(target)]) == 2
    assert "no drafter checkpoint" in capsys.readouterr().err
    own = tmp_path / "eagle"
    shutil.copytree(ckpts / "eagle", own)
    assert call(calibrate_cli, ["--checkpoint", str(own), "--data", str(data), "--limit", "1",
                                "--max-tokens", "4", "--model-dir", str(target),
                                "--device", "cpu"]) == 2
    assert "no confidence head" in capsys.readouterr().err
    assert not (own / CALIBRATION_FILENAME).exists()
    markov = tmp_path / "markov"
    shutil.copytree(ckpts / "dspark-markov", markov)
    assert call(calibrate_cli, ["--checkpoint", str(markov), "--data", str(data), "--records",
                                str(tmp_path / "none.npz")]) == 2
    assert "no records file" in capsys.readouterr().err
    np.savez(tmp_path / "short.npz", sampling_temperatures=np.array([1.0]),
             confidences_0=np.full((3, GAMMA - 1), 0.5), survived_0=np.zeros((3, GAMMA - 1), dtype=bool))
    assert call(calibrate_cli, ["--checkpoint", str(markov), "--data", str(data), "--records",
                                str(tmp_path / "short.npz")]) == 2
    assert f"holds {GAMMA - 1} positions" in capsys.readouterr().err
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    assert call(calibrate_cli, ["--checkpoint", str(markov), "--data", str(data), "--records",
                                str(tmp_path / "other.npz")]) == 2
    assert "not a records file" in capsys.readouterr().err
    for bad in ("0,x", "-1", "1,1"):
        assert call(calibrate_cli, ["--checkpoint", str(markov), "--data", str(data),
                                    "--temperature", bad, "--model-dir", str(target)]) == 2
        assert "--temperature" in capsys.readouterr().err
