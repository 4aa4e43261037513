"""What plugins write: who wrote which key (two plugins writing one is an
error naming both, unless one replaces the other), values checked where
they are written, a misspelt monitor caught by the sanity check, and every
value of one update logged at one step."""

import json

import pytest
import torch
from accelerate import Accelerator

from hookloop import hookimpl
from hookloop.plugins import Checkpoint, Logger
from hookloop.trackers import JSONLinesTracker


class Flag:
    def __init__(self, name=None, key="clip_fraction"):
        if name:
            self.name = name
        self.key = key

    @hookimpl
    def after_step(self, loop):
        loop.log({self.key: 1.0}, on_step=False, on_epoch=True)


def test_a_plugin_knows_its_registered_name(tiny_loop):
    a, b = Flag(), Flag()
    loop = tiny_loop([a, b])
    assert (loop.plugins.name_of(a), loop.plugins.name_of(b)) == ("Flag", "Flag-2")
    assert loop.plugins.name_of(object()) is None


def test_two_instances_logging_one_epoch_key_is_an_error_naming_both(tiny_loop):
    loop = tiny_loop([Flag(), Flag()])
    with pytest.raises(ValueError, match=r"loop.log\(on_epoch=True\) key 'clip_fraction' is written "
                                         r"by plugin 'Flag' and by plugin 'Flag-2'.*name_of\(self\)"):
        loop.fit(epochs=1)


def test_instances_keep_their_values_apart_by_name(tiny_loop):
    class Named(Flag):
        @hookimpl
        def after_step(self, loop):
            loop.log({f"{loop.plugins.name_of(self)}/clip_fraction": 1.0}, on_step=False, on_epoch=True)

    metrics = tiny_loop([Named(), Named()]).fit(epochs=1)
    assert {"Named/clip_fraction", "Named-2/clip_fraction"} <= set(metrics)


def test_the_built_in_metrics_give_way_to_a_plugin_returning_eval_loss_two_plugins_are_an_error(tiny_loop):
    class MyLoss:
        @hookimpl
        def after_eval_step(self, loop, batch, outputs):
            return {"eval_loss": loop.accelerator.gather_for_metrics(outputs.sum(-1) * 0 + 50.0)}

    metrics = tiny_loop([MyLoss()], eval_data=True).fit(epochs=1)  # a default gives way (0.3: an error)
    assert metrics["eval_loss"] == 50.0 and "eval_accuracy" in metrics
    with pytest.raises(ValueError, match=r"after_eval_step value 'eval_loss' is written by plugin "
                                         r"'MyLoss' and by plugin 'MyLoss-2'.*replaces = \('MyLoss',\)"):
        tiny_loop([MyLoss(), MyLoss()], eval_data=True).fit(epochs=1)  # two of the user's: an error

    class Replacing(MyLoss):
        replaces = ("metrics",)  # its eval_loss is the one

    metrics = tiny_loop([Replacing()], eval_data=True).fit(epochs=1)
    assert metrics["eval_loss"] == 50.0 and "eval_accuracy" in metrics  # not averaged with 0.2's


def test_a_batch_mean_from_after_eval_step_is_refused_naming_the_plugin(tiny_loop):
    class Mean:
        @hookimpl
        def after_eval_step(self, loop, outputs):
            return {"eval_mean": outputs.float().mean().reshape(1)}

    with pytest.raises(ValueError, match=r"plugin 'Mean' returned 'eval_mean' as a single value \(a "
                                         r"batch mean\?\)"):
        tiny_loop([Mean()], eval_data=True).fit(epochs=1)


def test_a_tensor_written_into_metrics_is_refused_where_it_is_written(tiny_loop):
    class Tensorish:
        @hookimpl
        def on_eval_end(self, metrics):
            metrics["eval_tensor"] = torch.tensor(1.0)

    with pytest.raises(TypeError, match=r"metrics\['eval_tensor'\] is a torch.Tensor \(plugin "
                                        r"'Tensorish'\): metrics are numbers") as info:
        tiny_loop([Tensorish()], eval_data=True).fit(epochs=1)
    assert info.traceback[-1].name == "_put" and any(e.name == "on_eval_end" for e in info.traceback)

    class Numbers:
        @hookimpl
        def on_epoch_end(self, metrics):
            metrics["epoch_flag"] = 1.0

    metrics = tiny_loop([Numbers()], eval_data=True).fit(epochs=1)
    assert json.loads(json.dumps(metrics))["epoch_flag"] == 1.0  # plain data for the user's json


def test_a_misspelt_monitor_fails_at_the_sanity_check_naming_the_metrics(tiny_loop, tmp_path):
    trained = []

    class Trained:
        @hookimpl
        def after_step(self, loop):
            trained.append(loop.state.global_step)

    loop = tiny_loop([Checkpoint(dir=tmp_path, monitor="val_loss", signals=None), Trained()],
                     eval_data=True)
    with pytest.raises(KeyError, match=r"Checkpoint monitors 'val_loss', but the evaluation's metrics "
                                       r"are \['eval_accuracy', 'eval_loss'\]"):
        loop.fit(epochs=1)
    assert trained == []  # in seconds, before any training
    # a training value (logged with loop.log(on_epoch=True)) is only known at the epoch's end
    loop = tiny_loop([Checkpoint(dir=tmp_path / "b", monitor="train_flag", signals=None),
                      Flag(key="train_flag")], eval_data=True)
    loop.fit(epochs=1)


def test_the_sanity_check_s_metrics_reach_no_checkpoint_nor_logger(tiny_loop, tmp_path):
    seen = []

    class Spy:
        @hookimpl
        def on_eval_end(self, loop, metrics):
            seen.append(loop.state.stage)

    loop = tiny_loop([Spy(), Checkpoint(dir=tmp_path / "ck", monitor="eval_loss", signals=None),
                      Logger(every=100, console=False)], eval_data=True,
                     accelerator=Accelerator(log_with=[JSONLinesTracker("run", tmp_path)]))
    loop.fit(epochs=1)
    assert seen == ["sanity", "eval"]
    records = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [8]  # the epoch's only
    assert loop.plugins.get("checkpoint").best["value"] == records[-1]["eval_loss"]


def test_every_value_of_one_update_is_logged_at_its_number(tiny_loop, tmp_path):
    class Rates:
        @hookimpl
        def after_optimizer_step(self, loop, network):
            loop.log({"rate": network.optimizer.param_groups[0]["lr"]})

    loop = tiny_loop([Rates(), Logger(every=2, console=False)],
                     accelerator=Accelerator(log_with=[JSONLinesTracker("run", tmp_path)]))
    loop.fit(max_steps=4)
    records = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    rate_steps = [r["step"] for r in records if "rate" in r]
    loss_steps = [r["step"] for r in records if "loss" in r]
    assert rate_steps == [1, 2, 3, 4] and loss_steps == [2, 4]  # update 2's rate and loss: step 2


def test_train_loss_is_the_epoch_s_mean_training_loss(tiny_loop):
    from hookloop.testing import HookRecorder

    recorder = HookRecorder(hooks=["after_step"])
    metrics = tiny_loop([recorder, "train-loss"]).fit(epochs=1)
    losses = [call["loss"].item() for call in recorder.calls_of("after_step")]
    assert metrics["train_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-12)
    assert "train_loss" not in tiny_loop().fit(epochs=1)  # not a default: nothing per step


def test_a_plugin_that_changes_the_evaluation_batch_in_place_is_named(tiny_loop):
    class Relabel:  # 0.3: accuracy 0.81 -> 0.34, silently
        @hookimpl
        def after_eval_step(self, batch):
            batch[1].fill_(1)

    loop = tiny_loop([Relabel()], eval_data=True)
    with pytest.raises(ValueError, match=r"after_eval_step: plugin 'Relabel' changed the evaluation batch "
                                         r"in place \(tensor #1 of shape \[8\] of the batch\).*clone") as info:
        loop.fit(epochs=1)
    assert "'after_eval_step' of plugin 'Relabel'" in info.value.__notes__[0]


def test_a_metric_that_is_not_there_lists_the_metrics_and_names_lightning_s_val_loss(tiny_loop):
    seen = []

    class Lightning:
        @hookimpl
        def on_epoch_end(self, metrics):
            try:
                metrics["val_loss"]
            except KeyError as exc:
                seen.append(str(exc))

    tiny_loop([Lightning()], eval_data=True).fit(epochs=1)
    assert "there is no such metric here; the metrics are ['eval_accuracy', 'eval_loss']" in seen[0]
    assert "hookloop names it 'eval_loss' (Lightning's 'val_loss')" in seen[0]
