"""loop.log from any plugin, trackers owned by the loop, several instances of
one plugin class."""

import json

import pytest
import torch
from accelerate import Accelerator

from hookloop import hookimpl
from hookloop.plugins import GradClip, Logger
from hookloop.testing import tiny_gan_loop
from hookloop.trackers import JSONLinesTracker


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def jsonl(tmp_path, **kwargs):
    return Accelerator(log_with=[JSONLinesTracker("run", tmp_path)], **kwargs)


def test_a_plugin_logs_without_the_logger_and_the_loop_owns_the_trackers(tiny_loop, tmp_path):
    class LogNorm:
        @hookimpl
        def after_step(self, loop, loss):
            if loop.state.global_step % 4 == 0:
                loop.log({"my_loss": loss})

    loop = tiny_loop([LogNorm()], accelerator=jsonl(tmp_path))
    loop.fit(epochs=1)
    got = [(r["step"], sorted(r)) for r in records(tmp_path / "run.jsonl") if "step" in r]
    assert got == [(4, ["my_loss", "step"]), (8, ["my_loss", "step"])]
    assert loop.accelerator.trackers == []  # finished at the end of the fit


def test_the_trackers_are_finished_when_the_fit_fails(tiny_loop, tmp_path):
    finished = []

    class Boom:
        @hookimpl
        def after_step(self, loop):
            loop.log({"x": 1.0})
            for tracker in loop.accelerator.trackers:
                tracker.finish = lambda: finished.append(True)
            raise RuntimeError("boom")

    loop = tiny_loop([Boom()], accelerator=jsonl(tmp_path))
    with pytest.raises(RuntimeError, match="boom"):
        loop.fit(epochs=1)
    assert finished == [True] and loop.accelerator.trackers == []


def test_without_trackers_an_on_step_value_is_never_read(tiny_loop):
    class Unreadable(torch.Tensor):
        def item(self):
            raise AssertionError("read")

    class LogIt:
        @hookimpl
        def after_step(self, loop, loss):
            loop.log({"loss": loss.as_subclass(Unreadable)})

    tiny_loop([LogIt()]).fit(max_steps=2)  # no tracker configured: nothing converted


def test_on_epoch_values_are_reduced_into_the_epoch_metrics(tiny_loop):
    seen = {}

    class TrainLoss:
        @hookimpl
        def after_step(self, loop, loss):
            loop.log({"train_loss": loss, "steps": 1.0, "worst": loss}, on_step=False, on_epoch=True)
            loop.log({"steps_sum": 1.0}, on_step=False, on_epoch=True, reduce="sum")
            seen.setdefault(loop.state.epoch, []).append(loss.item())

        @hookimpl
        def on_eval_end(self, metrics):
            seen["eval_end_keys"] = sorted(metrics)

    loop = tiny_loop([TrainLoss()], eval_data=True)
    metrics = loop.fit(epochs=2)
    assert metrics["train_loss"] == pytest.approx(sum(seen[1]) / 8)
    assert metrics["steps_sum"] == 8 and metrics["steps"] == 1.0
    assert {"train_loss", "eval_loss", "eval_accuracy"} <= set(seen["eval_end_keys"])


def test_max_and_min_over_an_epoch_and_a_conflicting_reduction_is_named(tiny_loop):
    class Extremes:
        @hookimpl
        def after_step(self, loop):
            step = float(loop.state.global_step)
            loop.log({"hi": torch.tensor(step)}, on_step=False, on_epoch=True, reduce="max")
            loop.log({"lo": step}, on_step=False, on_epoch=True, reduce="min")

    metrics = tiny_loop([Extremes()]).fit(epochs=1)
    assert (metrics["hi"], metrics["lo"]) == (8.0, 1.0)

    class Conflict:
        @hookimpl
        def after_step(self, loop):
            loop.log({"x": 1.0}, on_step=False, on_epoch=True,
                     reduce="max" if loop.state.global_step % 2 else "mean")

    with pytest.raises(ValueError, match=r"'x' was logged with reduce='max' this epoch and now with reduce='mean'"):
        tiny_loop([Conflict()]).fit(epochs=1)


def test_early_stopping_can_monitor_train_loss_logged_on_epoch(tiny_loop):
    class TrainLoss:
        @hookimpl
        def after_step(self, loop, loss):
            loop.log({"train_loss": loss}, on_step=False, on_epoch=True)

    class StopWhenBelow:  # what an early-stopping plugin monitors
        def __init__(self):
            self.values = []

        @hookimpl
        def on_epoch_end(self, loop, metrics):
            self.values.append(metrics["train_loss"])
            if len(self.values) == 2:
                loop.stop("two epochs seen")

    monitor = StopWhenBelow()
    loop = tiny_loop([TrainLoss(), monitor])  # no eval_data: the metrics are the train ones
    loop.fit(epochs=5)
    assert len(monitor.values) == 2 and loop.state.epoch == 2


def test_the_logger_logs_every_param_group(tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    from hookloop import Loop

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD([{"params": model[0].parameters()},
                                 {"params": model[1].parameters(), "lr": 0.5}], lr=0.1)
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=4)
    loop = Loop(model=model, optimizer=optimizer, train_data=data, accelerator=jsonl(tmp_path),
                plugins=[Logger(every=4, console=False)], block=["progress"])
    loop.fit(epochs=1)
    logged = [r for r in records(tmp_path / "run.jsonl") if "loss" in r]
    assert [r["step"] for r in logged] == [4, 8]
    assert (logged[0]["lr"], logged[0]["lr/group1"]) == (0.1, 0.5)


def test_two_loggers_write_at_their_own_intervals(tiny_loop, tmp_path):
    loop = tiny_loop([Logger(every=8, console=False), Logger(every=2, console=False)],
                     accelerator=jsonl(tmp_path))
    assert {"logger", "logger-2"} <= set(loop.plugins.names())
    loop.fit(epochs=1)
    rows = records(tmp_path / "run.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [8]  # every 8 updates
    assert [r["step"] for r in rows if "logger-2/loss" in r] == [2, 4, 6, 8]  # its own key


def test_instances_are_named_in_order_and_by_name_takes_a_name(tiny_loop):
    class Plain:
        @hookimpl
        def on_fit_start(self):
            pass

    loop = tiny_loop([Plain(), Plain(), ("logger", {"name": "fast", "every": 2}), "logger",
                      Plain()])
    names = set(loop.plugins.names())
    assert {"Plain", "Plain-2", "Plain-3", "fast", "logger"} <= names
    assert loop.plugins.get("fast").every == 2
    again = tiny_loop([Plain(), Plain(), ("logger", {"name": "fast", "every": 2}), "logger", Plain()])
    assert set(again.plugins.names()) == names  # the same script, the same names


def test_one_gradclip_per_gan_network():
    clips = [GradClip(max_norm=0.01, networks=["generator"]),
             GradClip(max_norm=100.0, networks=["discriminator"])]
    loop = tiny_gan_loop(clips)
    assert {"gradclip", "gradclip-2"} <= set(loop.plugins.names())
    loop.fit(max_steps=2)
    g, d = loop.networks["generator"].grad_norm, loop.networks["discriminator"].grad_norm
    assert g is not None and d is not None


def test_each_instance_s_state_comes_back_to_it_on_resume(tiny_loop, tmp_path):
    from hookloop.plugins import Checkpoint

    class Counter:
        def __init__(self, every):
            self.every, self.count = every, 0

        @hookimpl
        def after_step(self, loop):
            if loop.state.global_step % self.every == 0:
                self.count += 1

        def state_dict(self):
            return {"count": self.count}

        def load_state_dict(self, state):
            self.count = state["count"]

    tiny_loop([Counter(1), Counter(2), Checkpoint(dir=tmp_path, signals=None)]).fit(max_steps=4)
    a, b = Counter(1), Counter(2)
    tiny_loop([a, b, Checkpoint(dir=tmp_path, signals=None)], resume_from="latest")
    assert (a.count, b.count) == (4, 2)


def test_hookloop_plugins_shows_the_instances_a_list_of_names_gets(capsys):
    from hookloop.cli import main

    assert main(["plugins", "logger", "logger", 'logger={"name": "fast", "every": 2}', "gradclip=" +
                 '{"max_norm": 1.0}']) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["logger", "logger-2", "fast", "gradclip"]


def test_loop_log_without_a_tracker_says_once_where_the_values_go(tiny_loop, capsys):
    class Logs:
        @hookimpl
        def after_step(self, loop):
            loop.log({"a": 1.0})

    tiny_loop([Logs()]).fit(max_steps=5)  # 0.3: dropped, silently
    err = capsys.readouterr().err
    assert err.count("goes to no tracker") == 1
    assert "loop.log('a'...) goes to no tracker: none is configured. Accelerator(log_with='tensorboard'" in err


def test_a_logger_printing_its_values_is_not_told_they_go_to_no_tracker(tiny_loop, capsys):
    """0.4: Logger(console=True) printed every value and was still told that
    loop.log "goes to no tracker". What no plugin prints is still said once."""
    tiny_loop([Logger(every=2)]).fit(max_steps=4)
    out, err = capsys.readouterr()
    assert "step 2 loss" in out and "step 4 loss" in out
    assert "goes to no tracker" not in err

    tiny_loop([Logger(every=2, console=False)]).fit(max_steps=4)  # printed nowhere: said
    out, err = capsys.readouterr()
    assert "step 2 loss" not in out and err.count("loop.log('loss', 'lr'...) goes to no tracker") == 1

    class Logs:
        @hookimpl
        def after_step(self, loop):
            loop.log({"a": 1.0})

    tiny_loop([Logger(every=2), Logs()]).fit(max_steps=4)  # the Logger's printed, Logs' not
    assert capsys.readouterr().err.count("loop.log('a'...) goes to no tracker") == 1


def test_without_a_tracker_the_message_says_the_progress_lines_show_the_values(tiny_loop, capsys):
    class Logs:
        @hookimpl
        def after_step(self, loop):
            loop.log({"seen": float(loop.state.global_step)})

    tiny_loop([Logs()], block=[]).fit(max_steps=3)  # stderr is no terminal here: progress lines
    err = capsys.readouterr().err
    assert err.count("goes to no tracker") == 1
    told = next(line for line in err.splitlines() if "goes to no tracker" in line)
    assert told.endswith("; meanwhile the latest values are shown on the progress lines"), told
    assert "loss " in err and " seen 3 |" in err  # and so they are
