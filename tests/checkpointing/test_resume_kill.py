"""Kill -9 a training process at several points, resume each time: the run
ends bit for bit where the uninterrupted run ends (supervised and GAN).

The runs are tests/scripts/resumable.py (shuffled data, dropout, a warm-up
schedule, gradient accumulation), forked from a preloaded server
(tests/scripts/runner.py) so that a dozen processes stay affordable.
"""

import json
import re
import sys
from pathlib import Path

import pytest

import runner

SUPERVISED = ("--strategy", "supervised", "--accum", "2", "--epochs", "3", "--every-steps", "3")
GAN = ("--strategy", "gan", "--accum", "1", "--epochs", "2", "--every-steps", "3")
#: an IterableDataset without a length (a new order from the global RNG at each pass),
#: replayed to its position on resume; and the same through a StatefulDataLoader
STREAM = ("--strategy", "supervised", "--accum", "1", "--epochs", "2", "--every-steps", "3",
          "--data", "stream")
STATEFUL = (*STREAM[:-1], "stateful")


def latest(out):
    return (out / "checkpoints" / "latest").read_text().strip()


def saved(out):
    """The root's entries; ``.tmp-<name>-<run>-<pid>`` as ``.tmp-<name>``; not the
    lock a killed run left (the next one takes it over)."""
    return sorted(re.sub(r"^(\.tmp-.*)-[0-9a-f]{8}-\d+$", r"\1", p.name)
                  for p in (out / "checkpoints").iterdir() if p.name not in ("latest", "hookloop.lock"))


def tmp(out, name):
    """The temporary folder of the save of checkpoint ``name`` (one, or None)."""
    found = list((out / "checkpoints").glob(f".tmp-{name}-*"))
    assert len(found) <= 1, found
    return found[0] if found else None


def manifest(out, name):
    return json.loads((out / "checkpoints" / name / "hookloop.json").read_text())


def kill_at(out, args, pause):
    run = runner.Run(out, *args, "--pause", pause, name=pause.replace(":", "-"))
    run.wait_paused()
    run.kill()
    return run


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted runs' final parameters."""
    out = {}
    for label, args in (("supervised", SUPERVISED), ("gan", GAN), ("stream", STREAM),
                        ("stateful", STATEFUL)):
        path = tmp_path_factory.mktemp(f"reference-{label}")
        out[label] = runner.Run(path, *args).finish()
    return out


def test_supervised_run_killed_four_times_ends_bit_for_bit_equal(tmp_path, reference):
    # 8 batches an epoch, accumulation 2: 4 updates an epoch (update K ends
    # at batch 2K), a checkpoint every 3 updates (at an epoch's last update
    # left to the epoch-end checkpoint)
    kill_at(tmp_path, SUPERVISED, "step:7")  # batch 7: mid-epoch, mid accumulation group
    assert latest(tmp_path) == "step-00000003"

    kill_at(tmp_path, SUPERVISED, "save:write:6")  # Accelerate's files half written
    assert latest(tmp_path) == "step-00000004-epoch-end"
    assert tmp(tmp_path, "step-00000006") is None or not (tmp(tmp_path, "step-00000006") / "hookloop.json").exists()

    kill_at(tmp_path, SUPERVISED, "save:latest:6")  # renamed into place, latest not updated
    assert latest(tmp_path) == "step-00000004-epoch-end"
    assert manifest(tmp_path, "step-00000006")["loop"]["global_step"] == 6  # complete

    kill_at(tmp_path, SUPERVISED, "save:publish:9")  # complete, not yet renamed
    assert latest(tmp_path) == "step-00000008-epoch-end"
    assert (tmp(tmp_path, "step-00000009") / "hookloop.json").exists()
    assert saved(tmp_path) == [".tmp-step-00000009", "step-00000004-epoch-end", "step-00000006",
                               "step-00000008-epoch-end"]  # keep_last=3

    final = runner.Run(tmp_path, *SUPERVISED, name="final").finish()
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["started_at"] == 8 and run["global_step"] == 12
    assert runner.same(final, reference["supervised"]) == []
    assert saved(tmp_path) == ["step-00000008-epoch-end", "step-00000009", "step-00000012-epoch-end"]


def test_gan_run_killed_twice_ends_bit_for_bit_equal(tmp_path, reference):
    kill_at(tmp_path, GAN, "step:5")  # mid-epoch
    assert latest(tmp_path) == "step-00000003"
    kill_at(tmp_path, GAN, "save:publish:9")  # resumed at 3; killed in the save after step 9
    assert latest(tmp_path) == "step-00000008-epoch-end"
    assert manifest(tmp_path, "step-00000008-epoch-end")["plugins"]["gan"]["d_updates"] == 8

    final = runner.Run(tmp_path, *GAN, name="final").finish()
    assert json.loads((tmp_path / "run.json").read_text())["started_at"] == 8
    assert runner.same(final, reference["gan"]) == []


@pytest.mark.parametrize("label", ["stream", "stateful"])
def test_a_stream_killed_mid_epoch_and_in_a_save_ends_bit_for_bit_equal(tmp_path, reference, label):
    args = STREAM if label == "stream" else STATEFUL
    # 8 batches an epoch, one update each; a checkpoint every 3 updates
    kill_at(tmp_path, args, "step:5")  # mid-epoch: resumed at 3, the stream read again up to there
    assert latest(tmp_path) == "step-00000003"
    assert manifest(tmp_path, "step-00000003")["settings"]["batches_per_epoch"] is None
    kill_at(tmp_path, args, "save:publish:12")  # resumed at 3; killed in the save after 12
    assert latest(tmp_path) == "step-00000009"
    final = runner.Run(tmp_path, *args, name="final").finish()
    assert json.loads((tmp_path / "run.json").read_text())["started_at"] == 9
    assert runner.same(final, reference[label]) == []


def test_the_comparison_is_sharp(tmp_path, reference):
    """A run one epoch shorter ends elsewhere: equality above means something."""
    shorter = [*SUPERVISED]
    shorter[shorter.index("--epochs") + 1] = "2"
    params = runner.Run(tmp_path, *shorter).finish()
    assert runner.same(params, reference["supervised"]) != []
