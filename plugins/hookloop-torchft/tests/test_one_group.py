"""``FaultTolerant`` in this process, one replica group and a lighthouse
(torchft's ``LighthouseServer``): with one group torchft's average is over one
participant, so a run with the plugin must train bit for bit what the same run
trains without it — supervised and GAN (two optimizers, a quorum and a commit
each) — and log ``ft/participants`` and ``ft/discarded``; a ``Checkpoint``
taken with it resumes exactly (the fallback when every group is lost); a
discarded update is neither stepped nor counted."""

import json
from datetime import timedelta

import pytest
import torch
from accelerate import Accelerator

import hookloop_torchft
from hookloop import hookimpl
from hookloop.plugins import Checkpoint
from hookloop.testing import parameters
from hookloop.trackers import JSONLinesTracker


@pytest.fixture
def lighthouse():
    """A lighthouse of the test's own: a group of an earlier test, not yet timed out
    of its heartbeats, would be waited for."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=10,
                              heartbeat_timeout_ms=500)
    yield server.address()
    server.shutdown()


def ft(lighthouse):
    return hookloop_torchft.FaultTolerant(lighthouse=lighthouse, replica_group=0, timeout=timedelta(seconds=10))


def equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_one_group_trains_bit_for_bit_what_the_loop_trains_without_it_and_logs_ft_values(
        tiny_loop, lighthouse, tmp_path):
    plain = tiny_loop()
    plain.fit(epochs=2)
    with_ft = tiny_loop([ft(lighthouse)], accelerator=Accelerator(cpu=True, log_with=[JSONLinesTracker("run", tmp_path)]))
    manager_steps = []

    class Steps:
        @hookimpl
        def after_step(self, loop):
            manager_steps.append(loop.plugins.get("fault-tolerant").manager.current_step())

    with_ft.plugins.register(Steps(), "steps", "test")
    with_ft.fit(epochs=2)
    assert with_ft.state.global_step == plain.state.global_step == 16
    assert equal(parameters(with_ft), parameters(plain))
    assert manager_steps == list(range(1, 17))  # one committed torchft step per update
    rows = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    logged = [(r["step"], r["ft/participants"], r["ft/discarded"]) for r in rows if "ft/participants" in r]
    assert logged == [(s, 1.0, 0.0) for s in range(1, 17)]
    with_ft.close()
    assert with_ft.plugins.get("fault-tolerant").manager is None  # shut down with the loop


def test_a_gan_commits_each_network_s_update_and_trains_what_it_trains_without_it(tiny_gan_loop, lighthouse):
    plain = tiny_gan_loop()
    plain.fit(epochs=2)
    plugin = ft(lighthouse)
    commits = []

    class Steps:
        @hookimpl
        def after_optimizer_step(self, loop, network):
            commits.append((network.name, plugin.manager.current_step()))

    with_ft = tiny_gan_loop([plugin, Steps()])
    with_ft.fit(epochs=2)
    with_ft.close()
    for name in ("generator", "discriminator"):
        assert equal(parameters(with_ft, name), parameters(plain, name)), name
    assert with_ft.state.global_step == plain.state.global_step == 8
    # each batch: the discriminator's update, then the generator's, each its own torchft step
    assert commits == [(name, 2 * i + k + 1) for i in range(8) for k, name in enumerate(["discriminator", "generator"])]


def test_a_checkpoint_taken_with_it_resumes_exactly_and_restores_torchft_s_step(tiny_loop, lighthouse, tmp_path):
    whole = tiny_loop([ft(lighthouse)])
    whole.fit(max_steps=12)
    whole.close()
    first = tiny_loop([ft(lighthouse), Checkpoint(dir=tmp_path, every_steps=4)])
    first.fit(max_steps=6)
    first.close()
    again_ft = ft(lighthouse)
    again = tiny_loop([again_ft, Checkpoint(dir=tmp_path, every_steps=4)], resume_from=tmp_path / "step-00000004")  # (as if every group died after update 6)
    seen = []

    class Steps:
        @hookimpl
        def before_optimizer_step(self, loop, network):
            seen.append(again_ft.manager.current_step())

    again.plugins.register(Steps(), "steps", "test")
    again.fit(max_steps=12)
    again.close()
    assert seen == list(range(5, 13))  # torchft's step came back with the checkpoint (4), then each commit
    assert again.state.global_step == 12
    assert equal(parameters(again), parameters(whole))


def test_a_discarded_update_is_not_stepped_nor_counted(tiny_loop, lighthouse):
    plugin = ft(lighthouse)
    before = []

    class DiscardThird:
        """torchft discards an update when any group reports an error: this group's
        third update errs (what a failed allreduce does)."""

        @hookimpl
        def after_backward(self, loop, network):
            if plugin.manager.current_step() == 2 and not before:
                before.append(parameters(loop))
                plugin.manager.report_error(RuntimeError("a peer's allreduce failed"))

    loop = tiny_loop([plugin, DiscardThird()])
    after = []

    class After:
        @hookimpl
        def after_step(self, loop):
            after.append((loop.state.global_step, loop.discarded_updates, parameters(loop)))

    loop.plugins.register(After(), "after", "test")
    loop.fit(max_steps=5)
    loop.close()
    # the third batch consumed, its update neither counted...
    assert [(s, d) for s, d, _ in after] == [(1, 0), (2, 0), (2, 1), (3, 1), (4, 1), (5, 1)]
    assert equal(after[2][2], before[0])  # ...nor made
    assert loop.state.global_step == 5 and loop.discarded_updates == 1
