"""Who logged what: ``loop.log`` (to the trackers, into an epoch's or an
evaluation's reductions) and the metrics dicts plugins receive.

Two plugins writing one key is an error naming both (two instances of one
plugin logging ``clip_fraction`` would otherwise be averaged into one curve;
a plugin returning ``eval_loss`` next to the built-in metrics would be
averaged with them), unless the writer declares that it replaces the other:
a class attribute ``replaces = ("metrics",)`` (plugin names). A plugin tells
its instances apart with ``loop.plugins.name_of(self)``.

Values logged while a batch is trained share one step number on the
trackers: the update the batch belongs to, whether they are logged from
``before_step``, ``after_optimizer_step`` or ``after_step``.

A value logged ``on_step`` is one number (a tracker's point): a tensor or
array of several values is refused at the ``loop.log`` call, on every
process, with or without trackers (checked from its shape alone: no device
sync). Images go through ``loop.log_images``, at the same step number.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch

from .epoch_values import EpochValues
from .trackers import TrackerSession, image_batch, send_images

if TYPE_CHECKING:  # names for the annotations only
    from .state import LoopState


def replaces(plugins: Any, writer: str | None, owner: str | None, key: str = "") -> bool:
    """Whether plugin ``writer``'s value of ``key`` replaces plugin ``owner``'s:
    ``writer`` declares so (``replaces = ("owner",)``), or ``owner`` is a
    default built-in and ``writer`` a plugin the user chose (a default gives
    way: said once, at info level)."""
    if writer is None or owner is None:
        return False
    declared = getattr(plugins.get(writer), "replaces", ())
    if owner in ((declared,) if isinstance(declared, str) else tuple(declared or ())):
        return True
    sources = getattr(plugins, "sources", {})
    if sources.get(owner) != "built-in" or sources.get(writer, "built-in") == "built-in":
        return False
    if (key, owner, writer) not in plugins.gave_way:
        plugins.gave_way.add((key, owner, writer))
        import logging

        logging.getLogger("hookloop").info(
            "hookloop: %r is written by plugin %r and by the built-in default %r: the default gives way "
            "(%r's value is kept; block=[%r] leaves it out)", key, writer, owner, writer, owner)
    return True


def one_number(key: str, value: Any, writer: str | None) -> None:
    """``loop.log(on_step=True)``'s check that ``value`` is one number (a
    tracker's point): a tensor or array of several values (or none) is an
    error naming ``key``, its shape and what to log instead. Reads the
    shape only: no device sync."""
    if isinstance(value, torch.Tensor):
        count = value.numel()
    else:
        shape = getattr(value, "shape", None)  # a numpy (or other) array; a numpy number has shape ()
        if not isinstance(shape, tuple):
            return
        count = math.prod(shape)
    if count == 1:
        return
    shape = list(value.shape)
    who = f" (plugin {writer!r})" if writer else ""
    kind = "tensor" if isinstance(value, torch.Tensor) else type(value).__name__
    raise ValueError(
        f"loop.log: {key!r}{who} is a {kind} of shape {shape} ({count} values), not one number: "
        "a value logged on_step is one point of a tracker's curve. For the epoch's reduction of "
        f"every value, log it with on_step=False, on_epoch=True; for an image (or a batch of them), "
        f"loop.log_images({{{key!r}: image}}); else log one number (value.mean(), value[i])")


def collision(what: str, key: str, owner: str, writer: str) -> ValueError:
    return ValueError(
        f"{what} {key!r} is written by plugin {owner!r} and by plugin {writer!r}: their values "
        f"would be mixed into one. Give one of them another key (a plugin knows its own name: "
        f"loop.plugins.name_of(self), e.g. f\"{{name}}/{key}\"), block one (block=[...]), or "
        f"declare in the one that should win: replaces = ({owner!r},)"
    )


class Logbook:
    """A loop's logging: the trackers (:class:`~hookloop.trackers.TrackerSession`),
    the evaluation's ``loop.log(on_epoch=True)`` values, who wrote which key."""

    def __init__(self, accelerator: Any, plugins: Any) -> None:
        self.accelerator = accelerator
        self.plugins = plugins
        self.trackers = TrackerSession(accelerator)
        #: loop.log(on_epoch=True) during an evaluation
        self.eval_values = EpochValues()
        #: while a batch is trained: the number of the update it belongs to
        self.step: int | None = None
        self._step_owners: dict[str, tuple[str, int]] = {}  # tracker key -> (plugin, step), this fit
        self._told_untracked = False  # said once where loop.log's values go without a tracker
        self._told_imageless: set[str] = set()  # trackers said to take no images
        #: loop.log's latest on_step values that no tracker took (main process; plugins/progress.py shows them)
        self.untracked: dict[str, Any] = {}
        #: what shows :attr:`untracked` this fit ("the progress bar", "the progress lines"; set by it), or None
        self.untracked_shown_by: str | None = None

    def start_fit(self) -> None:
        self._step_owners = {}
        self.untracked.clear()

    def writer(self, depth: int) -> str | None:
        """The registered plugin whose method is ``depth`` frames up, or None."""
        caller = sys._getframe(depth + 1).f_locals.get("self")
        return None if caller is None else self.plugins.name_of(caller)

    def log(self, state: LoopState, values: Mapping[str, Any], on_step: bool, on_epoch: bool,
            reduce: str, writer: str | None) -> None:
        if on_step:
            for key, value in values.items():
                if not isinstance(value, (float, int, str)):
                    one_number(key, value, writer)
        if on_epoch:
            stage = state.stage
            if stage == "eval":
                self._add(self.eval_values, values, reduce, writer)
            elif stage not in ("sanity", "predict"):
                self._add(state.logged, values, reduce, writer)
        if on_step:
            acc = self.accelerator
            step = self.step_of(state)
            if writer is not None:
                values = self._claim_step(values, writer, step)
            if not acc.is_main_process:
                return
            if not self._tracked("loop.log", values, writer):
                self.untracked.update(values)  # references: nothing read here
                return
            acc.log({k: v.item() if isinstance(v, torch.Tensor) else v for k, v in values.items()},
                    step=step)

    def step_of(self, state: LoopState) -> int:
        """The step number values logged now go to the trackers at."""
        return self.step if self.step is not None else state.global_step

    def log_images(self, state: LoopState, images: Mapping[str, Any]) -> None:
        """``loop.log_images``: checked on every process (shapes only), sent
        from the main process, on the CPU, to the trackers that take images
        (:func:`~hookloop.trackers.send_images`); the others named once."""
        batches = {key: image_batch(key, value) for key, value in images.items()}
        acc = self.accelerator
        if not batches or not acc.is_main_process or not self._tracked("loop.log_images", batches):
            return
        cpu = {key: batch.detach().cpu() for key, batch in batches.items()}
        refused = [n for n in send_images(acc.trackers, cpu, self.step_of(state)) if n not in self._told_imageless]
        if refused:
            self._told_imageless.update(refused)
            took = len(refused) < len(acc.trackers)
            print(f"hookloop: loop.log_images({', '.join(map(repr, list(batches)[:3]))}...): tracker"
                  f"{'s' if len(refused) > 1 else ''} {', '.join(map(repr, refused))} take"
                  f"{'' if len(refused) > 1 else 's'} no images (no log_images method)"
                  f"{'; the others got them' if took else ''}. TensorBoard, W&B, Aim, ClearML and "
                  "SwanLab take images", file=sys.stderr)

    def _tracked(self, call: str, values: Mapping[str, Any], writer: str | None = None) -> bool:
        """Whether trackers run (started now, inside a fit, if configured);
        if none is configured, said once (on the main process), unless the
        plugin that logs prints what it logs (``Logger(console=True)``: its
        values are on the console, as its user asked)."""
        if self.accelerator.trackers or (self.trackers.fitting and self.trackers.start()):
            return True
        if not self._told_untracked and not self._prints_what_it_logs(writer):  # said once
            self._told_untracked = True
            hint = ("(or 'wandb', 'mlflow', hookloop.trackers.JSONLinesTracker(dir)) records every value; "
                    "on_epoch=True values reach the epoch's metrics either way" if call == "loop.log"
                    else "(or 'wandb') records them")
            shown = self.untracked_shown_by if call == "loop.log" else None
            print(f"hookloop: {call}({', '.join(map(repr, list(values)[:3]))}...) goes to no tracker: "
                  f"none is configured. Accelerator(log_with='tensorboard', project_dir=...) {hint}"
                  + (f"; meanwhile the latest values are shown on {shown}" if shown else ""),
                  file=sys.stderr)
        return False

    def _prints_what_it_logs(self, writer: str | None) -> bool:
        """Whether the plugin ``writer`` prints the values it logs (it says so
        with ``prints_what_it_logs = True``, as ``Logger(console=True)`` does)."""
        plugin = None if writer is None else self.plugins.get(writer)
        return getattr(plugin, "prints_what_it_logs", False) is True

    def _claim_step(self, values: Mapping[str, Any], writer: str, step: int) -> Mapping[str, Any]:
        """Two plugins logging one key at one step: the trackers would keep one
        of the two values (at different steps they are one curve, as two
        loggers at different intervals)."""
        owners = self._step_owners
        kept = values
        for key in values:
            previous = owners.get(key)
            owners[key] = (writer, step)
            if previous is None or previous[0] == writer or previous[1] != step:
                continue
            owner = previous[0]
            if replaces(self.plugins, owner, writer, key):
                owners[key] = previous
                kept = {k: v for k, v in kept.items() if k != key}
            elif not replaces(self.plugins, writer, owner, key):
                raise collision(f"loop.log key (at step {step})", key, owner, writer)
        return kept

    def _add(self, target: EpochValues, values: Mapping[str, Any], reduce: str,
             writer: str | None) -> None:
        if writer is not None:
            values = self._claim(target.owners, values, writer, "loop.log(on_epoch=True) key",
                                 target)
        target.add(values, reduce)

    def _claim(self, owners: dict[str, str], values: Mapping[str, Any], writer: str, what: str,
               target: EpochValues | None = None) -> Mapping[str, Any]:
        """``values`` less those another plugin owns and replaces this
        writer's; an error for a key another plugin owns otherwise."""
        kept = values
        for key in values:
            owner = owners.setdefault(key, writer)
            if owner == writer:
                continue
            if replaces(self.plugins, writer, owner, key):
                owners[key] = writer
                if target is not None:
                    target.forget(key)  # the replaced plugin's values of the epoch go
            elif replaces(self.plugins, owner, writer, key):
                kept = {k: v for k, v in kept.items() if k != key}
            else:
                raise collision(what, key, owner, writer)
        return kept


class Metrics(dict[str, float]):
    """The metrics of an evaluation or an epoch, as ``on_eval_end`` and
    ``on_epoch_end`` receive them: numbers (floats, ints) by name, so that
    what ``fit`` returns and what trackers get is plain data. Setting a
    value that is not a number (a tensor: write ``float(t)`` or
    ``t.item()``) is a ``TypeError``, and setting a key another plugin
    wrote is an error naming both (unless one ``replaces`` the other), both
    raised where the plugin sets it."""

    def __init__(self, items: Any = (), *, plugins: Any = None,
                 owners: Mapping[str, str | None] | None = None, eval_sets: Any = ()) -> None:
        super().__init__()
        self._plugins = plugins
        self._owners: dict[str, str | None] = {}
        #: the names of the evaluation sets whose metrics these are (none: one set)
        self.eval_sets: tuple[str, ...] = tuple(eval_sets)
        for key, value in dict(items).items():
            self._put(key, value, (owners or {}).get(key))

    def __setitem__(self, key: str, value: object) -> None:
        self._put(key, value, self._writer())

    def update(self, *args: Any, **kwargs: Any) -> None:
        writer = self._writer()
        for key, value in dict(*args, **kwargs).items():
            self._put(key, value, writer)

    def setdefault(self, key: str, default: object = None) -> float:
        if key not in self:
            self._put(key, default, self._writer())
        return self[key]

    def __missing__(self, key: str) -> float:
        hint = (f"; hookloop names it {'eval_' + key[4:]!r} (Lightning's {key!r})"
                if key.startswith("val_") else "")
        raise KeyError(f"metrics[{key!r}]: there is no such metric here; the metrics are "
                       f"{sorted(self) or 'none'}{hint}")

    def _writer(self) -> str | None:
        if self._plugins is None:
            return None
        caller = sys._getframe(2).f_locals.get("self")
        return None if caller is None else self._plugins.name_of(caller)

    def _put(self, key: str, value: object, writer: str | None) -> None:
        if isinstance(value, torch.Tensor) and value.numel() == 1 and writer is None:
            value = value.item()  # the loop's own reductions
        if not isinstance(value, numbers.Real):
            who = f" (plugin {writer!r})" if writer else ""
            raise TypeError(
                f"metrics[{key!r}] is a {type(value).__module__}.{type(value).__qualname__}{who}: "
                "metrics are numbers (what fit() returns and trackers get); write float(value), "
                "or value.item() for a one-element tensor"
            )
        if (len(self.eval_sets) > 1 and writer is not None and key.startswith("eval_")
                and not key.startswith(tuple(f"eval_{s}_" for s in self.eval_sets))):
            raise ValueError(
                f"metrics[{key!r}] (plugin {writer!r}): these are the metrics of several evaluation "
                f"sets ({', '.join(self.eval_sets)}), and {key!r} names none of them, so its value would "
                "mix them. Keep one result per set (after_eval_step's eval_set) and write each under its "
                "name: hookloop.evaluation.metric_key(eval_set, " f"{key!r})")
        owner = self._owners.get(key)
        if key in self and owner is not None and writer is not None and owner != writer:
            if replaces(self._plugins, owner, writer, key):
                return  # the owner replaces this writer's value
            if not replaces(self._plugins, writer, owner, key):
                raise collision("metrics key", key, owner, writer)
        # a Real (int, float, a numpy number) stands for a float
        dict.__setitem__(self, key, cast(float, value))
        if writer is not None or key not in self._owners:
            self._owners[key] = writer
