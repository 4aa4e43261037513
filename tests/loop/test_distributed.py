"""Two real data-parallel processes on CPU (gloo)."""

import json

import pytest
import torch
import launching
from paths import ROOT, SCRIPTS  # noqa: F401

SCRIPTS = SCRIPTS


def launch_two(script, *args, timeout=300):
    """Two ranks as `accelerate launch --multi_gpu --num_processes 2` starts
    them (launching.run_two); the script asks for Accelerator(cpu=True)."""
    return launching.run_two(script, *args, timeout=timeout, check=True)


@pytest.mark.slow
def test_two_processes_end_with_identical_parameters_and_log_once(tmp_path):
    result = launch_two("train_two_processes.py", tmp_path)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["num_processes"] for r in ranks] == [2, 2]
    # 64 examples, batch 8, two ranks: 4 steps per epoch each
    assert [r["global_step"] for r in ranks] == [8, 8]
    # 21 evaluation examples, counted once over both ranks, twice (2 epochs)
    assert [r["eval_examples_seen"] for r in ranks] == [42, 42]
    p0, p1 = (torch.load(tmp_path / f"params-{r}.pt") for r in (0, 1))
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
    records = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [2, 4, 6, 8]
    assert [r["epoch"] for r in records if "epoch" in r] == [0, 1]
    assert result.stdout.count("step 2 loss") == 1  # the console line: main process only


@pytest.mark.slow
def test_eval_every_predict_and_a_second_loop_in_two_processes(tmp_path):
    launch_two("run_model_two_processes.py", tmp_path)
    ranks = [json.loads((tmp_path / f"run-model-{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["num_processes"] == 2
        # eval_every=3 over 2 epochs of 4 updates: 3, 4 (epoch end), 6, 8 (epoch end)
        assert r["first_global_step"] == 8 and len(r["evaluations"]) == 4
        # every evaluation saw each of the 21 examples exactly once over both ranks
        assert r["evaluations"] == [list(range(21))] * 4 and r["eval_lengths"] == [21] * 4
        assert r["predict_shape"] == [21, 3] and r["predict_matches"]
        # per-token outputs of other lengths per batch and process: padded with -100, in place
        assert r["ragged_shape"] == [21, 7, 3] and r["ragged_padding_matches"] and r["ragged_values_match"]
        # loop.log(on_epoch=True): over the epoch and both ranks; a key one rank logged
        assert r["epoch_values"] == {"rank_mean": 0.5, "rank_max": 1.0, "only_on_one": 7.0}
        # the second Loop trained after the first was closed
        assert r["second_global_step"] == 4 and r["second_metrics"] == ["eval_accuracy", "eval_loss"]
    assert ranks[0]["params"] == ranks[1]["params"]
