"""Kill, preempt and resume a run of two data-parallel processes on CPU."""

import json
import os
import signal

import pytest

import runner

# 64 examples, batch 8, two ranks: 4 batches an epoch, accumulation 2: 2 updates an epoch
ARGS = ("--strategy", "supervised", "--accum", "2", "--epochs", "4", "--every-steps", "3",
        "--signal-check-every", "2")


def finish(process):
    output = process.communicate(timeout=runner.PATIENCE_S)[0]
    assert process.returncode == 0, output[-4000:]
    return output


def kill_when_paused(process, out):
    """Once both ranks hold at their pause, SIGKILL both (each by the pid its
    marker gives, as the kernel's OOM killer or a lost node would)."""
    markers = [out / "paused-0", out / "paused-1"]
    runner.wait_for_markers(process, *markers)
    for m in markers:
        os.kill(json.loads(m.read_text())["pid"], signal.SIGKILL)
    process.communicate(timeout=runner.PATIENCE_S)
    assert process.returncode != 0


@pytest.mark.slow
def test_two_processes_killed_then_preempted_on_one_rank_end_equal(tmp_path):
    ref = tmp_path / "reference"
    ref.mkdir()
    finish(runner.launch_two(ref, *ARGS))
    assert json.loads((ref / "run.json").read_text())["num_processes"] == 2
    reference = runner.params(ref)

    out = tmp_path / "run"
    out.mkdir()
    # 1. both ranks held in batch 7 (mid update 4); kill both ranks with SIGKILL: the last checkpoint is the periodic one of update 3
    kill_when_paused(runner.launch_two(out, *ARGS, "--pause", "step:7"), out)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000003"

    # 2. resumed at 3; only rank 1 gets SIGTERM, in batch 9 (update 5): the
    # ranks agree at the next safe point that checks (every 2 updates: the one
    # of update 6, the epoch's last) and both stop there
    process = runner.launch_two(out, *ARGS, "--pause", "selfterm:9:1")
    output = process.communicate(timeout=runner.PATIENCE_S)[0]
    assert process.returncode != 0, output[-4000:]
    stops = [json.loads((out / f"preempted-{r}.json").read_text()) for r in (0, 1)]
    assert [s["started_at"] for s in stops] == [3, 3]
    assert [s["step"] for s in stops] == [6, 6], output[-4000:]
    assert [s["code"] for s in stops] == [75, 75]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000006"
    doc = json.loads((out / "checkpoints" / "step-00000006" / "hookloop.json").read_text())
    assert doc["num_processes"] == 2 and doc["reason"] == "preempted"
    assert {"random_states_0.pkl", "random_states_1.pkl", "hookloop-rank0.safetensors",
            "hookloop-rank1.safetensors"} <= set(doc["files"])

    # 3. resumed at 6: ends where the uninterrupted two-process run ends
    finish(runner.launch_two(out, *ARGS))
    run = json.loads((out / "run.json").read_text())
    assert run["started_at"] == 6 and run["num_processes"] == 2 and run["global_step"] == 8
    assert runner.same(runner.params(out), reference) == []


@pytest.mark.slow
def test_a_two_process_gan_killed_mid_epoch_ends_equal(tmp_path):
    args = ("--strategy", "gan", "--accum", "1", "--epochs", "2", "--every-steps", "3")
    ref = tmp_path / "reference"
    ref.mkdir()
    finish(runner.launch_two(ref, *args))
    out = tmp_path / "run"
    out.mkdir()
    kill_when_paused(runner.launch_two(out, *args, "--pause", "step:7"), out)  # 4 steps an epoch
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000006"
    finish(runner.launch_two(out, *args))
    run = json.loads((out / "run.json").read_text())
    assert run["started_at"] == 6 and run["num_processes"] == 2 and run["global_step"] == 8
    assert runner.same(runner.params(out), runner.params(ref)) == []


@pytest.mark.slow
def test_two_processes_sent_sigterm_during_a_predict_after_fit_both_exit_75(tmp_path):
    """As a cluster scheduler signals every task of a job: each rank ends with
    the documented status (the launcher reports its own, 1), none hangs.
    Under the real ``accelerate launch``: what it reports is asserted."""
    process = runner.accelerate_launch_two(tmp_path, *ARGS, "--predict", "--pause", "predict:1")
    pids = []
    for rank in (0, 1):
        marker = tmp_path / f"paused-{rank}"
        runner.wait_for_markers(process, marker)
        pids.append(json.loads(marker.read_text())["pid"])
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    output = process.communicate(timeout=runner.PATIENCE_S)[0]
    stops = [json.loads((tmp_path / f"preempted-{r}.json").read_text()) for r in (0, 1)]
    assert [s["where"] for s in stops] == ["predict", "predict"], output[-4000:]
    assert [s["code"] for s in stops] == [75, 75]
    assert "exitcode  : 75" in output or "exitcode: 75" in output  # what the launcher saw
    assert (tmp_path / "checkpoints" / "PREEMPTED").exists()


@pytest.mark.slow
def test_a_two_process_stream_killed_mid_epoch_ends_equal(tmp_path):
    """An IterableDataset without a length (Accelerate dispatches its batches
    from the main process), resumed by replaying it to the saved position."""
    args = ("--strategy", "supervised", "--accum", "1", "--epochs", "2", "--every-steps", "3",
            "--data", "stream")
    ref = tmp_path / "reference"
    ref.mkdir()
    finish(runner.launch_two(ref, *args))
    reference = runner.params(ref)
    out = tmp_path / "run"
    out.mkdir()
    # 64 rows in batches of 8 for two ranks: 4 updates an epoch; batch 7 is mid-epoch 1
    kill_when_paused(runner.launch_two(out, *args, "--pause", "step:7"), out)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000006"
    finish(runner.launch_two(out, *args))
    run = json.loads((out / "run.json").read_text())
    assert run["started_at"] == 6 and run["num_processes"] == 2
    assert runner.same(runner.params(out), reference) == []
