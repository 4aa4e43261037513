"""Which hooks run, in which order, and in which order plugins see them."""

from hookloop import hookimpl
from hookloop.manager import hook_names
from hookloop.testing import HookRecorder, tiny_loop

PER_STEP = [
    "before_step",
    "training_step",
    "compute_loss",
    "before_backward",
    "after_backward",
    "commit_update",  # (no implementation votes to discard it: the update is made)
    "before_optimizer_step",
    "after_optimizer_step",
    "before_scheduler_step",
    "after_scheduler_step",
    "before_zero_grad",
    "after_zero_grad",
    "after_step",
]


def test_one_epoch_of_two_steps_calls_hooks_in_this_order():
    recorder = HookRecorder()
    positions = []

    class Position:
        @hookimpl
        def before_step(self, loop):
            positions.append(("before", loop.state.step_in_epoch, loop.state.global_step))

        @hookimpl
        def after_step(self, loop):
            positions.append(("after", loop.state.step_in_epoch, loop.state.global_step))

    loop = tiny_loop([recorder, Position()], n=16, batch_size=8, eval_data=True)  # 2+2 batches
    loop.fit(epochs=1)
    assert recorder.names() == [
        "on_loop_start",  # in Loop(...)
        "on_fit_start",
        "on_eval_start",  # the sanity check: an evaluation of one batch before training
        "eval_step",
        "after_eval_step",
        "on_eval_end",
        "on_epoch_start",
        *PER_STEP,
        "on_safe_point",  # after an update: a checkpoint here resumes exactly
        *PER_STEP,
        "on_safe_point",
        "on_train_epoch_end",
        "on_eval_start",
        "eval_step",
        "after_eval_step",
        "eval_step",
        "after_eval_step",
        "on_eval_end",
        "on_epoch_end",
        "on_safe_point",
        "on_fit_end",
    ]
    # before_step sees the batch's index; after_step sees it counted
    assert positions == [("before", 0, 0), ("after", 1, 1), ("before", 1, 1), ("after", 2, 2)]
    (epoch_end,) = recorder.calls_of("on_epoch_end")
    assert epoch_end["epoch"] == 0
    assert set(epoch_end["metrics"]) == {"eval_loss", "eval_accuracy"}


def test_optimizer_hooks_fire_only_on_synchronised_steps_under_accumulation():
    from accelerate import Accelerator

    recorder = HookRecorder(hooks=["after_backward", "before_optimizer_step", "after_zero_grad"])
    loop = tiny_loop([recorder], n=32, batch_size=8,
                     accelerator=Accelerator(gradient_accumulation_steps=2))
    loop.fit(epochs=1)  # 4 batches -> 2 optimizer steps
    assert recorder.names().count("after_backward") == 4
    assert recorder.names().count("before_optimizer_step") == 2
    assert recorder.names().count("after_zero_grad") == 2


class Tagger:
    """Records (hook, tag) for every hook into a shared list."""

    def __init__(self, tag, log):
        self.name = f"tagger-{tag}"
        self.tag = tag
        self.log = log


def _tagging_method(hook):
    def method(self):
        self.log.append((hook, self.tag))

    method.__name__ = hook
    return hookimpl(method)


for _hook in hook_names():
    setattr(Tagger, _hook, _tagging_method(_hook))


def test_plugins_run_in_the_order_given_in_every_hook(tmp_path):
    from hookloop.plugins import Checkpoint

    log = []
    a, b = Tagger("A", log), Tagger("B", log)
    tiny_loop([a, b, Checkpoint(dir=tmp_path, signals=None)], n=16, eval_data=True).fit(epochs=1)
    called = {hook for hook, _ in log}
    # (no close(), no resume, no refused save)
    assert called == set(hook_names()) - {"on_exception", "on_loop_end", "after_load_checkpoint",
                                          "first_nonfinite_update"}
    for hook in called:
        tags = [tag for h, tag in log if h == hook]
        assert tags == ["A", "B"] * (len(tags) // 2), hook


def test_tryfirst_and_trylast_still_move_an_implementation():
    log = []

    class Early:
        @hookimpl(tryfirst=True)
        def on_epoch_start(self):
            log.append("early")

    class Late:
        @hookimpl(trylast=True)
        def on_epoch_start(self):
            log.append("late")

    class Plain:
        @hookimpl
        def on_epoch_start(self):
            log.append("plain")

    tiny_loop([Late(), Plain(), Early()], n=8).fit(epochs=1)
    assert log == ["early", "plain", "late"]


def test_user_compute_loss_runs_before_the_default_loss():
    seen = []

    class Spy:
        @hookimpl
        def compute_loss(self, network):
            seen.append(network.name)  # returns None: the default decides

    loop = tiny_loop([Spy()], n=8)
    loop.fit(epochs=1)
    assert seen == ["model"]
    assert loop.state.global_step == 1


def test_trylast_implementations_run_last_in_pluggys_order():
    """tryfirst and plain ones run in plugins=[...] order; trylast ones, as
    pluggy calls them (hookloop writes nothing into pluggy's lists), the first
    registered first: plugins=[...]'s last first."""
    log = []

    def plugin(tag, **opts):
        class P:
            name = tag

            @hookimpl(**opts)
            def on_epoch_start(self):
                log.append(tag)

        return P()

    tiny_loop([plugin("A"), plugin("B"), plugin("C", trylast=True), plugin("D", trylast=True),
               plugin("E", tryfirst=True), plugin("F", tryfirst=True)], n=8).fit(epochs=1)
    assert log == ["E", "F", "A", "B", "D", "C"]


def test_a_trylast_user_loss_still_beats_the_trylast_default_loss():
    used = []

    class Fallback:
        @hookimpl(trylast=True)
        def compute_loss(self, outputs):
            used.append(1)
            return outputs.sum() * 0.0

    tiny_loop([Fallback()], n=8).fit(epochs=1)
    assert used == [1]
