"""hookloop.accelerate_fastpath: Accelerate's per-step calls without the lookups
Accelerate repeats on every call, and bit for bit the same training."""

import json
import warnings

import accelerate.optimizer
import launching
import pytest
import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderShard
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import set_seed
from packaging.version import Version
from torch.utils.data import DataLoader, TensorDataset

from handwritten import train_by_hand
from hookloop import Loop, hookimpl
from hookloop import accelerate_fastpath as fastpath
from hookloop.testing import reset_accelerate
from paths import ROOT, SCRIPTS  # noqa: F401

EPOCHS = 2
SCRIPTS = SCRIPTS

#: the tests of what the fast path does, where there is one: on an Accelerate
#: release it was not checked against (CI's run on the oldest declared one)
#: it is off, Loop(...) says so, and the tests of the loop's numbers check
#: Accelerate's own calls
verified_only = pytest.mark.skipif(
    not fastpath.accelerate_verified(),
    reason=f"accelerate {accelerate.__version__} is not a release the fast path was checked against "
           f"({' to '.join(fastpath.VERIFIED_RELEASES)}): it is off")


def job():
    """10 batches per epoch: with accumulation 3 the last group is partial."""
    set_seed(0)
    x, y = torch.randn(80, 12), torch.randint(0, 4, (80,))
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 4))
    data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / (EPOCHS * 10))
    return model, optimizer, data, scheduler


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def by_hand(**accelerator_kwargs):
    reset_accelerate()
    model, optimizer, data, scheduler = job()
    train_by_hand(Accelerator(**accelerator_kwargs), model, optimizer, data, scheduler, EPOCHS)
    return params(model)


@pytest.fixture
def accelerate_lookups(monkeypatch):
    """Counts the package lookup ``AcceleratedOptimizer.step`` repeats on every
    call (twice per call): zero means Accelerate's step was not run."""
    calls = []
    original = accelerate.optimizer.is_lomo_available

    def counting():
        calls.append(1)
        return original()

    monkeypatch.setattr(accelerate.optimizer, "is_lomo_available", counting)
    return calls


def with_hookloop(accelerator_class=Accelerator, plugins=(), **accelerator_kwargs):
    reset_accelerate()
    model, optimizer, data, scheduler = job()
    initial = params(model)
    loop = Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=data,
                accelerator=accelerator_class(**accelerator_kwargs),
                plugins=list(plugins), block=["progress"])
    loop.fit(epochs=EPOCHS)
    got = params(model)
    assert any(not torch.equal(a, b) for a, b in zip(initial, got)), "training changed nothing"
    return got, loop


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.skipif(Version(accelerate.__version__) < Version(fastpath.VERIFIED_RELEASES[0]),
                    reason=f"accelerate {accelerate.__version__} is older than the releases the fast path was "
                           "checked against: it is off, as Loop(...) warns (the tests below)")
def test_the_installed_accelerate_is_the_verified_one():
    found = {name: fastpath.fingerprint(f) for name, f in (
        ("AcceleratedOptimizer.step", AcceleratedOptimizer.step),
        ("AcceleratedOptimizer.zero_grad", AcceleratedOptimizer.zero_grad),
        ("Accelerator.backward", Accelerator.backward),
        ("AcceleratedScheduler.step", AcceleratedScheduler.step),
        ("DataLoaderShard.__iter__", DataLoaderShard.__iter__),
    )}
    assert fastpath.accelerate_verified(), (
        f"accelerate {accelerate.__version__}: {found} is not in VERIFIED, so hookloop pays "
        "Accelerate's per-call cost again. Check the new code against FastPath, then add "
        "the fingerprints to hookloop.accelerate_fastpath.VERIFIED."
    )


@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("precision", ["no", "bf16"])
@verified_only
def test_trains_bit_for_bit_like_the_hand_written_loop_without_accelerates_lookups(
    precision, accumulation, accelerate_lookups
):
    kwargs = dict(mixed_precision=precision, gradient_accumulation_steps=accumulation)
    expected = by_hand(**kwargs)
    assert accelerate_lookups, "the hand-written loop runs AcceleratedOptimizer.step"
    accelerate_lookups.clear()
    got, loop = with_hookloop(**kwargs)
    assert same(expected, got)
    assert accelerate_lookups == []  # every step went through the fast path
    assert loop.fastpath.is_fast(loop.networks["model"].optimizer)
    # the loss is divided by the accumulation steps: Accelerate's own backward
    assert loop.fastpath.plain_backward == (accumulation == 1)


def test_bf16_really_changes_the_numbers():
    """So that the bf16 parity above compares mixed-precision training."""
    assert not same(by_hand(mixed_precision="bf16"), by_hand())


def test_switched_off_by_the_environment(monkeypatch, accelerate_lookups):
    monkeypatch.setenv(fastpath.ENV, "0")
    got, loop = with_hookloop()
    assert not loop.fastpath.enabled
    assert len(accelerate_lookups) == 2 * EPOCHS * 10  # two per AcceleratedOptimizer.step
    assert same(by_hand(), got)


def test_accelerate_code_other_than_the_verified_gets_accelerates_own_calls(
    monkeypatch, accelerate_lookups
):
    monkeypatch.setitem(fastpath.VERIFIED, "AcceleratedOptimizer.zero_grad", {"0" * 16})
    got, loop = with_hookloop()
    assert not loop.fastpath.enabled
    assert accelerate_lookups
    assert same(by_hand(), got)


def test_a_method_replaced_on_accelerates_class_turns_it_off(monkeypatch):
    calls = []
    original = AcceleratedOptimizer.step

    def step(self, closure=None):
        calls.append(1)
        return original(self, closure)

    monkeypatch.setattr(AcceleratedOptimizer, "step", step)
    got, loop = with_hookloop()
    assert not loop.fastpath.enabled
    assert len(calls) == EPOCHS * 10


# -- another Accelerate release: said at Loop(...), once per process -----------------------


@pytest.fixture
def unsaid(monkeypatch):
    """The warning not said yet in this process (as in a fresh one)."""
    monkeypatch.setattr(fastpath, "_said", False)


def another_release(monkeypatch):
    """The installed Accelerate as another release: its zero_grad's code is
    not the verified one (as Accelerate's own, not replaced at run time)."""
    monkeypatch.setitem(fastpath.VERIFIED, "AcceleratedOptimizer.zero_grad", {"0" * 16})


def release_warnings(build):
    """The warnings of an unverified release while ``build`` runs."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    return [w for w in caught if "is not a release hookloop's fast path was checked against" in str(w.message)]


def a_loop():
    model = torch.nn.Linear(3, 1)
    return Loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                train_data=[(torch.ones(2, 3), torch.ones(2, 1))], block=["progress"])


def test_another_accelerate_release_is_said_once_at_loop(monkeypatch, unsaid):
    another_release(monkeypatch)
    said = release_warnings(lambda: (a_loop(), a_loop()))  # two Loops in one process: said once
    assert len(said) == 1 and said[0].category is RuntimeWarning
    assert said[0].filename == __file__  # at the user's Loop(...)
    text = str(said[0].message)
    assert f"hookloop: accelerate {accelerate.__version__} is not a release" in text
    assert f"({fastpath.VERIFIED_RELEASES[0]} to {fastpath.VERIFIED_RELEASES[1]}; its " in text
    assert "AcceleratedOptimizer.zero_grad" in text.split("; its ")[1].split(" differ)")[0]
    assert "every step makes Accelerate's own calls: the same numbers" in text
    assert "HOOKLOOP_ACCELERATE_FASTPATH=0" in text


def test_another_release_switched_off_by_the_environment_is_not_said(monkeypatch, unsaid):
    another_release(monkeypatch)
    monkeypatch.setenv(fastpath.ENV, "0")
    assert release_warnings(a_loop) == []


@verified_only
def test_a_checked_release_or_a_method_replaced_at_run_time_is_not_said(monkeypatch, unsaid):
    """A profiler's or a plugin's wrapper on Accelerate's class turns the fast
    path off (above) without a word: its author knows."""
    assert release_warnings(a_loop) == []
    monkeypatch.setattr(AcceleratedOptimizer, "step", lambda self, closure=None: None)
    assert release_warnings(a_loop) == []


class WrapOptimizer:
    """Wraps the prepared optimizer's step and zero_grad at fit start, as a
    profiling or step-counting plugin would."""

    def __init__(self):
        self.steps = self.zero_grads = 0

    @hookimpl
    def on_fit_start(self, loop):
        optimizer = loop.networks["model"].optimizer
        step, zero_grad = optimizer.step, optimizer.zero_grad

        def counted_step(*args, **kwargs):
            self.steps += 1
            return step(*args, **kwargs)

        def counted_zero_grad(*args, **kwargs):
            self.zero_grads += 1
            return zero_grad(*args, **kwargs)

        optimizer.step, optimizer.zero_grad = counted_step, counted_zero_grad


def test_a_plugin_that_wraps_the_optimizer_step_sees_every_call():
    wrapper = WrapOptimizer()
    got, loop = with_hookloop(plugins=[wrapper])
    assert (wrapper.steps, wrapper.zero_grads) == (EPOCHS * 10, EPOCHS * 10)
    assert not loop.fastpath.is_fast(loop.networks["model"].optimizer)
    assert same(by_hand(), got)


class CountingAccelerator(Accelerator):
    calls = 0

    def backward(self, loss, **kwargs):
        CountingAccelerator.calls += 1
        super().backward(loss, **kwargs)


def test_an_accelerator_subclass_keeps_its_own_backward():
    CountingAccelerator.calls = 0
    got, loop = with_hookloop(accelerator_class=CountingAccelerator)
    assert CountingAccelerator.calls == EPOCHS * 10
    assert not loop.fastpath.plain_backward


@verified_only
def test_an_optimizer_with_a_gradient_scaler_gets_accelerates_step():
    """fp16 (a GPU's case): the scaler must unscale, check for inf and update."""
    reset_accelerate()
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    optimizer = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)
    fast = fastpath.FastPath(accelerator)
    assert fast.enabled and not fast.is_fast(optimizer)
    scaler.scale(model(torch.ones(1, 3)).sum() * float("inf")).backward()
    before = params(model)
    fast.step(optimizer)  # the scaler sees the inf gradient: no step, smaller scale
    assert optimizer.step_was_skipped
    assert same(before, params(model))
    assert scaler.get_scale() < 4.0


@pytest.mark.slow
@verified_only
def test_two_processes_train_bit_for_bit_like_the_hand_written_loop(tmp_path):
    result = launching.run_two("fastpath_two_processes.py", tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert report["num_processes"] == 2
        for accumulation in ("1", "2"):
            r = report[accumulation]
            assert r["ddp"] == "DistributedDataParallel"
            assert r["trained"] and r["equal_to_hand"] and r["ranks_agree"], (rank, accumulation, r)
            assert r["fast_step"] and r["accelerate_lookups"] == 0
            assert r["plain_backward"] == (accumulation == "1")


# -- the scheduler wrapper and the dataloader -------------------------------------------


@pytest.fixture
def accelerate_state_calls(monkeypatch):
    """Counts ``AcceleratorState()`` built inside ``AcceleratedScheduler.step``
    (once per call): zero means Accelerate's scheduler step was not run."""
    import accelerate.scheduler

    calls = []
    original = accelerate.scheduler.AcceleratorState

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(accelerate.scheduler, "AcceleratorState", counting)
    return calls


@pytest.mark.parametrize("accumulation", [1, 3])
@verified_only
def test_the_scheduler_steps_as_accelerates_wrapper_without_its_per_call_state(
    accumulation, accelerate_state_calls
):
    kwargs = dict(gradient_accumulation_steps=accumulation)
    expected = by_hand(**kwargs)
    accelerate_state_calls.clear()
    got, loop = with_hookloop(**kwargs)
    assert same(expected, got)
    assert accelerate_state_calls == []
    scheduler = loop.networks["model"].scheduler
    # the same count of steps as Accelerate's wrapper makes (accumulation included)
    reset_accelerate()
    model, optimizer, data, sched = job()
    acc = Accelerator(**kwargs)
    train_by_hand(acc, model, optimizer, data, sched, EPOCHS)
    assert scheduler.scheduler.last_epoch == sched.last_epoch
    assert scheduler.scheduler._step_count == sched._step_count


def test_a_one_cycle_schedule_stops_at_its_total_as_accelerate_does():
    def one_cycle(optimizer):
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=15)

    def run(use_hookloop):
        reset_accelerate()
        model, optimizer, data, _ = job()
        scheduler = one_cycle(optimizer)  # 15 < 20 updates: Accelerate stops stepping it
        if use_hookloop:
            Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=data,
                 block=["progress"]).fit(epochs=EPOCHS)
        else:
            train_by_hand(Accelerator(), model, optimizer, data, scheduler, EPOCHS)
        return params(model), scheduler._step_count

    (fast_params, fast_steps), (hand_params, hand_steps) = run(True), run(False)
    assert fast_steps == hand_steps == 16 and same(fast_params, hand_params)


def _loader(acc):
    x = torch.arange(20.0).reshape(10, 2)
    return acc.prepare(DataLoader(TensorDataset(x), batch_size=3, shuffle=True,
                                  generator=torch.Generator().manual_seed(0)))


@verified_only
def test_batches_come_as_accelerate_yields_them_with_the_last_one_flagged():
    reset_accelerate()
    acc = Accelerator()
    fast = fastpath.FastPath(acc)
    seen_fast, flags = [], []
    for (batch,) in fast.batches(_loader(acc)):
        seen_fast.append(batch.clone())
        flags.append(acc.gradient_state.end_of_dataloader)
    assert flags == [False, False, False, True]
    assert acc.gradient_state.active_dataloader is None  # ended, as Accelerate ends it
    seen = [b.clone() for (b,) in _loader(acc)]
    assert len(seen) == 4 and all(torch.equal(a, b) for a, b in zip(seen_fast, seen, strict=True))


@verified_only
def test_the_end_of_the_data_is_read_as_accelerates_property_reads_it():
    """The loop asks after every batch whether it was the last: the fast path's
    answer is gradient_state.end_of_dataloader's, with no loader, with the
    fast iteration, with Accelerate's own, and for an outer loader again once
    a loader iterated inside it has ended."""
    reset_accelerate()
    acc = Accelerator()
    fast = fastpath.FastPath(acc)
    assert fast.enabled
    state = acc.gradient_state

    def both():
        return fast.end_of_dataloader(), state.end_of_dataloader

    assert both() == (False, False)
    assert [both() for _ in fast.batches(_loader(acc))] == [(False, False)] * 3 + [(True, True)]
    outer = []
    for _ in _loader(acc):  # Accelerate's own iteration
        inner = [both() for _ in fast.batches(_loader(acc))]
        assert inner == [(False, False)] * 3 + [(True, True)]
        outer.append(both())
    assert outer == [(False, False)] * 3 + [(True, True)]
    assert both() == (False, False)


@verified_only
def test_a_loader_skipping_a_resumed_epoch_s_first_batches_yields_the_same_rest():
    reset_accelerate()
    acc = Accelerator()
    fast = fastpath.FastPath(acc)
    rest_fast = [b.clone() for (b,) in fast.batches(acc.skip_first_batches(_loader(acc), 1))]
    rest = [b.clone() for (b,) in acc.skip_first_batches(_loader(acc), 1)]
    assert len(rest) == 3 and all(torch.equal(a, b) for a, b in zip(rest_fast, rest, strict=True))


@verified_only
def test_batches_fall_back_to_accelerate_where_they_would_move():
    reset_accelerate()
    acc = Accelerator()
    loader = acc.prepare(DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2))
    fast = fastpath.FastPath(acc)
    assert fast.batches(loader) is not loader  # the CPU: nothing to move
    loader.device = torch.device("meta")  # a device the batches would have to go to
    assert fast.batches(loader) is loader
