"""Lightning's common callbacks as hookloop built-ins (issue 12, item 5):
LearningRateMonitor, Timer, ThroughputMonitor, ModelSummary, LambdaCallback,
GradientAccumulationScheduler; and the guide's "Lightning callbacks in
hookloop" section, whose snippets run here."""

import json
import re

import launching
import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, hookimpl
from hookloop.errors import PluginValidationError
from hookloop.plugins import (
    BUILTINS, Checkpoint, GradientAccumulationScheduler, LambdaCallback, LearningRateMonitor,
    ModelSummary, ThroughputMonitor, Timer,
)
from hookloop.testing import parameters, registered, tiny_gan_loop
from hookloop.trackers import JSONLinesTracker
from paths import ROOT, SCRIPTS  # noqa: F401

GUIDE = ROOT / "docs" / "plugins.md"


def jsonl(tmp_path, **kwargs):
    return Accelerator(log_with=[JSONLinesTracker("run", tmp_path)], **kwargs)


def records(tmp_path):
    path = tmp_path / "run.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def logged(tmp_path, key):
    """``[(step, value)]`` of every record holding ``key``."""
    return [(r["step"], r[key]) for r in records(tmp_path) if key in r]


class Clock:
    """A fake clock that a test advances, in place of one plugin module's
    ``time.monotonic`` / ``time.perf_counter``."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def clocked(monkeypatch, module):
    clock = Clock()
    monkeypatch.setattr(f"hookloop.plugins.{module}._now", clock)
    return clock


def every_batch(clock, seconds):
    """A plugin advancing ``clock`` by ``seconds`` per trained batch (before the others see it)."""
    def tick():
        clock.now += seconds
    return LambdaCallback(name="tick", after_step=tick)


def test_every_new_plugin_is_a_built_in_by_name_and_declares_what_it_changes():
    expected = {"lr-monitor": (LearningRateMonitor, False), "timer": (Timer, True),
                "throughput": (ThroughputMonitor, False), "model-summary": (ModelSummary, False),
                "accumulation-scheduler": (GradientAccumulationScheduler, True),
                "lambda": (LambdaCallback, None)}
    for name, (cls, changes) in expected.items():
        assert BUILTINS[name] is cls and cls.name == name
        assert getattr(cls, "changes_training", None) is changes, name


# -- LearningRateMonitor ------------------------------------------------------------------------


def two_group_loop(plugins, accelerator, gamma=0.5, momentum=0.9, names=(None, None)):
    """SGD with two param groups (lr 0.1 and 0.01), the rate halved at every update."""
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    groups = [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[2].parameters(), "lr": 0.01}]
    for group, name in zip(groups, names):
        if name:
            group["name"] = name
    optimizer = torch.optim.SGD(groups, lr=0.1, momentum=momentum, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=gamma)
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    train = DataLoader(TensorDataset(x, y), batch_size=8)
    return Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=train,
                plugins=plugins, accelerator=accelerator, block=["progress"])


def test_lr_monitor_logs_each_param_group_at_every_update_under_lightnings_names(tmp_path):
    used = []

    class SeeRates:  # the rates each update really uses
        @hookimpl
        def after_optimizer_step(self, network):
            used.append([g["lr"] for g in network.optimizer.param_groups])

    monitor = LearningRateMonitor(log_momentum=True, log_weight_decay=True)
    two_group_loop([monitor, SeeRates()], jsonl(tmp_path)).fit(max_steps=3)
    # at step N: the rate update N uses (the update's own number, as every value
    # logged while it trains; Lightning logs it at N - 1)
    assert logged(tmp_path, "lr-SGD/pg1") == [(1, 0.1), (2, 0.05), (3, 0.025)]
    assert logged(tmp_path, "lr-SGD/pg2") == [(1, 0.01), (2, 0.005), (3, 0.0025)]
    assert [v for _, v in logged(tmp_path, "lr-SGD/pg1")] == [u[0] for u in used]
    assert logged(tmp_path, "lr-SGD/pg1-momentum") == [(1, 0.9), (2, 0.9), (3, 0.9)]
    assert logged(tmp_path, "lr-SGD/pg2-weight_decay")[0] == (1, 1e-4)
    assert monitor.lrs == {"lr-SGD/pg1": [0.1, 0.05, 0.025], "lr-SGD/pg2": [0.01, 0.005, 0.0025]}


def test_lr_monitor_names_groups_by_their_name_key_and_logs_every_n_or_per_epoch(tmp_path):
    two_group_loop([LearningRateMonitor(every=2, log_key_prefix="optim/")], jsonl(tmp_path),
                   names=("backbone", "head")).fit(max_steps=5)
    assert [s for s, _ in logged(tmp_path, "optim/lr-SGD/backbone")] == [1, 3, 5]
    assert logged(tmp_path, "optim/lr-SGD/head") == [(1, 0.01), (3, 0.0025), (5, 0.000625)]

    from hookloop.testing import reset_accelerate

    reset_accelerate()
    (tmp_path / "run.jsonl").unlink()
    # 4 updates per epoch; one log at each epoch start, of the rate its first update uses
    two_group_loop([LearningRateMonitor(logging_interval="epoch")], jsonl(tmp_path)).fit(epochs=3)
    assert logged(tmp_path, "lr-SGD/pg1") == [(0, 0.1), (4, 0.1 * 0.5 ** 4), (8, 0.1 * 0.5 ** 8)]


def test_lr_monitor_tells_two_optimizers_of_one_class_apart(tmp_path):
    loop = tiny_gan_loop([LearningRateMonitor()], accelerator=jsonl(tmp_path))
    loop.fit(max_steps=2)
    assert [s for s, _ in logged(tmp_path, "lr-Adam")] == [1, 2]  # the generator, first network
    assert [s for s, _ in logged(tmp_path, "lr-Adam-1")] == [1, 2]

    from hookloop.testing import reset_accelerate

    reset_accelerate()
    (tmp_path / "run.jsonl").unlink()
    tiny_gan_loop([LearningRateMonitor(name_by="network")], accelerator=jsonl(tmp_path)).fit(max_steps=1)
    assert logged(tmp_path, "lr-generator") == [(1, 1e-3)]
    assert logged(tmp_path, "lr-discriminator") == [(1, 1e-3)]


def test_lr_monitor_without_a_tracker_warns_and_keeps_the_rates(tiny_loop):
    monitor = LearningRateMonitor()
    with pytest.warns(RuntimeWarning, match="no tracker"):
        tiny_loop([monitor]).fit(max_steps=2)
    assert len(monitor.lrs["lr-Adam"]) == 2
    with pytest.raises(ValueError, match="logging_interval"):
        LearningRateMonitor(logging_interval="batch")


# -- Timer ---------------------------------------------------------------------------------------


def test_timer_stops_at_the_first_update_past_the_duration(tiny_loop, monkeypatch):
    clock = clocked(monkeypatch, "timer")
    timer = Timer(duration="00:00:00:05", verbose=True)
    loop = tiny_loop([every_batch(clock, 1.0), timer], eval_data=True)
    metrics = loop.fit(epochs=10)
    assert loop.state.global_step == 5 and timer.stopped_at == 5
    assert loop.state.stop_reason.startswith("timer: time limit 0:00:05 reached")
    assert "eval_loss" in metrics  # a stop ends the epoch: its evaluation ran
    assert timer.time_elapsed() == pytest.approx(5.0)
    assert timer.time_remaining() == 0.0 and timer.duration == 5.0


def test_timer_with_interval_epoch_lets_the_epoch_finish(tiny_loop, monkeypatch):
    clock = clocked(monkeypatch, "timer")
    timer = Timer(duration=timedelta_seconds(5), interval="epoch")
    loop = tiny_loop([every_batch(clock, 1.0), timer])  # 8 updates an epoch
    loop.fit(epochs=10)
    assert loop.state.global_step == 8 and loop.state.epoch == 1
    assert timer.time_elapsed() == pytest.approx(8.0) and timer.time_remaining() == 0.0


def timedelta_seconds(s):
    from datetime import timedelta

    return timedelta(seconds=s)


def test_timer_elapsed_time_survives_a_resume_and_counts_on(tiny_loop, tmp_path, monkeypatch):
    clock = clocked(monkeypatch, "timer")
    checkpoint = Checkpoint(dir=tmp_path, every_steps=3, every_epoch=False, signals=None)
    timer = Timer(duration={"seconds": 7})
    tiny_loop([every_batch(clock, 1.0), timer, checkpoint]).fit(max_steps=3)
    assert timer.time_elapsed() == pytest.approx(3.0)

    clock.now += 3600  # the restarted job: another process, much later
    resumed_timer = Timer(duration={"seconds": 7})
    loop = tiny_loop([every_batch(clock, 1.0), resumed_timer,
                      Checkpoint(dir=tmp_path, every_steps=3, every_epoch=False, signals=None)],
                     resume_from="latest")
    assert resumed_timer.time_elapsed() == pytest.approx(3.0)
    assert resumed_timer.time_remaining() == pytest.approx(4.0)
    loop.fit(epochs=10)
    assert loop.state.global_step == 7  # 3 before, 4 after the resume
    assert resumed_timer.time_elapsed() == pytest.approx(7.0)


def test_a_timer_already_used_up_stops_before_the_first_step(tiny_loop, monkeypatch):
    clocked(monkeypatch, "timer")
    timer = Timer(duration={"seconds": 10})
    timer.load_state_dict({"time_elapsed": {"train": 11.0, "eval": 0.0}})
    loop = tiny_loop([timer])
    assert loop.fit(epochs=1) == {} and loop.state.global_step == 0


def test_timer_counts_the_fits_of_a_run_together_and_evaluations_apart(tiny_loop, monkeypatch):
    clock = clocked(monkeypatch, "timer")

    class SlowEval:
        @hookimpl
        def after_eval_step(self):
            clock.now += 10.0

    timer = Timer()  # no limit: it only measures
    loop = tiny_loop([every_batch(clock, 1.0), SlowEval(), timer], eval_data=True)
    loop.fit(max_steps=4, sanity_check=False)
    loop.fit(max_steps=8, sanity_check=False)
    # 8 updates, and one evaluation of 2 batches at the stop of each fit
    assert timer.time_elapsed() == pytest.approx(8.0 + 2 * 20.0)
    assert timer.time_elapsed("eval") == pytest.approx(40.0)
    assert timer.time_remaining() is None and loop.state.global_step == 8


def test_timer_refuses_a_malformed_duration():
    assert Timer(duration="01:02:03:04").duration == 86400 + 2 * 3600 + 3 * 60 + 4
    with pytest.raises(ValueError, match="DD:HH:MM:SS"):
        Timer(duration="12:00")
    with pytest.raises(ValueError, match="interval"):
        Timer(duration="00:00:01:00", interval="batch")


@pytest.mark.slow
def test_timer_stops_every_process_at_the_same_update_when_their_clocks_differ(tmp_path):
    """Rank 1's clock runs three times faster: alone it would stop at update 2
    and leave rank 0 waiting in its next all-reduce. The main process decides."""
    result = launching.run_two("timer_two_processes.py", tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"timer-{r}.json").read_text()) for r in (0, 1)]
    assert [r["global_step"] for r in ranks] == [5, 5]
    assert all(r["stop_reason"].startswith("timer:") for r in ranks)


# -- ThroughputMonitor ----------------------------------------------------------------------------


def test_throughput_logs_samples_and_batches_per_second_over_its_window(tiny_loop, tmp_path, monkeypatch):
    clock = clocked(monkeypatch, "throughput")
    monitor = ThroughputMonitor(every=2, window=4)
    # 8 batches of 8 examples an epoch; each batch takes 0.5 s, then 0.25 s from update 4 on
    speed = LambdaCallback(name="speed", after_step=lambda loop: setattr(
        clock, "now", clock.now + (0.5 if loop.state.global_step <= 4 else 0.25)))
    loop = tiny_loop([speed, monitor], accelerator=jsonl(tmp_path))
    loop.fit(max_steps=8)
    assert logged(tmp_path, "train/device/batches_per_sec") == [(2, 2.0), (4, 2.0), (6, 8 / 3), (8, 4.0)]
    assert logged(tmp_path, "train/device/samples_per_sec") == [(2, 16.0), (4, 16.0), (6, 64 / 3), (8, 32.0)]
    assert logged(tmp_path, "train/samples") == [(2, 16), (4, 32), (6, 48), (8, 64)]
    assert logged(tmp_path, "train/time")[-1] == (8, pytest.approx(3.0))
    assert "train/batches_per_sec" not in monitor.last  # one process: device values only


def test_throughput_leaves_out_evaluations_and_counts_items_and_flops(tiny_loop, tmp_path, monkeypatch):
    clock = clocked(monkeypatch, "throughput")

    class SlowEval:
        @hookimpl
        def after_eval_step(self):
            clock.now += 100.0

    monitor = ThroughputMonitor(batch_size_fn=lambda batch: 4, length_fn=lambda batch: batch[0].numel(),
                                every=4, window=4, flops_per_batch=1000, available_flops=1e5)
    loop = tiny_loop([every_batch(clock, 0.5), SlowEval(), monitor], eval_data=True)
    loop.fit(max_steps=12, eval_every=2, sanity_check=False)  # 4 evaluations inside the epochs, 2 at their ends
    assert monitor.last["train/time"] == pytest.approx(6.0)
    assert monitor.last["train/device/batches_per_sec"] == pytest.approx(2.0)
    assert monitor.last["train/device/samples_per_sec"] == pytest.approx(8.0)  # batch_size_fn: 4
    assert monitor.last["train/device/items_per_sec"] == pytest.approx(2.0 * 8 * 8)  # 8x8 inputs a batch
    assert monitor.last["train/device/flops_per_sec"] == pytest.approx(2000.0)
    assert monitor.last["train/device/mfu"] == pytest.approx(0.02)


def test_throughput_synchronises_only_where_it_logs(tiny_loop, monkeypatch):
    syncs = []
    monitor = ThroughputMonitor(every=4)
    monkeypatch.setattr(monitor, "_sync", lambda: syncs.append(True))
    tiny_loop([monitor]).fit(epochs=2)  # 16 updates: 4 logs, 2 epoch ends
    assert len(syncs) == 4 + 2


def test_throughput_names_itself_when_a_batch_holds_no_tensor():
    from hookloop.plugins.throughput import _batch_size

    assert _batch_size({"text": ["a", "b"], "input_ids": torch.zeros(3, 5)}) == 3
    with pytest.raises(TypeError, match=r"ThroughputMonitor: no tensor .*batch_size_fn"):
        _batch_size({"text": ["a", "b"]})


# -- ModelSummary ---------------------------------------------------------------------------------


def test_model_summary_prints_the_layers_and_totals_on_fit_start(tiny_loop, capsys):
    summary = ModelSummary()
    tiny_loop([summary]).fit(max_steps=1)
    out = capsys.readouterr().out
    assert summary.rows == [("0", "Linear", 144, 144, "train"), ("1", "ReLU", 0, 0, "train"),
                            ("2", "Dropout", 0, 0, "train"), ("3", "Linear", 51, 51, "train")]
    assert summary.text in out
    lines = out.splitlines()
    assert lines[0].split("|")[1:] == [" Name ", " Type    ", " Params ", " Trainable ", " Mode"]
    assert "195       Trainable params" in lines and "195       Total params" in lines
    assert "0         Non-trainable params" in lines


def test_model_summary_depth_frozen_parameters_and_several_networks(tiny_loop, capsys):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Sequential(torch.nn.Linear(2, 2000), torch.nn.Linear(2000, 1))

        def forward(self, x):
            return self.inner(x)

    summary = ModelSummary(max_depth=-1)
    loop = tiny_loop([summary])
    model = Block()
    model.inner[0].requires_grad_(False)
    from types import SimpleNamespace

    fake = SimpleNamespace(networks={"model": SimpleNamespace(unwrapped=model)})
    text = summary.summarize(fake)
    assert [r[0] for r in summary.rows] == ["inner", "inner.0", "inner.1"]
    assert summary.rows[0][2:4] == (8001, 2001)
    assert "6.0 K     Non-trainable params" in text and "8.0 K     Total params" in text
    assert "2.0 K     Trainable params" in text

    ModelSummary(max_depth=0).on_fit_start(loop)  # 0: nothing
    assert capsys.readouterr().out == ""
    gan = ModelSummary()
    tiny_gan_loop([gan]).fit(max_steps=1)
    assert [r[0] for r in gan.rows] == ["generator.0", "generator.1", "generator.2",
                                        "discriminator.0", "discriminator.1", "discriminator.2"]


# -- LambdaCallback -------------------------------------------------------------------------------


def test_lambda_callback_runs_functions_by_hookloop_and_lightning_names(tiny_loop):
    seen = []
    callback = LambdaCallback(
        on_train_epoch_start=lambda epoch: seen.append(("epoch", epoch)),
        on_train_batch_end=lambda loop, loss: seen.append(("batch", loop.state.global_step)),
        on_epoch_end=lambda metrics: seen.append(("metrics", sorted(metrics))),
        setup=lambda: seen.append("setup"),
        on_fit_start=lambda loop: seen.append("fit_start"),
    )
    tiny_loop([callback], eval_data=True).fit(max_steps=3, sanity_check=False)
    assert seen == ["setup", "fit_start", ("epoch", 0), ("batch", 1), ("batch", 2), ("batch", 3),
                    ("metrics", ["eval_accuracy", "eval_loss"])]


def test_lambda_callback_errors_list_the_valid_choices(tiny_loop):
    with pytest.raises(PluginValidationError, match=r"'on_batch_end' is not a hook\. hookloop hooks: "
                                                    r"on_loop_start, .*on_fit_start, .*Lightning names "
                                                    r"accepted: setup"):
        LambdaCallback(on_batch_end=lambda: None)
    with pytest.raises(PluginValidationError, match=r"'on_save_checkpoint' is Lightning's name .*state_dict"):
        LambdaCallback(on_save_checkpoint=lambda: None)
    with pytest.raises(PluginValidationError, match=r"asks for 'trainer', .*Valid arguments: loop, batch, "
                                                    r"outputs, loss"):
        LambdaCallback(on_train_batch_end=lambda trainer, pl_module: None)
    with pytest.raises(PluginValidationError, match="whose result the loop uses"):
        LambdaCallback(after_eval_step=lambda: None, on_validation_batch_end=lambda: None)


def test_lambda_callbacks_are_numbered_answer_firstresult_hooks_and_take_kwargs(tiny_loop):
    calls = []
    first = LambdaCallback(after_step=lambda **kw: calls.append(sorted(kw)))
    scaled = LambdaCallback(compute_loss=lambda outputs, batch: torch.nn.functional.cross_entropy(
        outputs, batch[1]) * 0.0, changes_training=True)
    loop = tiny_loop([first, scaled])
    before = parameters(loop)
    loop.fit(max_steps=2)
    assert loop.plugins.get("lambda") is first and loop.plugins.get("lambda-2") is scaled
    assert calls[0] == ["batch", "loop", "loss", "outputs"] and len(calls) == 2
    # a zero loss: no gradient, Adam does not move
    assert all(torch.equal(a, b) for a, b in zip(before, parameters(loop)))
    assert scaled.changes_training is True and not hasattr(first, "changes_training")


# -- GradientAccumulationScheduler --------------------------------------------------------------------


class UpdatesAt:
    """(epoch, batch in epoch) of every optimizer update."""

    def __init__(self):
        self.at = []

    @hookimpl
    def before_optimizer_step(self, loop):
        self.at.append((loop.state.epoch, loop.state.step_in_epoch))


def test_accumulation_scheduler_makes_the_updates_on_the_expected_batches(tiny_loop):
    updates = UpdatesAt()
    # 8 batches an epoch: every batch, then every 2nd, then every 3rd (the last group of 2)
    loop = tiny_loop([GradientAccumulationScheduler({1: 2, 2: 3}), updates])
    loop.fit(epochs=3)
    assert updates.at == ([(0, b) for b in range(1, 9)] + [(1, b) for b in (2, 4, 6, 8)]
                          + [(2, b) for b in (3, 6, 8)])
    assert loop.state.global_step == 8 + 4 + 3


def test_accumulation_scheduler_trains_as_the_accelerator_s_own_accumulation(tiny_loop):
    scheduled = tiny_loop([GradientAccumulationScheduler({0: 2})])
    scheduled.fit(epochs=2)
    from hookloop.testing import reset_accelerate

    reset_accelerate()
    fixed = tiny_loop(accelerator=Accelerator(gradient_accumulation_steps=2))
    fixed.fit(epochs=2)
    assert scheduled.state.global_step == fixed.state.global_step == 8
    assert all(torch.equal(a, b) for a, b in zip(parameters(scheduled), parameters(fixed)))


def test_accumulation_scheduler_refuses_a_second_source_and_bad_schedules(tiny_loop):
    loop = tiny_loop([GradientAccumulationScheduler({0: 2, 3: 4})],
                     accelerator=Accelerator(gradient_accumulation_steps=4))
    with pytest.raises(ValueError, match=r"GradientAccumulationScheduler\(\{0: 4, \.\.\.\}\)"):
        loop.fit(epochs=1)
    assert GradientAccumulationScheduler({2: 4}).get_accumulate_grad_batches(1) == 1
    for bad in ({}, {-1: 2}, {0: 0}, {0: 1.5}):
        with pytest.raises(ValueError, match="GradientAccumulationScheduler"):
            GradientAccumulationScheduler(bad)


# -- the guide's section, docs/plugins.md ---------------------------------------------------------


def guide_blocks():
    text = GUIDE.read_text()
    section = text.split("\n## Lightning callbacks in hookloop\n", 1)[1].split("\n## ", 1)[0]
    return section, re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_guide_s_table_names_every_lightning_callback_and_every_new_built_in():
    section, _ = guide_blocks()
    for callback in ("ModelCheckpoint", "EarlyStopping", "LearningRateMonitor", "Timer", "ModelSummary",
                     "RichModelSummary", "ThroughputMonitor", "StochasticWeightAveraging",
                     "GradientAccumulationScheduler", "LambdaCallback", "BackboneFinetuning",
                     "BatchSizeFinder", "DeviceStatsMonitor", "ModelPruning", "RichProgressBar",
                     "TQDMProgressBar", "BasePredictionWriter", "OnExceptionCheckpoint", "SpikeDetection"):
        assert re.search(rf"^\| `{callback}[(`]", section, flags=re.M) or f", `{callback}`" in section, callback
    # the early-stopping distribution is named by its entry point
    toml = (ROOT / "plugins" / "hookloop-early-stopping" / "pyproject.toml").read_text()
    entry = re.search(r"\[project.entry-points.hookloop\]\n(\S+) =", toml).group(1)
    assert f'("{entry}", {{"monitor"' in section
    readme = (ROOT / "docs" / "guide.md").read_text().split("## Built-in plugins", 1)[1].split("\n## ", 1)[0]
    for name, cls in BUILTINS.items():
        if cls in (GradientAccumulationScheduler, LambdaCallback, LearningRateMonitor, ModelSummary,
                   ThroughputMonitor, Timer):
            assert f"| `{name}` | `hookloop.plugins.{cls.__name__}" in readme, name


def test_the_guide_s_device_stats_monitor_logs_memory(tiny_loop, tmp_path):
    _, blocks = guide_blocks()
    namespace = {}
    exec(compile(blocks[0], "docs/plugins.md:device-stats", "exec"), namespace)
    tiny_loop([namespace["DeviceStatsMonitor"](every=2)], accelerator=jsonl(tmp_path)).fit(max_steps=5)
    got = logged(tmp_path, "device_stats/max_rss_mib")
    assert [s for s, _ in got] == [2, 4] and all(v > 10 for _, v in got)


def test_the_guide_s_prediction_writer_writes_every_batch(tmp_path, monkeypatch):
    _, blocks = guide_blocks()
    monkeypatch.chdir(tmp_path)
    set_seed(0)
    x = torch.randn(20, 8)
    namespace = {"train": DataLoader(TensorDataset(x, torch.zeros(20, dtype=torch.long)), batch_size=8),
                 "test_data": DataLoader(TensorDataset(x), batch_size=8)}
    exec(compile(blocks[1], "docs/plugins.md:prediction-writer", "exec"), namespace)  # (it builds its model)
    model = namespace["model"]
    files = sorted((tmp_path / "predictions").iterdir())
    assert [f.name for f in files] == ["rank0-00000.pt", "rank0-00001.pt", "rank0-00002.pt"]
    written = torch.cat([torch.load(f) for f in files])
    assert torch.equal(written, torch.load(tmp_path / "predictions.pt"))
    assert torch.allclose(written, model(x))
    # evaluation is left alone: nothing written
    namespace["loop"].evaluate(DataLoader(TensorDataset(x, torch.zeros(20, dtype=torch.long)), batch_size=8))
    assert len(list((tmp_path / "predictions").iterdir())) == 3


def test_a_run_resumed_in_a_scheduled_epoch_ends_as_the_uninterrupted_one(tiny_loop, tmp_path):
    from hookloop.testing import reset_accelerate

    def run(**kwargs):
        return tiny_loop([GradientAccumulationScheduler({1: 2, 2: 4}),
                          Checkpoint(dir=tmp_path, every_steps=2, every_epoch=False, signals=None)], **kwargs)

    whole = tiny_loop([GradientAccumulationScheduler({1: 2, 2: 4})])
    whole.fit(epochs=3)
    reset_accelerate()
    run().fit(max_steps=10)  # 8 updates in epoch 0, then 2 of 4 (2 batches each) in epoch 1
    reset_accelerate()
    updates = UpdatesAt()
    resumed = run(resume_from="latest")
    with registered(resumed, updates):
        resumed.fit(epochs=3)
    assert updates.at == [(1, 6), (1, 8), (2, 4), (2, 8)]
    assert resumed.state.global_step == whole.state.global_step == 8 + 4 + 2
    assert all(torch.equal(a, b) for a, b in zip(parameters(whole), parameters(resumed)))
