"""Acceptance tests: a checkpoint is only written at a safe point (after an
update and after every evaluation scheduled at that update, with the random
states as training continues), so a run killed at ANY moment of its
checkpointing and resumed with ``resume_from="latest"`` ends exactly where
the uninterrupted run ends.

The kill tests run tests/scripts/fs_kill.py in a subprocess: it kills a run
(SIGKILL) just before each file-system operation of its checkpointing in
turn, k = 1..K, resumes it, and compares the final parameters (bitwise), the
evaluation history, the checkpoints left, ``latest``, ``checkpoint.best`` and
the update at which training stopped with the uninterrupted run's. See the
script for the cases (``python tests/scripts/fs_kill.py CASE`` to run one by
hand, ``--ops`` to list the operations by k).

What hookloop 0.2 gets wrong, and these catch: the best-k save inside
``on_eval_end`` (random states not yet put back: not bitwise); the step save
in ``after_step`` before that update's evaluation (the evaluation is lost on
resume, a best-k member with it, and an ``EarlyStoppingCallback``'s patience
count with it); a re-save at the same step moving the complete checkpoint to
``.trash-*`` first (killed between the two renames, ``latest`` names a
missing folder); ``loop.log(..., on_epoch=True)`` values of the part of an
epoch before a resume are lost.
"""

import json
import subprocess
import sys

import pytest
import torch

from hookloop import hookimpl
from hookloop.plugins import Checkpoint
from hookloop.testing import parameters, reset_accelerate, tiny_loop
from paths import ROOT, SCRIPTS

DRIVER = SCRIPTS / "fs_kill.py"

CASES = {
    "a": "fit(eval_every=2), Checkpoint(every_steps=2, monitor='eval_loss', save_top_k=2)",
    "b": "fit(eval_every=2), Checkpoint(every_steps=3, monitor='eval_loss', save_top_k=2)",
    "c": "TrainerCallbacks([EarlyStoppingCallback(2)]), eval_steps=2, Checkpoint(every_steps=2)",
    "c2": "TrainerCallbacks([EarlyStoppingCallback(2)]), eval_steps=2, Checkpoint(every_steps=3)",
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_run_killed_at_any_file_system_operation_resumes_exactly(case):
    done = subprocess.run([sys.executable, str(DRIVER), case, "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.stdout.strip(), f"fs_kill.py {case} wrote no report (exit {done.returncode}):\n" \
                                f"{done.stderr[-4000:]}"
    report = json.loads(done.stdout)
    assert report["K"] > 0 and report["tested"] == report["K"]
    assert report["failed"] == 0, (
        f"{CASES[case]}: {report['failed']} of {report['K']} kill points did not resume "
        f"exactly:\n{done.stderr[-6000:]}")
    assert done.returncode == 0, done.stderr[-4000:]


class Flag:
    """Logs 1.0 for the first 3 updates, then 0.0: the epoch's mean is 3/8."""

    name = "flag"

    def __init__(self):
        self.epochs = []  # the metrics of every on_epoch_end

    @hookimpl
    def after_step(self, loop):
        loop.log({"flag": 1.0 if loop.state.global_step <= 3 else 0.0}, on_epoch=True)

    @hookimpl
    def on_epoch_end(self, loop, metrics):
        self.epochs.append(dict(metrics))


def test_an_epoch_resumed_mid_way_reduces_what_was_logged_before_the_resume(tmp_path):
    # uninterrupted: one epoch of 8 updates
    whole = Flag()
    loop = tiny_loop([whole, Checkpoint(dir=tmp_path / "whole", every_steps=1, signals=None)])
    metrics = loop.fit(epochs=1)
    assert loop.state.global_step == 8
    assert metrics["flag"] == whole.epochs[-1]["flag"] == pytest.approx(0.375)
    reference = parameters(loop)
    loop.close()

    # interrupted after update 4 (a checkpoint after every update) ...
    reset_accelerate()
    first = tiny_loop([Flag(), Checkpoint(dir=tmp_path / "cut", every_steps=1, signals=None)])
    first.fit(max_steps=4)
    assert first.state.global_step == 4
    first.close()

    # ... and a new process-like Loop that fits the rest of the epoch
    reset_accelerate()
    rest = Flag()
    resumed = tiny_loop([rest, Checkpoint(dir=tmp_path / "cut", every_steps=1, signals=None)],
                        resume_from="latest")
    assert resumed.state.global_step == 4
    metrics = resumed.fit(epochs=1)
    assert resumed.state.global_step == 8
    assert metrics["flag"] == rest.epochs[-1]["flag"] == pytest.approx(0.375), (
        "the epoch's loop.log(on_epoch=True) mean lost the values logged before the resume")
    assert all(torch.equal(a, b) for a, b in zip(parameters(resumed), reference))
    resumed.close()
