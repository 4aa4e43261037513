"""Accelerate's per-step calls, minus the work Accelerate repeats on every call.

In accelerate 1.15 every ``AcceleratedOptimizer.step()`` asks twice whether the
``lomo_optim`` package is installed (``importlib.util.find_spec`` walks
``sys.path``: ~27 µs each time), every ``zero_grad()`` builds an
``inspect.signature`` of the wrapped optimizer's ``zero_grad`` (~7 µs), and
every ``Accelerator.backward(loss)`` divides the loss by
``gradient_accumulation_steps`` even when that is 1 (a tensor op and one more
autograd node, ~6 µs). On a step of a few hundred µs that is a quarter of the
time; none of it changes a number.

:class:`FastPath` makes the same calls with those answers worked out once:

- ``step(optimizer)``: ``optimizer.optimizer.step(None)`` when
  ``accelerator.sync_gradients``, else nothing — what
  ``AcceleratedOptimizer.step`` does without a gradient scaler, off XLA, for a
  non-LOMO optimizer;
- ``zero_grad(optimizer)``: ``optimizer.optimizer.zero_grad(set_to_none=True)``
  (or ``zero_grad()`` if it takes no such argument) when synchronising;
- ``backward(loss)``: ``loss.backward()`` when Accelerate would do exactly that
  (no DeepSpeed or Megatron-LM, no gradient scaler, no accumulation: dividing
  by 1 is exact, so the gradients are bitwise the same);
- ``scheduler_step(scheduler)``: what ``AcceleratedScheduler.step`` does, with
  the number of processes read once (it builds an ``AcceleratorState()`` on
  every call, ~3 µs, and asks each optimizer whether its step was skipped,
  which only a gradient scaler can make true): ~7 µs of a ~13 µs call;
- ``batches(dataloader)``: a prepared ``DataLoaderShard`` iterated as
  Accelerate iterates it (random states synchronised, its gradient-state
  bookkeeping, one batch of look-ahead to flag the last one), without the
  per-batch ``send_to_device`` when the batches already are where they would
  go (the device is the CPU: a CPU ``.to("cpu")`` returns the same tensor;
  ~8 µs a batch of two tensors).

- ``end_of_dataloader()``: ``gradient_state.end_of_dataloader`` read from the
  last of its weak references to dataloaders, as its properties read it.

Anything else is handed to Accelerate unchanged: a gradient scaler (fp16),
XLA, DeepSpeed/Megatron wrappers (subclasses of ``AcceleratedOptimizer``), a
LOMO optimizer, an optimizer or accelerator whose ``step`` / ``zero_grad`` /
``backward`` was replaced, gradient accumulation for ``backward``, a
scheduler wrapper of another class or with ``step_with_optimizer=False`` /
``split_batches``, a dataloader that is not exactly a ``DataLoaderShard``
(a dispatcher, a stateful loader, one that skips batches for a resume) or
whose device is not the CPU.

It is used only where the installed Accelerate's methods are the ones this
module was checked against: ``VERIFIED`` holds a fingerprint of the source of
``AcceleratedOptimizer.step``, ``AcceleratedOptimizer.zero_grad``,
``Accelerator.backward``, ``AcceleratedScheduler.step``,
``DataLoaderShard.__iter__`` and ``GradientState``'s dataloader properties
(comments, docstrings and layout ignored): accelerate 1.9 to 1.16. Another
Accelerate with other code there gets Accelerate's own calls (the same
numbers, at Accelerate's cost: a tiny MLP's CPU step, ~185 µs with the fast
path, took ~370 µs without it, on 1.16 as on 1.6), ``Loop(...)`` warns once
per process (:func:`warn_if_unverified`), and the test
``tests/loop/test_accelerate_fastpath.py`` says so when it is newer.
``HOOKLOOP_ACCELERATE_FASTPATH=0`` switches the fast path off (and the warning).

Where Accelerate's releases since 1.1 differ in what a resume sees,
:func:`skip_first_batches` makes them the same (a resumed epoch's batches
after the seen ones, as accelerate 1.15 gives them).

Decisions are taken per ``fit`` (the loop builds a new :class:`FastPath` after
``on_fit_start``), so a plugin that wraps ``optimizer.step`` must do it before
then: a wrapper installed in the middle of a fit is not seen.
"""

from __future__ import annotations

import inspect
import os
import warnings

from accelerate import Accelerator
from accelerate.data_loader import DataLoaderShard
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.state import GradientState
from accelerate.utils import DistributedType, synchronize_rng_states

from ._fingerprint import fingerprint  # also importable from here, as before

ENV = "HOOKLOOP_ACCELERATE_FASTPATH"

#: fingerprints of the Accelerate code the fast path stands in for, each
#: checked line by line (accelerate 1.15.0; releases 1.9 to 1.16 have the
#: same code); add one after checking a new version's code and running
#: tests/loop/test_accelerate_fastpath.py (and update VERIFIED_RELEASES)
VERIFIED = {
    "AcceleratedOptimizer.step": {"df01b103c444a7dc"},
    "AcceleratedOptimizer.zero_grad": {"a1be53cba39b06a7"},
    "Accelerator.backward": {"79c32c236a8bcd44"},
    "AcceleratedScheduler.step": {"9baf1057c2ae0095"},
    "DataLoaderShard.__iter__": {"f6a0dc946182432d"},
    # the properties behind gradient_state.end_of_dataloader, read by end_of_dataloader()
    "GradientState.end_of_dataloader": {"e4e207b8b594bcee"},
    "GradientState.in_dataloader": {"bb7502ce3e61d642"},
    "GradientState.active_dataloader": {"283eeeedc681bf81"},
    "GradientState.dataloader_references": {"794ea7bb73db71e5"},
}


#: the oldest and the newest Accelerate release whose code is the code
#: ``VERIFIED`` names (said in the warning of another one)
VERIFIED_RELEASES = ("1.9", "1.16")


def _installed() -> dict:
    """The installed Accelerate's code that ``VERIFIED`` names, as it is now."""
    return {
        "AcceleratedOptimizer.step": AcceleratedOptimizer.step,
        "AcceleratedOptimizer.zero_grad": AcceleratedOptimizer.zero_grad,
        "Accelerator.backward": Accelerator.backward,
        "AcceleratedScheduler.step": AcceleratedScheduler.step,
        "DataLoaderShard.__iter__": DataLoaderShard.__iter__,
        **{f"GradientState.{name}": getattr(getattr(GradientState, name, None), "fget", None) for name in (
            "end_of_dataloader", "in_dataloader", "active_dataloader", "dataloader_references")},
    }


def _verified(name: str, func) -> bool:
    try:
        return fingerprint(func) in VERIFIED[name]
    except (OSError, TypeError, SyntaxError):  # no source to read: do not guess
        return False


def accelerate_verified() -> bool:
    """Whether the installed Accelerate's code (as it is now: a method
    replaced at run time counts as changed) is the code ``VERIFIED`` names."""
    return all(_verified(name, f) for name, f in _installed().items())


def _switched_off() -> bool:
    return os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off")


def enabled() -> bool:
    """The fast path is on: not switched off, and Accelerate is a verified one."""
    return not _switched_off() and accelerate_verified()


_said = False  # the warning of warn_if_unverified, once per process


def warn_if_unverified(stacklevel: int = 2) -> None:
    """Warn (``RuntimeWarning``, once per process; ``Loop(...)`` calls it)
    when the fast path is off because the installed Accelerate's own code is
    not the code ``VERIFIED`` names: another release than those checked, so
    every step makes Accelerate's own calls. Not when it is switched off
    (``HOOKLOOP_ACCELERATE_FASTPATH=0``), nor for a method replaced at run
    time (a profiler's or a plugin's wrapper: its author knows)."""
    global _said
    if _said or _switched_off():
        return
    differing = [name for name, f in _installed().items() if not _verified(name, f)
                 and (f is None or getattr(f, "__module__", "").split(".")[0] == "accelerate")]
    if not differing:
        return
    _said = True
    import accelerate

    warnings.warn(
        f"hookloop: accelerate {accelerate.__version__} is not a release hookloop's fast path was "
        f"checked against ({' to '.join(VERIFIED_RELEASES)}; its {', '.join(differing)} differ), so "
        "every step makes Accelerate's own calls: the same numbers, about 0.2 ms more a step on a CPU. "
        f"Install a checked release for the fast path, or set {ENV}=0 to run without it unwarned",
        RuntimeWarning,
        stacklevel=stacklevel + 1,
    )


class FastPath:
    """``backward``, ``step`` and ``zero_grad`` as a strategy calls them.

    :param accelerator: the loop's ``Accelerator``; its configuration is read
        once, here.
    """

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self._gradient_state = accelerator.gradient_state
        self.enabled = enabled()
        #: ``backward(loss)`` is ``loss.backward()``
        self.plain_backward = (
            self.enabled
            and type(accelerator).backward is Accelerator.backward
            and "backward" not in vars(accelerator)
            and accelerator.distributed_type
            not in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)
            and accelerator.scaler is None
            and accelerator.gradient_accumulation_steps == 1
        )
        # optimizer -> (wrapped optimizer, zero_grad takes set_to_none) or None
        self._plans: dict = {}
        # scheduler -> (inner scheduler, steps per update, one-cycle total) or None
        self._schedulers: dict = {}
        self._processes = accelerator.num_processes

    def sync_gradients(self) -> bool:
        """``accelerator.sync_gradients``."""
        return self._gradient_state.sync_gradients

    def end_of_dataloader(self) -> bool:
        """``accelerator.gradient_state.end_of_dataloader``: the active
        dataloader's flag, read from the weak reference Accelerate keeps (its
        properties build the list of every reference twice per read, ~1 µs;
        the loop asks after every batch)."""
        if not self.enabled:
            return self._gradient_state.end_of_dataloader
        last = self._gradient_state._dataloader_references_ref[-1]  # replaced, never mutated
        active = None if last is None else last()
        return active is not None and active.end_of_dataloader

    def backward(self, loss):
        """``accelerator.backward(loss)``."""
        if self.plain_backward:
            loss.backward()
        else:
            self.accelerator.backward(loss)

    def step(self, optimizer):
        """``optimizer.step()``."""
        plan = self._plans.get(optimizer, False)
        if plan is False:
            plan = self._plan(optimizer)
        if plan is None:
            optimizer.step()
        elif self._gradient_state.sync_gradients:
            plan[0].step(None)  # Accelerate passes closure=None positionally

    def zero_grad(self, optimizer):
        """``optimizer.zero_grad()``."""
        plan = self._plans.get(optimizer, False)
        if plan is False:
            plan = self._plan(optimizer)
        if plan is None:
            optimizer.zero_grad()
        elif self._gradient_state.sync_gradients:
            if plan[1]:
                plan[0].zero_grad(set_to_none=True)
            else:
                plan[0].zero_grad()

    def scheduler_step(self, scheduler):
        """``scheduler.step()``."""
        plan = self._schedulers.get(scheduler, False)
        if plan is False:
            plan = self._scheduler_plan(scheduler)
        if plan is None:
            scheduler.step()
            return
        gradient_state = self._gradient_state
        if not gradient_state.sync_gradients:
            if gradient_state.adjust_scheduler:
                plan[0]._step_count += 1
            return
        inner, optimizers = plan
        for opt in optimizers:  # only a gradient scaler sets it; kept for exactness
            if opt._is_overflow:
                return
        one_cycle = hasattr(inner, "total_steps")
        for _ in range(self._processes):  # per process: the schedule counts unsharded batches
            if not one_cycle or inner._step_count <= inner.total_steps:
                inner.step()

    def update(self, optimizer, scheduler):
        """``step(optimizer)``, ``scheduler_step(scheduler)`` (unless None),
        ``zero_grad(optimizer)``: the same calls in the same order, in one
        call when both plans are plain and gradients are synchronised (the
        step with no update hook implemented: three calls' lookups once)."""
        plan = self._plans.get(optimizer, False)
        splan = self._schedulers.get(scheduler, False) if scheduler is not None else None
        if (plan is False or not plan or splan is False or not self._gradient_state.sync_gradients
                or (scheduler is not None and splan is None)):
            self.step(optimizer)
            if scheduler is not None:
                self.scheduler_step(scheduler)
            self.zero_grad(optimizer)
            return
        inner = plan[0]
        inner.step(None)  # Accelerate passes closure=None positionally
        if splan is not None:
            schedule, optimizers = splan
            for opt in optimizers:  # only a gradient scaler sets it; kept for exactness
                if opt._is_overflow:
                    break
            else:
                one_cycle = hasattr(schedule, "total_steps")
                for _ in range(self._processes):
                    if not one_cycle or schedule._step_count <= schedule.total_steps:
                        schedule.step()
        if plan[1]:
            inner.zero_grad(set_to_none=True)
        else:
            inner.zero_grad()

    def _scheduler_plan(self, scheduler):
        plan = None
        if (self.enabled and type(scheduler) is AcceleratedScheduler and "step" not in vars(scheduler)
                and scheduler.step_with_optimizer and not scheduler.split_batches
                and all(type(o) is AcceleratedOptimizer and "step_was_skipped" not in vars(o)
                        for o in scheduler.optimizers)):
            plan = (scheduler.scheduler, list(scheduler.optimizers))
        self._schedulers[scheduler] = plan
        return plan

    def batches(self, data):
        """Iterate ``data`` (a prepared dataloader) as Accelerate does."""
        if not (self.enabled and type(data) is DataLoaderShard and "__iter__" not in vars(data)
                and not data.use_stateful_dataloader and not data.skip_batches
                and (data.device is None or data.device.type == "cpu")):
            return data
        return _shard_batches(data)

    def is_fast(self, optimizer) -> bool:
        """Whether ``step`` / ``zero_grad`` of this optimizer skip Accelerate."""
        plan = self._plans.get(optimizer, False)
        return (self._plan(optimizer) if plan is False else plan) is not None

    def forget(self):
        """Drop the references to optimizers and schedulers (``Loop.close``)."""
        self._plans.clear()
        self._schedulers.clear()

    def _plan(self, optimizer):
        plan = None
        if self.enabled and _plain_accelerated(optimizer):
            inner = optimizer.optimizer
            takes = "set_to_none" in inspect.signature(inner.zero_grad).parameters
            plan = (inner, takes)
        self._plans[optimizer] = plan
        return plan


def _plain_accelerated(optimizer) -> bool:
    """An ``AcceleratedOptimizer`` whose ``step`` would take the plain branch:
    no scaler, not XLA, not LOMO, nothing replaced on the instance."""
    if type(optimizer) is not AcceleratedOptimizer:
        return False
    if "step" in vars(optimizer) or "zero_grad" in vars(optimizer):
        return False
    if optimizer.scaler is not None:
        return False
    if optimizer.accelerator_state.distributed_type == DistributedType.XLA:
        return False
    from accelerate.utils import is_lomo_available

    if is_lomo_available():
        from lomo_optim import AdaLomo, Lomo

        if isinstance(optimizer.optimizer, (Lomo, AdaLomo)):
            return False
    return True


def _shard_batches(loader):
    """``DataLoaderShard.__iter__`` (accelerate 1.15) for a loader whose
    batches need no move (no device, or the CPU) and no state dict: the same
    batches in the same order, the same random-state synchronisation and
    gradient-state bookkeeping (``begin``, ``end_of_dataloader`` one batch
    ahead, ``end``), without ``send_to_device``."""
    if loader.rng_types is not None:
        synchronize_rng_states(loader.rng_types, loader.synchronized_generator)
    loader.begin()
    loader.set_epoch(loader.iteration)
    batches = loader.base_dataloader.__iter__()
    try:
        current = next(batches)
    except StopIteration:
        loader.end()
        return
    while True:
        try:
            upcoming = next(batches)
        except StopIteration:
            loader.end_of_dataloader = True
            yield current
            break
        yield current
        current = upcoming
    loader.iteration += 1
    loader.end()


# -- a resumed epoch's loader: the same on every Accelerate since 1.1 ----------------------


def skip_first_batches(accelerator, data, skip: int):
    """``accelerator.skip_first_batches(data, skip)``: the rest of an epoch
    of ``data`` after its first ``skip`` batches, as accelerate 1.15 gives it,
    on every release since 1.1:

    - before 1.15 (Accelerate PR 4071) the loader it returns starts at
      ``iteration`` 0, and iterating it calls ``set_epoch(0)`` on the sampler
      or the dataset it shares with ``data``: a sampler or a stream shuffled
      per epoch (``use_seedable_sampler=True``, a ``datasets`` stream's
      ``shuffle``) would draw epoch 0's order in any epoch. It is given
      ``data``'s ``iteration`` (the epoch ``data.set_epoch`` set), as 1.15
      gives it;
    - before 1.9 a ``DataLoaderShard`` with no batch left (an epoch resumed
      after its last batch) yields one ``None`` and then fails. Where its
      ``__iter__`` is not a verified one, nothing comes out of such a loader,
      and it ends as 1.9 ends it: the same random states drawn (its
      sampler's order, the loader's base seed), the same bookkeeping."""
    skipped = accelerator.skip_first_batches(data, skip)
    loader, epochs = _shard(skipped), _shard(data)
    if loader is not None and epochs is not None:
        loader.iteration = epochs.iteration
    if (skipped is loader and type(loader) is DataLoaderShard and _no_batch(loader)
            and not _verified("DataLoaderShard.__iter__", DataLoaderShard.__iter__)):
        return _NoBatchLeft(loader)
    return skipped


def _shard(loader):
    """The Accelerate loader that counts the epochs (``iteration``): the
    loader itself, or the one XLA's wrapper holds; None for another loader."""
    if hasattr(loader, "iteration"):
        return loader
    inner = getattr(loader, "dataloader", None)  # (MpDeviceLoaderWrapper)
    return inner if hasattr(inner, "iteration") else None


def _no_batch(loader) -> bool:
    """A loader of a map-style dataset that yields no batch (it skips all of
    its batches, or more: a resume onto shorter data)."""
    from torch.utils.data import IterableDataset

    if isinstance(loader.dataset, IterableDataset):  # (a stream: skipped by counting, never empty here)
        return False
    try:
        return len(loader) == 0
    except ValueError:  # SkipBatchSampler's length is negative when it skips more than there is
        return True
    except TypeError:
        return False


class _NoBatchLeft:
    """An empty ``DataLoaderShard`` of an Accelerate whose iteration is not
    the verified one, iterated as accelerate >= 1.9 iterates it: what an
    older one yields for it (its ``None``) is dropped, and its iteration
    ended where it would fail. (Its ``base_dataloader`` is the loader's, for
    :func:`hookloop.rng.shuffling_from`.)"""

    def __init__(self, loader):
        self.loader = loader
        self.base_dataloader = loader.base_dataloader

    def __iter__(self):
        batches = iter(self.loader)
        if next(batches, _END) is not _END:  # accelerate < 1.9: a None, then UnboundLocalError
            batches.close()
            self.loader.end()
        yield from ()


_END = object()
