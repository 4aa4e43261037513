"""The learning-rate finder behind :meth:`Loop.find_lr`: a range test that
leaves the run as it was.

Lightning's ``Tuner(trainer).lr_find(model)``
(``lightning/pytorch/tuner/lr_finder.py``) is the model: its defaults
(``min_lr=1e-8``, ``max_lr=1``, ``num_training=100``, ``mode="exponential"``,
``early_stop_threshold=4.0``), its loss smoothing (a running average with
``beta=0.98``, bias-corrected), its stop when the smoothed loss exceeds
``early_stop_threshold`` times the best one, and its suggestion (the point of
the steepest fall of the smoothed loss, the first 10 and the last point
skipped; the slope taken along the log of the learning rate, not the learning
rate: :func:`steepest_descent` says why). The Hugging Face Trainer has none
(``hyperparameter_search`` runs whole trainings).

The sweep is up to ``num_training`` optimizer updates of the loop's own
training step (the strategy's ``training_step``: a GAN or a custom strategy,
gradient clipping, gradient accumulation and mixed precision behave as in
training), with every param group of the swept networks' optimizers at the
update's learning rate. What runs, for every plugin but those that declare
they only observe (``changes_training = False``: a progress bar, a
learning-rate monitor, a profiler): ``before_step`` (which may skip a batch),
``training_step`` and every hook a strategy calls inside it
(``compute_loss``, ``before_backward`` / ``after_backward``,
``commit_update``, the optimizer, scheduler and ``zero_grad`` hooks). What
never runs: ``after_step``, the fit, epoch, evaluation, safe-point and
checkpoint hooks, ``on_exception``. ``loop.state.stage`` is ``"find_lr"``
meanwhile. The swept networks' schedulers are set aside (the sweep's schedule
replaces them, as Lightning's does): they do not step and their hooks do not
run; the other networks train as in a fit.

Afterwards everything is put back (:class:`~hookloop.run_snapshot.RunSnapshot`):
every network's parameters, buffers, gradients and modes, every optimizer's
state and param groups, every scheduler's state, the gradient scaler,
Accelerate's accumulation counter, each stateful plugin whose step hooks ran
(``state_dict()``), the run state (``loop.state``: position, logged values,
requests), the global random states, the training data's generators, its own
samplers' states, its epoch counter and a stateful loader's state; an
interrupted pass over the data is ended. A ``fit`` after ``find_lr`` is
bitwise the ``fit`` without it. Memory: a copy of the parameters, buffers and
optimizer states is held on the CPU while it runs.

Several processes: each runs the same number of updates; the loss of each
update is averaged over the processes before it is smoothed, so every process
sees the same curve and stops at the same update.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

import torch

from . import checks
from .batches import abandon
from .checkpointing import stateful_plugins
from .discovery import changes_training
from .errors import add_note
from .relay import HookRelay, _noop, _noop_broadcast
from .run_snapshot import RunSnapshot
from .strategies.base import StepOutput
from .validation import hook_names

#: how the learning rate grows from ``min_lr`` to ``max_lr``
MODES = ("exponential", "linear")
#: Lightning's smoothing of the recorded loss (its ``_LRCallback(beta=0.98)``)
BETA = 0.98
#: Lightning's ``suggestion(skip_begin=10, skip_end=1)``: points left out at
#: the start (a fall there is the average settling) and at the end (the stop)
SKIP_BEGIN, SKIP_END = 10, 1
#: ``loop.state.stage`` during the sweep
STAGE = "find_lr"
#: the hooks of one training step (``before_step``, the strategy's step and
#: what it calls): a stateful plugin implementing one gets its state put back
STEP_HOOKS = ("before_step", "training_step", "compute_loss", "before_backward", "after_backward",
              "commit_update", "before_optimizer_step", "after_optimizer_step", "before_scheduler_step",
              "after_scheduler_step", "before_zero_grad", "after_zero_grad")


# -- the result ---------------------------------------------------------------------


@dataclass(repr=False)
class LRFinderResult:
    """What :meth:`Loop.find_lr` found: the curve, the suggestion, the plot.

    ``lrs[i]`` is the learning rate of the i-th recorded update, ``losses[i]``
    its smoothed loss (what the suggestion and the plot use), ``raw_losses[i]``
    the loss as trained (averaged over the batches of an accumulated update
    and over processes). ``stopped`` says why the sweep ended before
    ``num_training`` updates (the loss diverged), or is None.
    """

    lrs: list[float]
    losses: list[float]
    raw_losses: list[float]
    mode: str = "exponential"
    stopped: str | None = None
    #: whether :meth:`plot` writes (the main process; the others write nothing)
    main_process: bool = field(default=True, compare=False)
    #: the learning rate where the smoothed loss falls fastest, or None (``reason`` says why)
    suggestion: float | None = field(init=False)
    #: its index in ``lrs``, or None
    suggestion_index: int | None = field(init=False)
    #: why there is no suggestion, or None
    reason: str | None = field(init=False)

    def __post_init__(self) -> None:
        self.suggestion_index, self.reason = steepest_descent(self.lrs, self.losses, self.mode)
        self.suggestion = None if self.suggestion_index is None else self.lrs[self.suggestion_index]

    def suggest(self, skip_begin: int = SKIP_BEGIN, skip_end: int = SKIP_END) -> float | None:
        """The suggestion with other points left out (Lightning's
        ``suggestion(skip_begin, skip_end)``); None if there is none."""
        index, _ = steepest_descent(self.lrs, self.losses, self.mode, skip_begin, skip_end)
        return None if index is None else self.lrs[index]

    def plot(self, path: str | PathLike[str]) -> Path:
        """Write the smoothed loss against the learning rate as a PNG at
        ``path`` (log x axis in exponential mode; the suggestion marked in
        red) and return the path. Only the main process writes. Needs Pillow
        (``pip install pillow``, or ``hookloop[demo]``)."""
        from .lr_plot import draw

        path = Path(path)
        if self.main_process:
            title = ("learning-rate finder: " + (f"suggestion {self.suggestion:.3g}" if self.suggestion is not None
                                                 else "no suggestion"))
            draw(self.lrs, self.losses, path, log_x=self.mode == "exponential",
                 marked=self.suggestion_index, title=title)
        return path

    def __repr__(self) -> str:
        span = f"{self.lrs[0]:.3g} to {self.lrs[-1]:.3g}" if self.lrs else "no point"
        said = f"suggestion={self.suggestion:.3g}" if self.suggestion is not None else f"no suggestion: {self.reason}"
        end = f"; stopped: {self.stopped}" if self.stopped else ""
        return f"LRFinderResult({len(self.lrs)} updates, lr {span}, {said}{end})"


def steepest_descent(lrs: Sequence[float], losses: Sequence[float], mode: str = "exponential",
                     skip_begin: int = SKIP_BEGIN, skip_end: int = SKIP_END) -> tuple[int | None, str | None]:
    """The index of the point where the smoothed loss falls fastest, and
    None, or None and why there is none. Lightning's rule: the first
    ``skip_begin`` and the last ``skip_end`` points and non-finite losses
    are left out, the slope at each point is ``torch.gradient`` (central
    differences), its most negative value wins. The slope is taken along the
    plot's axis: the log of the learning rate in exponential mode, the
    learning rate in linear mode. (Lightning takes it against the learning
    rate itself, which divides the fall at each point by the learning rate
    there: a wobble of the loss at 1e-7 then outweighs a descent at 0.1 a
    million times over, and on the curves of ``tests/loop/test_lr_finder.py``
    its rule picks about 1e-7.)"""
    for name, value in (("skip_begin", skip_begin), ("skip_end", skip_end)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    n = len(losses)
    kept = [i for i in range(skip_begin, n - skip_end) if math.isfinite(losses[i])]
    if len(kept) < 2:
        return None, (f"the curve has {n} point(s), {len(kept)} finite after leaving out the first "
                      f"{skip_begin} and the last {skip_end}; the steepest fall needs 2: raise num_training, "
                      "or lower max_lr if the loss diverged early")
    x = torch.tensor([math.log10(lrs[i]) if mode == "exponential" else lrs[i] for i in kept], dtype=torch.float64)
    y = torch.tensor([losses[i] for i in kept], dtype=torch.float64)
    slope = torch.gradient(y, spacing=(x,))[0]
    best = int(torch.argmin(slope))
    if not float(slope[best]) < 0:
        return None, (f"the smoothed loss falls nowhere between lr {lrs[kept[0]]:.3g} and {lrs[kept[-1]]:.3g}: "
                      "try a larger max_lr or more updates (num_training)")
    return kept[best], None


def learning_rates(min_lr: float, max_lr: float, num_training: int, mode: str) -> list[float]:
    """The learning rate of each update: ``min_lr`` at the first, ``max_lr``
    at the last, evenly spaced in log10 (exponential) or linearly between.
    (Lightning's schedulers skip the second point: ``min_lr``, then
    ``min_lr * (max_lr / min_lr) ** (2 / num_training)``.)"""
    last = num_training - 1
    if mode == "exponential":
        ratio = math.log(max_lr / min_lr)
        lrs = [min_lr * math.exp(ratio * i / last) for i in range(num_training)]
    else:
        lrs = [min_lr + (max_lr - min_lr) * i / last for i in range(num_training)]
    lrs[0], lrs[-1] = min_lr, max_lr
    return lrs


# -- the sweep ------------------------------------------------------------------------


def find_lr(loop: Any, *, min_lr: float = 1e-8, max_lr: float = 1.0, num_training: int = 100,
            mode: str = "exponential", early_stop_threshold: float | None = 4.0,
            networks: str | Iterable[str] | None = None, monitor: str | None = None) -> LRFinderResult:
    """:meth:`Loop.find_lr` (see there and the module's docstring)."""
    check_arguments(min_lr, max_lr, num_training, mode, early_stop_threshold)
    check_loop(loop)
    swept = swept_networks(loop, networks)
    if monitor is not None and monitor not in loop.networks:
        raise ValueError(f"find_lr(monitor={monitor!r}): no such network; the loop's networks are "
                         f"{sorted(loop.networks)} (the strategy's losses are keyed by network)")
    schedule = learning_rates(min_lr, max_lr, num_training, mode)
    curve = _Curve(num_training, early_stop_threshold)
    snapshot = RunSnapshot(loop, plugins=[plugin for _, plugin in stepping_stateful_plugins(loop)])
    try:
        _sweep(loop, swept, schedule, curve, monitor)
    except Exception as exc:
        culprit = loop.plugins.culprit(exc)
        if culprit is not None:
            add_note(exc, f"hookloop: raised in hook {culprit[1]!r} of plugin {culprit[0]!r} during find_lr")
        raise
    finally:
        snapshot.restore()
    return LRFinderResult(curve.lrs, curve.losses, curve.raw, mode=mode, stopped=curve.stopped,
                          main_process=bool(loop.accelerator.is_main_process))


def check_arguments(min_lr: float, max_lr: float, num_training: int, mode: str,
                    early_stop_threshold: float | None) -> None:
    """Arguments that mean a sweep, or an error naming the one that does not."""
    if mode not in MODES:
        raise ValueError(f"find_lr: mode must be 'exponential' or 'linear', got {mode!r}")
    for name, value in (("min_lr", min_lr), ("max_lr", max_lr)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"find_lr: {name} must be a finite number, got {value!r}")
    if mode == "exponential" and min_lr <= 0:
        raise ValueError(f"find_lr: min_lr must be positive with mode='exponential' (the learning rates are "
                         f"spaced evenly in log10), got {min_lr!r}")
    if min_lr < 0:
        raise ValueError(f"find_lr: min_lr must not be negative, got {min_lr!r}")
    if min_lr >= max_lr:
        raise ValueError(f"find_lr: min_lr ({min_lr!r}) must be smaller than max_lr ({max_lr!r}): the sweep "
                         "goes from min_lr up to max_lr")
    if not isinstance(num_training, int) or isinstance(num_training, bool) or num_training < 2:
        raise ValueError(f"find_lr: num_training must be an int of at least 2 (optimizer updates, each at "
                         f"its own learning rate), got {num_training!r}; a suggestion needs more than "
                         f"{SKIP_BEGIN + SKIP_END + 1} (Lightning's default: 100)")
    if early_stop_threshold is not None and (
            isinstance(early_stop_threshold, bool) or not isinstance(early_stop_threshold, (int, float))
            or not early_stop_threshold > 1):
        raise ValueError(f"find_lr: early_stop_threshold must be a number above 1 (the sweep stops when the "
                         f"smoothed loss exceeds it times the best so far) or None, got {early_stop_threshold!r}")


def swept_networks(loop: Any, networks: str | Iterable[str] | None) -> list[Any]:
    """The networks whose learning rate the sweep sets: the named ones, by
    default every network the loop trains (one with an optimizer, not a
    strategy's frozen one)."""
    trained = {n.name: n for n in loop._trainable if n.optimizer is not None}
    if networks is None:
        if not trained:
            raise ValueError("find_lr: no network of this loop has an optimizer: there is no learning rate to sweep")
        return list(trained.values())
    names = [networks] if isinstance(networks, str) else list(networks)
    if not names:
        raise ValueError(f"find_lr(networks=[]): name the networks to sweep, of {sorted(trained)}")
    for name in names:
        if name not in loop.networks:
            raise ValueError(f"find_lr(networks=...): no network {name!r}; the loop's networks are "
                             f"{sorted(loop.networks)}")
        if name not in trained:
            raise ValueError(f"find_lr(networks=...): network {name!r} is not trained (a frozen network, or "
                             f"one without an optimizer): the trained ones are {sorted(trained)}")
    return [trained[name] for name in dict.fromkeys(names)]


def check_loop(loop: Any) -> None:
    """A loop that can sweep now: open, not inside a fit, with data it can
    iterate again."""
    if loop._closed:
        raise RuntimeError("find_lr: this Loop is closed (loop.close() released its prepared objects): "
                           "build a new Loop")
    if loop.state.stage is not None:
        raise RuntimeError(f"find_lr cannot run inside {loop.state.stage!r} (called from a hook): call it "
                           "before fit, or between two fits")
    checks.train_data(loop.train_data)
    if isinstance(loop.train_data, Iterator):
        raise TypeError(f"find_lr: train_data is an iterator ({type(loop.train_data).__name__}): the sweep "
                        "would use up batches the fit then misses. Pass something that iterates afresh "
                        "each time (a DataLoader, a list of batches)")


@dataclass
class _Curve:
    """The recorded updates, Lightning's smoothing and divergence stop."""

    total: int
    threshold: float | None
    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)
    updates: int = 0
    stopped: str | None = None
    _average: float = 0.0
    _best: float = math.inf

    def add(self, lr: float, loss: float | None) -> bool:
        """Record an update (``loss`` None: it had no monitored loss); True
        when the sweep is over."""
        self.updates += 1
        if loss is not None:
            i = len(self.losses)
            self._average = BETA * self._average + (1 - BETA) * loss
            smoothed = self._average / (1 - BETA ** (i + 1))
            self.lrs.append(lr)
            self.raw.append(loss)
            self.losses.append(smoothed)
            where = f"at update {self.updates} (lr {lr:.3g})"
            if not math.isfinite(smoothed):
                self.stopped = f"the loss was {loss} {where}"
                return True
            # (a best at or below 0, a critic's loss, has no "times the best")
            if (self.threshold is not None and i > 0 and self._best > 0
                    and smoothed > self.threshold * self._best):
                self.stopped = (f"the smoothed loss {smoothed:.4g} exceeded {self.threshold:g} times the best "
                                f"{self._best:.4g} {where}: it diverged")
                return True
            self._best = min(self._best, smoothed)
        return self.updates >= self.total


def _sweep(loop: Any, swept: list[Any], schedule: list[float], curve: _Curve, monitor: str | None) -> None:
    """Train update after update at the schedule's learning rates until the
    curve is complete or diverged, passing over the training data as many
    times as needed. Changes the run: :class:`RunSnapshot` puts it back."""
    state, acc = loop.state, loop.accelerator
    state.stage = STAGE
    loop.plugins.hook = TrainingHooks(loop.plugins)
    for network in swept:
        network.scheduler = None  # the sweep's schedule replaces it
    for network in loop._trainable:
        network.model.train()
    loop._start_accumulation()  # an update boundary: Accelerate's micro-step counter restarts
    k, hook, gradient_state = loop._accumulation, loop.hook, acc.gradient_state
    quiet_before = hook.unimplemented(("before_step",))
    group: list[torch.Tensor] = []  # the monitored losses of the update's batches
    while True:
        before = list(gradient_state.dataloader_references)
        batches = iter(loop.fastpath.batches(loop.train_data))
        drawn = 0
        try:
            for batch in batches:
                drawn += 1
                lr = schedule[curve.updates]
                set_learning_rate(swept, lr)
                loop._logbook.step = state.global_step + 1
                if not quiet_before:
                    hook.before_step(loop=loop, batch=batch)
                if state.skip_batch:
                    state.skip_batch = False
                    continue
                result = hook.training_step(loop=loop, batch=batch)
                if type(result) is not StepOutput:
                    result = checks.step_output(loop, result)
                state.micro_step += 1
                loss = monitored_loss(result.loss, monitor, swept)
                if loss is not None:
                    group.append(loss.detach())
                if loop._discarded:  # commit_update said no: not an update
                    loop._discarded = False
                    loop.discarded_updates += 1
                    group.clear()
                    continue
                if not (k == 1 or gradient_state.sync_gradients):
                    continue
                state.global_step += 1
                if curve.add(lr, _mean_over_processes(group, acc)):
                    return
                group.clear()
        finally:
            abandon(batches, acc, before)  # (a pass that ran out ended itself)
        if not drawn:
            raise ValueError("find_lr: train_data gave no batch")


def set_learning_rate(networks: Iterable[Any], lr: float) -> None:
    """Every param group of each network's optimizer at ``lr`` (a tensor
    learning rate keeps its tensor)."""
    for network in networks:
        for group in network.optimizer.param_groups:
            current = group["lr"]
            if isinstance(current, torch.Tensor):
                current.fill_(lr)
            else:
                group["lr"] = lr


def monitored_loss(loss: Any, monitor: str | None, swept: list[Any]) -> torch.Tensor | None:
    """The loss the curve follows from a ``StepOutput.loss``: the tensor, or
    the ``monitor`` entry of a dict keyed by network (default: the one
    swept network's); None when this batch has none (a GAN's generator
    under ``n_critic > 1``)."""
    if isinstance(loss, torch.Tensor):
        if monitor is not None:
            raise ValueError(f"find_lr(monitor={monitor!r}): training_step returns one loss (a tensor), not "
                             "one per network: leave monitor out")
        return loss
    if isinstance(loss, Mapping):
        key = monitor
        if key is None:
            if len(swept) != 1:
                raise ValueError(
                    f"find_lr: training_step returns a loss per network ({', '.join(map(repr, loss))}) and "
                    f"{len(swept)} networks are swept: say which loss the curve follows, "
                    f"find_lr(monitor={next(iter(loss))!r}), or sweep one network, find_lr(networks=[...])")
            key = swept[0].name
        value = loss.get(key)
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"find_lr: the loss of {key!r} is a {type(value).__name__}, not a tensor")
        return value
    raise TypeError(f"find_lr: training_step's loss is a {type(loss).__name__}, not a tensor or a dict of "
                    "tensors keyed by network")


def _mean_over_processes(group: list[torch.Tensor], accelerator: Any) -> float | None:
    """The update's loss: the mean of its batches', averaged over processes
    (one sync per update, the sweep's only)."""
    if not group:
        return None
    value = torch.stack([loss.reshape(()).float() for loss in group]).mean()
    if accelerator.num_processes > 1:
        value = accelerator.reduce(value, reduction="mean")
    return float(value)


class TrainingHooks(HookRelay):
    """``loop.hook`` during the sweep: the loop's own callers, less the
    implementations of plugins that declare they only observe
    (``changes_training = False``); as in Lightning's ``lr_find``, which
    runs none of the callbacks."""

    def __init__(self, plugins: Any) -> None:
        super().__init__(plugins.pm)
        self._loop_relay = plugins.hook
        self._observers = [p for _, p in plugins.pm.list_name_plugin()
                           if p is not None and changes_training(p) is False]
        self._observer_names = {plugins.name_of(p) for p in self._observers}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in hook_names():
            raise AttributeError(f"{name!r} is not a hookloop hook")
        caller = getattr(self._pm.hook, name)
        owners = {impl.plugin_name for impl in caller.get_hookimpls()}
        found: Any
        if not owners & self._observer_names:
            found = getattr(self._loop_relay, name)
        elif owners <= self._observer_names:
            found = _noop if caller.spec is not None and caller.spec.opts.get("firstresult") else _noop_broadcast
        else:
            found = self._pm.subset_hook_caller(name, self._observers)
        setattr(self, name, found)
        return found


def stepping_stateful_plugins(loop: Any) -> list[tuple[str, Any]]:
    """The stateful plugins (``state_dict`` / ``load_state_dict``) that
    implement a step hook and run during the sweep (not observers)."""
    pm = loop.plugins.pm
    stepping = {impl.plugin_name for name in STEP_HOOKS for impl in getattr(pm.hook, name).get_hookimpls()}
    return [(name, plugin) for name, plugin in stateful_plugins(loop)  # type: ignore[no-untyped-call]
            if name in stepping and changes_training(plugin) is not False]


__all__ = ["LRFinderResult", "find_lr", "learning_rates", "steepest_descent"]
