"""The built-in default ``track-metrics``: every evaluation of a fit and every
epoch's metrics reach the trackers, as Lightning and the Trainer put them
there, with or without a Logger, each once; blocked, none."""

import glob
import json

import pytest
from accelerate import Accelerator

from hookloop import hookimpl
from hookloop.plugins import Logger
from hookloop.trackers import JSONLinesTracker


def points(path):
    """``{key: [(step, value), ...]}`` of a JSON lines tracker's file."""
    got = {}
    if not path.exists():
        return got
    for line in path.read_text().splitlines():
        record = json.loads(line)
        step = record.pop("step", None)
        for key, value in record.items():
            got.setdefault(key, []).append((step, value))
    return got


class Probe:
    """What the run evaluated (not the sanity check) and each epoch's metrics,
    by update; logs ``train_loss`` for the epoch; evaluates on its own once
    (``loop.evaluate()`` from a hook: not the loop's evaluation)."""

    def __init__(self):
        self.evaluations = {}  # update -> metrics of the loop's evaluation there
        self.epochs = {}  # update -> the epoch's metrics with "epoch"
        self._own = False

    @hookimpl
    def after_step(self, loop, loss):
        loop.log({"train_loss": loss}, on_step=False, on_epoch=True)
        if loop.state.global_step == 5:
            self._own = True
            loop.evaluate()
            self._own = False

    @hookimpl
    def on_eval_end(self, loop, metrics):
        if loop.state.stage == "eval" and not self._own:
            self.evaluations[loop.state.global_step] = dict(metrics)

    @hookimpl
    def on_epoch_end(self, loop, epoch, metrics):
        self.epochs[loop.state.global_step] = dict(metrics, epoch=epoch)


def run(tiny_loop, tmp_path, *plugins, block=(), **fit):
    probe = Probe()
    accelerator = Accelerator(log_with=["tensorboard", JSONLinesTracker("run", tmp_path)],
                              project_dir=tmp_path / "tb")
    loop = tiny_loop([*plugins, probe], accelerator=accelerator, eval_data=True, block=["progress", *block])
    loop.fit(**fit)
    probe._own = True
    loop.evaluate()  # outside a fit: not written
    return probe, points(tmp_path / "run.jsonl")


def test_eval_and_epoch_metrics_reach_the_trackers_without_a_logger(tiny_loop, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # 8 updates an epoch: eval_every=3 evaluates at 3, 6, 9, 12, 15; epoch ends at 8 and 16
    probe, got = run(tiny_loop, tmp_path, epochs=2, eval_every=3)
    assert sorted(probe.evaluations) == [3, 6, 8, 9, 12, 15, 16] and sorted(probe.epochs) == [8, 16]
    assert got["eval_loss"] == [(s, pytest.approx(m["eval_loss"])) for s, m in sorted(probe.evaluations.items())]
    assert got["eval_accuracy"] == [(s, pytest.approx(m["eval_accuracy"]))
                                    for s, m in sorted(probe.evaluations.items())]
    for key in ("train_loss", "epoch"):  # the epoch's loop.log(on_epoch=True) values, the epoch
        assert got[key] == [(s, pytest.approx(m[key])) for s, m in sorted(probe.epochs.items())]
    assert sorted(got) == ["epoch", "eval_accuracy", "eval_loss", "train_loss"]
    # TensorBoard holds the same points
    board = {}
    for events in glob.glob(str(tmp_path / "tb" / "**" / "events.out.tfevents.*"), recursive=True):
        accumulator = EventAccumulator(events, size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            board[tag] = [(e.step, pytest.approx(e.value)) for e in accumulator.Scalars(tag)]
    assert board["eval_loss"] == got["eval_loss"] and board["epoch"] == got["epoch"]


def test_with_a_logger_every_metric_is_written_once_and_blocked_none(tiny_loop, tmp_path, capsys):
    probe, got = run(tiny_loop, tmp_path / "logger", Logger(every=4, console=True), epochs=2, eval_every=3)
    for key in ("eval_loss", "epoch", "train_loss"):  # no step twice
        steps = [s for s, _ in got[key]]
        assert len(steps) == len(set(steps)), (key, steps)
    assert [s for s, _ in got["eval_loss"]] == sorted(probe.evaluations)
    assert [s for s, _ in got["loss"]] == [4, 8, 12, 16]  # the Logger's own
    assert capsys.readouterr().out.count("epoch 1 ") == 1  # its console line stays

    _, blocked = run(tiny_loop, tmp_path / "blocked", Logger(every=4, console=False), block=["track-metrics"],
                     epochs=2, eval_every=3)
    assert sorted(blocked) == ["loss", "lr"]


def test_an_epoch_ended_at_an_evaluated_update_writes_its_metrics_once(tiny_loop, tmp_path):
    # max_steps=6 ends the epoch at update 6, whose eval_every evaluation is the epoch's
    probe, got = run(tiny_loop, tmp_path, max_steps=6, eval_every=3)
    assert sorted(probe.epochs) == [6]
    assert [s for s, _ in got["eval_loss"]] == [3, 6]
    assert [s for s, _ in got["epoch"]] == [6] and [s for s, _ in got["train_loss"]] == [6]


def test_a_plugin_that_writes_the_metrics_itself_replaces_the_default(tiny_loop, tmp_path):
    class WritesEvalLoss:
        @hookimpl
        def on_epoch_end(self, loop, metrics):
            loop.log({"eval_loss": -1.0})

    class WritesAll:  # its own way: under other names
        replaces = ("track-metrics",)

        @hookimpl
        def on_epoch_end(self, loop, metrics):
            loop.log({f"val/{k}": v for k, v in metrics.items()})

    _, got = run(tiny_loop, tmp_path / "one", WritesEvalLoss(), epochs=1)
    assert got["eval_loss"] == [(8, -1.0)] and [s for s, _ in got["epoch"]] == [8]  # the plugin's value kept
    _, none = run(tiny_loop, tmp_path / "all", WritesAll(), epochs=1)
    assert "eval_loss" not in none and "epoch" not in none and [s for s, _ in none["val/eval_loss"]] == [8]


def test_without_trackers_it_says_nothing(tiny_loop, capsys):
    tiny_loop(eval_data=True).fit(epochs=1, eval_every=3)
    assert "goes to no tracker" not in capsys.readouterr().err
    assert "track-metrics" in tiny_loop().plugins.names()
