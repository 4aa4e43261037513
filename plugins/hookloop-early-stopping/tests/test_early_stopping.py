"""hookloop-early-stopping: it stops at the right epoch, tested with
hookloop's kit (``tiny_loop``, ``hookloop_recorder``).

Run after installing: ``pip install ./plugins/hookloop-early-stopping`` then
``pytest plugins/hookloop-early-stopping/tests``.
"""

import pytest

from hookloop import hookimpl
from hookloop_early_stopping import EarlyStopping


#: scripted metrics need no data: two batches an epoch keep these tests quick
SHORT = {"n": 16, "batch_size": 8}


class Scripted:
    """Puts a scripted value of ``key`` into the epoch-end metrics. Given in
    ``plugins=[...]`` before the plugin, so it runs first."""

    name = "scripted"

    def __init__(self, key, values):
        self.key, self.values = key, values

    @hookimpl
    def on_epoch_end(self, epoch, metrics):
        metrics[self.key] = self.values[epoch]


def test_stops_after_patience_epochs_without_improvement(tiny_loop, hookloop_recorder):
    # best 1.0, then 0.8 at epoch 1; epochs 2 and 3 do not improve: stop after epoch 3
    values = [1.0, 0.8, 0.9, 0.85, 0.7, 0.6]
    stopper = EarlyStopping(monitor="score", patience=2)
    loop = tiny_loop([Scripted("score", values), stopper, hookloop_recorder], **SHORT)
    loop.fit(epochs=len(values))
    assert [c["epoch"] for c in hookloop_recorder.calls_of("on_epoch_end")] == [0, 1, 2, 3]
    assert loop.state.epoch == 4 and loop.state.global_step == 4 * 2
    assert stopper.stopped_epoch == 3 and (stopper.best, stopper.best_epoch) == (0.8, 1)
    assert loop.state.stop_reason == (
        "early stopping: score did not improve for 2 epoch(s); best 0.8 at epoch 1")
    assert hookloop_recorder.count("on_fit_end") == 1


def test_without_it_the_same_run_goes_on(tiny_loop):
    loop = tiny_loop([Scripted("score", [1.0, 0.8, 0.9, 0.85, 0.7, 0.6])], **SHORT)
    loop.fit(epochs=6)
    assert loop.state.epoch == 6


def test_improvement_resets_the_wait(tiny_loop):
    values = [1.0, 1.1, 0.9, 1.2, 0.8, 0.95, 0.96, 0.97]  # never two bad epochs in a row until 5, 6
    stopper = EarlyStopping(monitor="score", patience=2)
    loop = tiny_loop([Scripted("score", values), stopper], **SHORT)
    loop.fit(epochs=len(values))
    assert stopper.stopped_epoch == 6 and loop.state.epoch == 7


def test_mode_max_and_min_delta(tiny_loop):
    values = [0.50, 0.52, 0.53, 0.60, 0.70]
    strict = EarlyStopping(monitor="acc", mode="max", patience=2, min_delta=0.05)
    loop = tiny_loop([Scripted("acc", values), strict], **SHORT)
    loop.fit(epochs=5)
    assert strict.stopped_epoch == 2 and loop.state.epoch == 3  # +0.02, +0.03 are not enough

    lenient = EarlyStopping(monitor="acc", mode="max", patience=2)
    loop = tiny_loop([Scripted("acc", values), lenient], **SHORT)
    loop.fit(epochs=5)
    assert lenient.stopped_epoch is None and lenient.best == 0.70 and loop.state.epoch == 5


def test_nan_never_improves(tiny_loop):
    stopper = EarlyStopping(monitor="score", patience=2)
    loop = tiny_loop([Scripted("score", [1.0, float("nan"), float("nan"), 0.5]), stopper], **SHORT)
    loop.fit(epochs=4)
    assert stopper.stopped_epoch == 2 and stopper.best == 1.0
    first_nan = EarlyStopping(monitor="score", patience=1)
    loop = tiny_loop([Scripted("score", [float("nan"), 1.0]), first_nan], **SHORT)
    loop.fit(epochs=2)
    assert loop.state.stop_reason == "early stopping: score did not improve for 1 epoch(s); none yet"


def test_on_real_evaluation_metrics(tiny_loop, hookloop_recorder):
    stopper = EarlyStopping(monitor="eval_loss", patience=2, min_delta=0.01)
    loop = tiny_loop([stopper, hookloop_recorder], eval_data=True)
    loop.fit(epochs=40)
    losses = [c["metrics"]["eval_loss"] for c in hookloop_recorder.calls_of("on_epoch_end")]
    # by hand: the first epoch that is the second in a row not below best - 0.01
    best, bad, expected = losses[0], 0, None
    for epoch, value in enumerate(losses[1:], 1):
        if value < best - 0.01:
            best, bad = value, 0
        else:
            bad += 1
        if bad == 2:
            expected = epoch
            break
    assert expected is not None and expected < 39
    assert stopper.stopped_epoch == expected == len(losses) - 1
    assert loop.state.epoch == expected + 1


def test_a_missing_metric_is_named(tiny_loop):
    loop = tiny_loop([EarlyStopping(monitor="eval_acc")], eval_data=True)
    # by the sanity check, before any training
    with pytest.raises(KeyError, match=r"monitors 'eval_acc', but the evaluation's metrics are "
                                        r"\['eval_accuracy', 'eval_loss'\]"):
        loop.fit(epochs=1)
    assert loop.state.global_step == 0
    loop = tiny_loop([EarlyStopping()])
    with pytest.raises(KeyError, match=r"empty \(is eval_data set\?\)"):
        loop.fit(epochs=1)


def test_state_comes_back_from_a_checkpoint(tiny_loop):
    first = EarlyStopping(monitor="score", patience=2)
    loop = tiny_loop([Scripted("score", [1.0, 0.5, 0.7]), first], **SHORT)
    loop.fit(epochs=3)
    assert (first.best, first.wait) == (0.5, 1)

    resumed = EarlyStopping(monitor="score", patience=2)
    resumed.load_state_dict(first.state_dict())
    loop = tiny_loop([Scripted("score", [0.6, 0.6]), resumed], **SHORT)
    loop.fit(epochs=2)
    assert resumed.stopped_epoch == 0 and loop.state.epoch == 1  # one more bad epoch was enough


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "lowest"}, "mode must be 'min' or 'max'"),
    ({"patience": 0}, "patience must be a positive int"),
    ({"min_delta": -1}, "min_delta must be >= 0"),
])
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EarlyStopping(**kwargs)


def test_installed_it_is_switched_on_by_name_with_options(tiny_loop):
    loop = tiny_loop([("early-stopping", {"monitor": "eval_accuracy", "mode": "max"})])
    plugin = loop.plugins.get("early-stopping")
    assert isinstance(plugin, EarlyStopping) and plugin.mode == "max"
    assert "early-stopping" not in tiny_loop().plugins.names()  # installed is not switched on


def test_it_stops_at_the_same_epoch_after_a_resume(tiny_loop, tmp_path):
    """Through hookloop's checkpoint plugin, which saves every plugin that has
    state_dict/load_state_dict under its name."""
    try:
        from hookloop.plugins import Checkpoint
    except ImportError:
        pytest.skip("this hookloop has no checkpoint plugin")
    values = [1.0, 0.5, 0.7, 0.6, 0.4]  # patience 2: epochs 2 and 3 do not improve, stop after 3
    first = EarlyStopping(monitor="score", patience=2)
    tiny_loop([Scripted("score", values), first, Checkpoint(dir=tmp_path, signals=None)],
              **SHORT).fit(epochs=3)
    assert first.stopped_epoch is None and first.wait == 1

    resumed = EarlyStopping(monitor="score", patience=2)
    loop = tiny_loop([Scripted("score", values), resumed, Checkpoint(dir=tmp_path, signals=None)],
                     resume_from="latest", **SHORT)
    loop.fit(epochs=5)
    assert resumed.stopped_epoch == 3 and loop.state.epoch == 4
