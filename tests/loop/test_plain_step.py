"""The default per-step path leaves out the calls of hooks nobody implements
and runs the supervised step in one frame (``strategies.base.plain_step``);
a plugin that implements one of those hooks, also one registered in the
middle of a fit, gets every call."""

from hookloop import hookimpl

PER_BATCH = ("before_step", "before_backward", "after_backward", "before_optimizer_step",
             "after_optimizer_step", "before_scheduler_step", "after_scheduler_step",
             "before_zero_grad", "after_zero_grad", "on_safe_point")


class Counter:
    """Counts, per epoch, the calls of every per-batch hook."""

    def __init__(self):
        self.calls = {}

    def _count(self, loop, hook):
        key = (loop.state.epoch, hook)
        self.calls[key] = self.calls.get(key, 0) + 1


for _hook in PER_BATCH:
    def _impl(self, loop, _hook=_hook):
        self._count(loop, _hook)
    _impl.__name__ = _hook
    setattr(Counter, _hook, hookimpl(_impl))


class RegisterLate:
    """Registers ``plugin`` when the first epoch ends."""

    def __init__(self, plugin):
        self.plugin = plugin

    @hookimpl
    def on_epoch_end(self, loop, epoch):
        if epoch == 0:
            loop.plugins.register(self.plugin, "late-counter", "test")


def test_a_plugin_registered_between_epochs_gets_every_per_batch_call(tiny_loop):
    counter = Counter()
    loop = tiny_loop([RegisterLate(counter)], n=32, batch_size=8)  # 4 batches an epoch
    loop.fit(epochs=2)
    assert {hook: n for (epoch, hook), n in counter.calls.items() if epoch == 1} == {
        **{hook: 4 for hook in PER_BATCH},
        "on_safe_point": 5,  # each update, then the epoch's end
    }


def test_the_one_frame_step_trains_as_the_hooked_step_does(tiny_loop):
    """The same parameters with the per-batch hooks implemented (the kit's
    separate calls) and without them (one frame)."""
    plain = tiny_loop([], n=32, batch_size=8)
    plain.fit(epochs=2)
    hooked = tiny_loop([Counter()], n=32, batch_size=8)
    hooked.fit(epochs=2)
    for a, b in zip(plain.networks["model"].unwrapped.parameters(),
                    hooked.networks["model"].unwrapped.parameters()):
        assert a.tolist() == b.tolist()
