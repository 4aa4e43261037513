"""Checkpoint(monitor=..., mode=..., save_top_k=k): the k best and the newest;
default run folders version_N."""

import subprocess
import sys
import textwrap

import pytest
import torch
from accelerate import Accelerator

from hookloop import hookimpl
from hookloop.checkpointing import CheckpointError, read_manifest
from hookloop.plugins import Checkpoint
from hookloop.testing import parameters, reset_accelerate, tiny_loop

EPOCH_END = "step-{:08d}-epoch-end"  # tiny_loop: 8 updates an epoch


class Score:
    """Puts ``score`` into every evaluation's metrics: the next of ``values``;
    remembers the parameters each epoch ended with."""

    def __init__(self, values):
        self.values = list(values)
        self.params = {}

    @hookimpl
    def on_eval_end(self, loop, metrics):
        # (the sanity check's evaluation has a score too, and consumes none)
        metrics["score"] = self.values[0] if loop.state.stage == "sanity" else self.values.pop(0)

    @hookimpl
    def on_epoch_end(self, loop):
        self.params[loop.state.global_step] = [p.clone() for p in parameters(loop)]


def names(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def test_the_k_best_and_the_newest_are_kept_and_best_is_recorded(tmp_path):
    score = Score([5.0, 3.0, 4.0, 1.0, 2.0, 6.0])
    checkpoint = Checkpoint(dir=tmp_path, monitor="score", mode="min", save_top_k=2, signals=None)
    loop = tiny_loop([score, checkpoint], eval_data=True)
    loop.fit(epochs=6)
    # best: 1.0 (epoch 3, step 32) and 2.0 (epoch 4, step 40); newest: epoch 5 (step 48)
    assert names(tmp_path) == [EPOCH_END.format(32), EPOCH_END.format(40), EPOCH_END.format(48)]
    assert checkpoint.best == {"path": tmp_path / EPOCH_END.format(32), "value": 1.0}
    assert read_manifest(tmp_path / EPOCH_END.format(32))["monitor"] == {
        "key": "score", "value": 1.0, "mode": "min"}


def test_mode_max_keeps_the_highest(tmp_path):
    checkpoint = Checkpoint(dir=tmp_path, monitor="score", mode="max", save_top_k=1, signals=None)
    tiny_loop([Score([0.2, 0.9, 0.5]), checkpoint], eval_data=True).fit(epochs=3)
    assert names(tmp_path) == [EPOCH_END.format(16), EPOCH_END.format(24)]  # best 0.9, newest
    assert checkpoint.best["value"] == 0.9


def test_best_survives_a_resume_and_load_checkpoint_best_restores_it(tmp_path):
    first = Score([5.0, 1.0, 4.0])
    tiny_loop([first, Checkpoint(dir=tmp_path, monitor="score", save_top_k=2, signals=None)],
              eval_data=True).fit(epochs=3)
    reset_accelerate()
    checkpoint = Checkpoint(dir=tmp_path, monitor="score", save_top_k=2, signals=None)
    second = Score([3.0, 0.5])
    loop = tiny_loop([second, checkpoint], eval_data=True, resume_from="latest")
    assert checkpoint.best_checkpoint(loop) == (1.0, tmp_path / EPOCH_END.format(16))
    loop.fit(epochs=5)
    assert checkpoint.best == {"path": tmp_path / EPOCH_END.format(40), "value": 0.5}
    # the two best (0.5, 1.0) and the newest (the best too)
    assert names(tmp_path) == [EPOCH_END.format(16), EPOCH_END.format(40)]

    reset_accelerate()
    fresh = tiny_loop([Checkpoint(dir=tmp_path, monitor="score", signals=None)], eval_data=True)
    assert fresh.load_checkpoint("best") == tmp_path / EPOCH_END.format(40)
    assert all(torch.equal(a, b) for a, b in zip(parameters(fresh), second.params[40]))
    assert fresh.state.global_step == 40


def test_eval_every_evaluations_are_candidates_too(tmp_path):
    checkpoint = Checkpoint(dir=tmp_path, monitor="score", save_top_k=1, every_epoch=False, signals=None)
    # evaluations at 3, 6 (eval_every) and 8 (the epoch's end)
    tiny_loop([Score([2.0, 1.0, 3.0]), checkpoint], eval_data=True).fit(epochs=1, eval_every=3)
    assert checkpoint.best == {"path": tmp_path / "step-00000006", "value": 1.0}
    assert names(tmp_path) == ["step-00000006", EPOCH_END.format(8)]


def test_monitoring_train_loss_logged_on_epoch_without_eval_data(tmp_path):
    class TrainLoss:
        @hookimpl
        def after_step(self, loop, loss):
            loop.log({"train_loss": loss}, on_step=False, on_epoch=True)

    checkpoint = Checkpoint(dir=tmp_path, monitor="train_loss", save_top_k=1, signals=None)
    tiny_loop([TrainLoss(), checkpoint]).fit(epochs=2)
    assert checkpoint.best is not None and checkpoint.best["value"] > 0


def test_a_monitor_missing_from_the_metrics_is_named(tmp_path):
    checkpoint = Checkpoint(dir=tmp_path, monitor="val_acc", signals=None)
    loop = tiny_loop([checkpoint], eval_data=True)
    with pytest.raises(KeyError, match=r"monitors 'val_acc', but the evaluation's metrics are "
                                       r"\['eval_accuracy', 'eval_loss'\]"):
        loop.fit(epochs=1)
    assert loop.state.global_step == 0  # by the sanity check, before any training
    # without the sanity check: at the epoch's end, as before
    loop = tiny_loop([Checkpoint(dir=tmp_path / "b", monitor="val_acc", signals=None)], eval_data=True)
    with pytest.raises(KeyError, match=r"monitors 'val_acc', but the epoch's metrics are "
                                       r"\['eval_accuracy', 'eval_loss'\]"):
        loop.fit(epochs=1, sanity_check=False)


def test_load_checkpoint_best_needs_a_monitor(tmp_path):
    loop = tiny_loop([Checkpoint(dir=tmp_path, signals=None)])
    with pytest.raises(CheckpointError, match=r"needs a Checkpoint\(monitor=...\) plugin"):
        loop.load_checkpoint("best")


# -- run folders ------------------------------------------------------------------------


SCRIPT = textwrap.dedent("""
    import sys
    from accelerate import Accelerator
    from hookloop.plugins import Checkpoint
    from hookloop.testing import tiny_loop

    resume = sys.argv[2] if len(sys.argv) > 2 else None
    loop = tiny_loop([Checkpoint(signals=None)], accelerator=Accelerator(project_dir=sys.argv[1]),
                     resume_from=resume)
    loop.fit(epochs=loop.state.epoch + 1)
    print("resumed", loop.resumed_from)
""")


@pytest.mark.slow  # a script run twice in fresh processes, ~25 s
def test_running_a_script_twice_gives_two_run_folders_and_latest_continues_the_newest(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "project"

    def run(*args):
        result = subprocess.run([sys.executable, str(script), str(out), *args], capture_output=True,
                                text=True, env={"HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD": "1", "PATH": ""})
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    run()
    run()  # from scratch again: a new folder, no "already holds checkpoints"
    folders = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert folders == ["version_0", "version_1"]
    assert (out / "checkpoints" / "version_1" / "latest").read_text().strip() == EPOCH_END.format(8)
    printed = run("latest")  # continues the newest run, in its folder
    assert "version_1/step-00000008-epoch-end" in printed
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["version_0", "version_1"]
    assert names(out / "checkpoints" / "version_1") == [EPOCH_END.format(8), EPOCH_END.format(16)]


def test_an_explicit_dir_holding_another_run_is_still_refused(tmp_path):
    tiny_loop([Checkpoint(dir=tmp_path, signals=None)]).fit(max_steps=2)
    reset_accelerate()
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        tiny_loop([Checkpoint(dir=tmp_path, signals=None)]).fit(max_steps=2)


def test_default_folders_resume_in_process(tmp_path):
    acc = Accelerator(project_dir=str(tmp_path))
    tiny_loop([Checkpoint(signals=None)], accelerator=acc).fit(max_steps=3)
    reset_accelerate()
    loop = tiny_loop([Checkpoint(signals=None)], accelerator=Accelerator(project_dir=str(tmp_path)),
                     resume_from="latest")
    assert loop.resumed_from == tmp_path / "checkpoints" / "version_0" / "step-00000003"
