"""What the built-in plugins and the loop's controls do to a run."""

import json

import pytest
import torch
from accelerate import Accelerator

from hookloop import hookimpl
from hookloop.plugins import GradClip, Logger
from hookloop.testing import reset_accelerate, tiny_loop
from hookloop.trackers import JSONLinesTracker


def params(loop):
    return [p.detach().clone() for p in loop.networks["model"].unwrapped.parameters()]


def test_a_compute_loss_plugin_replaces_the_default_loss():
    class SquaredError:  # regress the logits on one-hot targets instead
        @hookimpl
        def compute_loss(self, batch, outputs):
            _, targets = batch
            onehot = torch.nn.functional.one_hot(targets, outputs.shape[-1]).float()
            return ((outputs - onehot) ** 2).mean()

    default = tiny_loop()
    default.fit(epochs=1)
    reset_accelerate()
    custom = tiny_loop([SquaredError()])
    custom.fit(epochs=1)
    reset_accelerate()
    start = params(tiny_loop())
    assert any(not torch.equal(a, b) for a, b in zip(params(custom), start))
    assert any(not torch.equal(a, b) for a, b in zip(params(custom), params(default)))


def test_gradclip_bounds_the_gradient_norm_the_optimizer_applies():
    applied, measured = [], []

    class Probe:
        @hookimpl
        def before_optimizer_step(self, network):
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad) for p in network.model.parameters()])
            )
            applied.append(norm.item())
            measured.append(float(network.grad_norm))

    tiny_loop([GradClip(max_norm=0.05), Probe()]).fit(epochs=1)
    assert len(applied) == 8
    assert max(measured) > 0.05  # clipping really had something to do
    assert all(a <= 0.05 * (1 + 1e-5) for a in applied)


def test_gradclip_by_value_clamps_every_element():
    seen = []

    class Probe:
        @hookimpl
        def before_optimizer_step(self, network):
            seen.append(max(p.grad.abs().max().item() for p in network.model.parameters()))

    tiny_loop([GradClip(max_value=1e-3), Probe()]).fit(epochs=1)
    assert max(seen) == pytest.approx(1e-3)  # float32's 1e-3: clamped, and reached


def test_gradclip_clips_only_synchronised_gradients_under_accumulation(monkeypatch):
    calls = []
    accelerator = Accelerator(gradient_accumulation_steps=2)
    original = accelerator.clip_grad_norm_
    monkeypatch.setattr(accelerator, "clip_grad_norm_",
                        lambda *a, **k: calls.append(accelerator.sync_gradients) or original(*a, **k))
    tiny_loop([GradClip(max_norm=1.0)], accelerator=accelerator).fit(epochs=1)  # 8 batches
    assert calls == [True] * 4


def test_gradclip_rejects_ambiguous_limits():
    with pytest.raises(ValueError, match="exactly one of max_norm"):
        GradClip(max_norm=1.0, max_value=1.0)
    with pytest.raises(ValueError, match="positive"):
        GradClip(max_norm=0)


def test_a_plugin_can_skip_a_batch():
    trained = []

    class SkipFirst:
        @hookimpl
        def before_step(self, loop, batch):
            if loop.state.step_in_epoch == 0:
                loop.skip_batch()

        @hookimpl
        def after_step(self, loop):
            trained.append(loop.state.step_in_epoch)

    loop = tiny_loop([SkipFirst()])
    loop.fit(epochs=2)
    assert trained == [2, 3, 4, 5, 6, 7, 8] * 2
    assert loop.state.global_step == 14 and loop.state.epoch == 2


def test_a_plugin_can_stop_training():
    class StopAtThree:
        @hookimpl
        def after_step(self, loop):
            if loop.state.global_step == 3:
                loop.stop("enough")

    ended = []

    class End:
        @hookimpl
        def on_fit_end(self, loop):
            ended.append(loop.state.stop_reason)

    loop = tiny_loop([StopAtThree(), End()])
    loop.fit(epochs=5)
    assert loop.state.global_step == 3 and loop.state.epoch == 0
    assert ended == ["enough"]


def test_max_steps_counts_over_the_run_and_a_second_fit_continues():
    loop = tiny_loop()  # 8 batches per epoch
    loop.fit(max_steps=5)
    assert (loop.state.epoch, loop.state.step_in_epoch, loop.state.global_step) == (0, 5, 5)
    loop.fit(max_steps=11)
    assert (loop.state.epoch, loop.state.step_in_epoch, loop.state.global_step) == (1, 3, 11)


@pytest.mark.parametrize("kwargs", [{}, {"epochs": 1, "max_steps": 3}, {"epochs": 0}, {"max_steps": -1}])
def test_fit_needs_exactly_one_positive_run_length(kwargs):
    with pytest.raises(ValueError, match="epochs|max_steps"):
        tiny_loop().fit(**kwargs)


def test_logger_writes_every_n_steps_to_trackers_and_console(tmp_path, capsys):
    accelerator = Accelerator(log_with=[JSONLinesTracker("run", tmp_path)])
    loop = tiny_loop([GradClip(max_norm=1.0), Logger(every=3)], accelerator=accelerator,
                     eval_data=True)
    loop.fit(epochs=1)  # 8 steps: logs at 3 and 6, then the epoch's metrics at 8
    records = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [3, 6]
    assert {"loss", "lr", "grad_norm"} <= set(steps[0])
    assert records[-1]["step"] == 8 and "eval_accuracy" in records[-1]
    out = capsys.readouterr().out
    assert out.count("step 3 loss") == 1 and out.count("step 6 loss") == 1
    assert "step 1 " not in out and "epoch 0 eval_loss" in out


def test_logger_never_reads_the_loss_between_logging_steps(monkeypatch):
    """A `.item()` synchronises a GPU: the logger adds one per value every N
    steps and none in between (Adam itself reads its step counter)."""
    reads = []
    original = torch.Tensor.item

    def counted_fit(plugins):
        reset_accelerate()
        loop = tiny_loop(plugins)
        reads.clear()
        monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(1) or original(self))
        loop.fit(epochs=1)
        monkeypatch.setattr(torch.Tensor, "item", original)
        return len(reads)

    baseline = counted_fit([])
    assert counted_fit([Logger(every=4, console=False)]) == baseline + 2  # steps 4 and 8


def test_progress_bar_is_a_default_and_can_be_blocked(monkeypatch):
    loop = tiny_loop(block=[])
    assert "progress" in loop.plugins.names()
    loop = tiny_loop(block=["progress"])
    assert "progress" not in loop.plugins.names()
    monkeypatch.setenv("HOOKLOOP_BLOCK_PLUGINS", "progress")
    assert "progress" not in tiny_loop(block=[]).plugins.names()


def test_progress_bar_shows_loss_and_closes(capsys):
    from hookloop.plugins import ProgressBar

    bar = ProgressBar(every=4, disable=False)
    tiny_loop([bar], block=[]).fit(epochs=1)
    err = capsys.readouterr().err
    assert "8/8" in err and "loss=" in err
    assert bar.bar is None


def test_builtin_plugins_by_name_with_options():
    loop = tiny_loop([("gradclip", {"max_norm": 0.5}), "logger"])
    assert loop.plugins.get("gradclip").max_norm == 0.5
    assert loop.plugins.get("logger").every == 50


def test_evaluate_averages_over_every_example():
    loop = tiny_loop(eval_data=True)  # 16 eval examples in batches of 8
    model = loop.networks["model"].unwrapped
    assert model.training
    metrics = loop.evaluate()
    assert model.training  # evaluate restores the mode it found
    x, y = loop.eval_data.dataset.tensors
    model.eval()
    with torch.no_grad():
        logits = model(x)
    expected = (logits.argmax(-1) == y).double().mean().item()
    assert metrics["eval_accuracy"] == pytest.approx(expected)
    assert metrics["eval_loss"] == pytest.approx(
        torch.nn.functional.cross_entropy(logits, y).item(), rel=1e-6)
