"""hookloop-profiler, tested with hookloop's kit (``tiny_loop``,
``tiny_gan_loop``, ``hookloop_recorder``, ``parameters``).

Run after installing: ``pip install ./plugins/hookloop-profiler`` then
``pytest plugins/hookloop-profiler/tests``. The kit's loops keep installed
plugins from autoloading, so these tests switch the profiler on by name or
instance.
"""

import json
import time

import pytest
import torch

from hookloop import hookimpl
from hookloop.manager import implemented_hooks
from hookloop.plugins import GradClip, Logger
from hookloop.testing import parameters
from hookloop_profiler import Profiler


def rows_by_key(profiler):
    return {(r["plugin"], r["hook"]): r for r in profiler.rows}


def test_the_table_lists_every_implemented_hook_of_every_plugin(tiny_loop, hookloop_recorder, capsys):
    profiler = Profiler()
    loop = tiny_loop([profiler, hookloop_recorder, GradClip(max_norm=1.0), Logger(every=4)],
                     eval_data=True)
    loop.fit(epochs=1)
    rows = rows_by_key(profiler)
    expected = {(name, hook) for name in loop.plugins.names() if name != "profiler"
                for hook in implemented_hooks(loop.plugins.get(name))}
    assert set(rows) == expected
    assert ("recorder", "on_exception") in rows  # never called, still listed
    # the recorder implements every hook: its call counts are the hooks' call counts
    # (the profiler measures a fit; on_loop_start runs in Loop(...), before it)
    for hook in {h for _, h in expected} - {"on_loop_start", "on_loop_end"}:
        assert rows[("recorder", hook)]["calls"] == hookloop_recorder.count(hook), hook
    assert rows[("supervised", "training_step")]["calls"] == 8 == profiler.steps
    assert rows[("gradclip", "after_backward")]["calls"] == 8
    # 16 eval examples, batches of 8, and the sanity check's one batch before training
    assert rows[("supervised", "eval_step")]["calls"] == 3
    assert all(r["us_per_call"] > 0 for r in profiler.rows if r["calls"])
    # the shares of step time and the rest add up
    shares = sum(r["step_share"] for r in profiler.rows)
    assert 0 < shares <= 1 and shares + profiler.other_share == pytest.approx(1)
    assert rows[("supervised", "eval_step")]["step_share"] == 0  # not inside a step

    printed = capsys.readouterr().out
    assert "hookloop profiler: 8 steps" in printed and "% of step" in printed
    for plugin, hook in expected:
        assert any(line.split()[:2] == [plugin, hook] for line in printed.splitlines()), (plugin, hook)


class Sleepy:
    """A loss that takes at least 3 ms, and an after_step that takes 2 ms."""

    name = "sleepy"

    @hookimpl
    def compute_loss(self, batch, outputs):
        time.sleep(0.003)
        return torch.nn.functional.cross_entropy(outputs, batch[1])

    @hookimpl
    def after_step(self):
        time.sleep(0.002)


def test_time_goes_to_the_plugin_that_spends_it(tiny_loop):
    profiler = Profiler(print_table=False)
    tiny_loop([profiler, Sleepy()], n=32).fit(epochs=1)
    rows = rows_by_key(profiler)
    assert rows[("sleepy", "after_step")]["us_per_call"] >= 2000
    assert rows[("sleepy", "compute_loss")]["self_us_per_call"] >= 3000
    # the strategy's training_step calls compute_loss: inclusive, not self
    step = rows[("supervised", "training_step")]
    assert step["us_per_call"] - step["self_us_per_call"] >= 3000
    assert rows[("sleepy", "compute_loss")]["step_share"] > 0  # spent inside steps
    assert rows[("loss", "compute_loss")]["calls"] == 0  # firstresult: sleepy answered first


class Around:
    """A new-style wrapper: measured too, and still wraps."""

    name = "around"

    def __init__(self):
        self.seen = []

    @hookimpl(wrapper=True)
    def training_step(self, loop, batch):
        time.sleep(0.001)
        result = yield
        self.seen.append(result)
        return result


def test_wrappers_are_measured_and_keep_working(tiny_loop):
    profiler, around = Profiler(print_table=False), Around()
    tiny_loop([profiler, around], n=16).fit(epochs=1)
    row = rows_by_key(profiler)[("around", "training_step")]
    assert row["calls"] == 2 and row["self_us_per_call"] >= 1000
    assert len(around.seen) == 2 and all(r.loss.ndim == 0 for r in around.seen)


def test_training_is_unchanged_bit_for_bit(tiny_gan_loop):
    plain = tiny_gan_loop()
    plain.fit(max_steps=4)
    profiled = tiny_gan_loop([Profiler(print_table=False)])
    profiled.fit(max_steps=4)
    for net in ("generator", "discriminator"):
        assert all(torch.equal(a, b) for a, b in zip(parameters(plain, net), parameters(profiled, net)))


class Fails:
    name = "fails"

    @hookimpl
    def after_step(self, loop):
        if loop.state.global_step == 2:
            raise ValueError("boom")


def test_errors_still_name_the_plugin_and_the_functions_come_back(tiny_loop):
    profiler = Profiler()
    loop = tiny_loop([profiler, Fails()])
    with pytest.raises(ValueError, match="boom(.|\n)*raised in hook 'after_step' of plugin 'fails'"):
        loop.fit(epochs=1)
    for impl in loop.plugins.pm.hook.after_step.get_hookimpls():
        assert getattr(impl.function, "__self__", None) is impl.plugin  # the real method again


def test_rows_go_to_a_json_file(tiny_loop, tmp_path):
    out = tmp_path / "profile.json"
    tiny_loop([Profiler(print_table=False, file=str(out))], n=16).fit(epochs=1)
    data = json.loads(out.read_text())
    assert data["steps"] == 2 and {"plugin": "supervised", "hook": "training_step"}.items() <= \
        next(r for r in data["rows"] if r["hook"] == "training_step").items()


def test_it_is_an_observer_that_autoloads_and_can_be_named(tiny_loop):
    assert Profiler.autoload is True
    loop = tiny_loop(["profiler"])
    assert isinstance(loop.plugins.get("profiler"), Profiler)


def test_each_fit_is_measured_afresh_and_nothing_is_timed_between_fits(tiny_loop):
    profiler = Profiler(print_table=False)
    loop = tiny_loop([profiler], n=16, eval_data=True)
    loop.evaluate()  # hooks called before any fit
    loop.fit(epochs=1)
    first = rows_by_key(profiler)
    assert first[("supervised", "training_step")]["calls"] == 2
    assert first[("supervised", "eval_step")]["calls"] == 3  # the sanity check's batch + 2
    loop.evaluate()  # between fits: not measured
    assert rows_by_key(profiler) == first
    loop.fit(epochs=3)  # two more epochs
    again = rows_by_key(profiler)
    assert again[("supervised", "training_step")]["calls"] == 4 == profiler.steps
    assert again[("supervised", "eval_step")]["calls"] == 5  # sanity check + 2 epochs x 2
