"""A resumed run extended past the end of its learning-rate schedule, said at
the start of the fit that extends it.

``fit(epochs=3)`` with a schedule built for its 24 updates, then a new process
resumes with ``fit(epochs=5)``: a linear decay trains the 16 more updates at a
learning rate of 0; a ``OneCycleLR`` gets its ``total_steps`` back from the
checkpoint (24, whatever it was rebuilt with) and stops stepping. PyTorch does
the same, silently; hookloop knows both numbers, so :func:`warn_past_plan`
names the network, the scheduler, the length it was planned for and the new
fit's. The planned length is read from the scheduler where it says it
(:func:`plan_of`: ``OneCycleLR.total_steps``, ``PolynomialLR.total_iters``,
``CosineAnnealingLR.T_max``, the ``num_training_steps`` of a ``LambdaLR``'s
``functools.partial``: the Hugging Face schedules). A ``LambdaLR`` over a
lambda of the user's (a closure: its length cannot be read) is asked for the
learning rate of the new fit's last update, as its ``step`` would ask it: 0
or less, and the fit runs past the end of its schedule. For any other
schedule whose length it cannot read, the length is taken to be that of the
fit that saved the checkpoint (its manifest's ``fit``, :func:`fit_record`),
and the warning says so. Schedulers that run on without an end (``StepLR``,
``ExponentialLR`` ...) are never concerned. Nothing of this runs per step.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any

#: torch's schedulers that have no end to run past
_OPEN_ENDED = {"StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR", "CyclicLR",
               "CosineAnnealingWarmRestarts", "ReduceLROnPlateau"}
#: torch's schedulers whose planned length is an attribute of their state:
#: name -> (attribute, what running past it does)
_LENGTH_IN_STATE = {"OneCycleLR": ("total_steps", "stops"), "PolynomialLR": ("total_iters", "ends"),
                    "CosineAnnealingLR": ("T_max", "rises")}
_TORCH = "torch.optim.lr_scheduler"


@dataclass
class Plan:
    """The length a scheduler was built for, in its own steps."""

    steps: int
    #: how it is known, for the message (``"total_steps=24"``)
    source: str
    #: what running past it does: ``"ends"`` (the learning rate stays at the
    #: schedule's last, 0 for a decay to 0), ``"stops"`` (it is no longer
    #: stepped), ``"raises"`` (its ``step`` raises), ``"rises"`` (a cosine
    #: climbs back up); ``"ask"``: the length
    #: is unknown, its lambdas tell the learning rate of any step;
    #: ``"guess"``: unknown (the length of the fit that saved the checkpoint)
    past: str
    #: the length is part of the scheduler's state (restored from the checkpoint)
    in_state: bool = False
    #: the learning rate past the end, where it can be told without stepping
    final_lr: float | None = None


#: a schedule hookloop cannot read the length of
UNKNOWN = Plan(0, "", "guess")
#: a LambdaLR over lambdas of the user's: asked for the learning rate at the new fit's end
ASK = Plan(0, "", "ask")


def fit_record(loop: Any) -> dict[str, Any] | None:
    """What the fit in progress (or the last one) was asked for, as a
    checkpoint's manifest records it (``fit``): ``epochs``, ``max_steps`` and
    ``total_steps`` (``loop.total_steps``: the update it ends at, if known).
    None before any fit."""
    state = loop.state
    if state.max_epochs is None and state.max_steps is None:
        return None
    return {"epochs": state.max_epochs, "max_steps": state.max_steps, "total_steps": loop.total_steps}


def _own(scheduler: Any) -> Any:
    """The scheduler itself, out of Accelerate's ``AcceleratedScheduler``."""
    return scheduler.scheduler if type(scheduler).__module__.startswith("accelerate.") else scheduler


def _steps_per_call(scheduler: Any, num_processes: int) -> int:
    """Steps of its own a scheduler takes per ``step()``: Accelerate's wrapper
    steps it once per process (the schedule counts unsharded batches), unless
    it splits batches or does not step with the optimizer."""
    if (type(scheduler).__module__.startswith("accelerate.") and getattr(scheduler, "step_with_optimizer", False)
            and not getattr(scheduler, "split_batches", True)):
        return num_processes
    return 1


def plan_of(scheduler: Any) -> Plan | None:
    """The length ``scheduler`` was built for (:class:`Plan`), :data:`UNKNOWN`
    when it cannot be read, None when it has no end to run past."""
    own = _own(scheduler)
    cls, torch_own = type(own).__name__, type(own).__module__ == _TORCH
    if torch_own and cls in _OPEN_ENDED:
        return None
    if torch_own and cls in _LENGTH_IN_STATE:
        attribute, past = _LENGTH_IN_STATE[cls]
        steps = getattr(own, attribute, None)
        if not isinstance(steps, int):
            return UNKNOWN
        final = 0.0 if cls == "PolynomialLR" else None
        return Plan(steps, f"{attribute}={steps}", past, in_state=True, final_lr=final)
    lambdas = getattr(own, "lr_lambdas", None)
    if torch_own and isinstance(lambdas, list):  # LambdaLR, MultiplicativeLR
        # a partial's keywords say its length (transformers' schedules); its
        # lr_lambda is not in the state: the one it was built with is used
        sized = [(fn.keywords["num_training_steps"], fn, base) for fn, base in zip(lambdas, own.base_lrs)
                 if isinstance(fn, functools.partial) and isinstance(fn.keywords.get("num_training_steps"), int)]
        if sized:
            steps, fn, base = min(sized, key=lambda item: item[0])
            final = None
            if cls == "LambdaLR":
                try:  # (transformers' lr lambdas: plain functions of the step)
                    final = float(base * fn(steps))
                except Exception:  # noqa: BLE001 - only said if it can be told
                    final = None
            return Plan(steps, f"its lr_lambda's num_training_steps={steps}", "ends", final_lr=final)
        if all(isinstance(fn, functools.partial) for fn in lambdas):
            return None  # partials that name no length (a constant schedule after warm-up)
        if cls == "LambdaLR":
            return ASK
    return UNKNOWN


def _rates_at(scheduler: Any, step: int) -> list[float] | None:
    """The learning rates a ``LambdaLR`` sets at its step ``step``, as its
    ``step()`` computes them (a lambda of the step: asked, not stepped);
    None if a lambda fails."""
    own = _own(scheduler)
    try:
        return [float(base * fn(step)) for base, fn in zip(own.base_lrs, own.lr_lambdas)]
    except Exception:  # noqa: BLE001 - a lambda that cannot be asked: nothing is said
        return None


def warn_past_plan(loop: Any, manifest: dict[str, Any] | None) -> None:
    """At the start of the first fit after a resume (``loop.state`` holds its
    limits): warn, once per network, if that fit runs a scheduler past the
    length it was planned for. A step scheduler's length is in updates
    (``loop.total_steps``; stepped once per process under Accelerate, every
    ``scheduler_frequency`` updates); an epoch scheduler's
    (``scheduler_interval="epoch"``) in epochs, against ``fit(epochs=...)``.
    ``manifest``: the resumed checkpoint's (its ``fit``: the length of the
    fit that saved it), None for a script's folder."""
    state = loop.state
    saved = (manifest or {}).get("fit") or {}
    for name, network in loop.networks.items():
        scheduler = network.scheduler
        if scheduler is None:
            continue
        if network.scheduler_interval == "step":
            unit, now, end, saved_end = "update", state.global_step, loop.total_steps, saved.get("total_steps")
            per_call, asked = _steps_per_call(scheduler, loop.accelerator.num_processes), "loop.total_steps"
        else:
            unit, now, end, saved_end = "epoch", state.epoch, state.max_epochs, saved.get("epochs")
            per_call, asked = 1, "fit(epochs=...)"
        if end is None or end <= now:
            continue  # nothing to train, or a length hookloop does not know
        plan, frequency = plan_of(scheduler), network.scheduler_frequency
        extends = not isinstance(saved_end, int) or end > saved_end  # (not recorded: 0.3, 0.4.0.dev0)
        if plan is None:
            continue
        if plan is ASK:  # the learning rate its last update trains at: 0 or less, past the end
            last = _rates_at(scheduler, ((end - 1) // frequency) * per_call)
            if not extends or last is None or all(rate > 0 for rate in last):
                continue
            plan = Plan(0, "", "ask", final_lr=min(last))
            planned_end = saved_end if isinstance(saved_end, int) else now
        elif plan is UNKNOWN:
            if not isinstance(saved_end, int) or not extends:
                continue
            planned_end = saved_end
        else:
            if (end // frequency) * per_call <= plan.steps:
                continue  # within the plan
            planned_end = math.ceil(plan.steps / per_call) * frequency
        if plan.past == "stops" and not (unit == "update" and _skips_past_its_end(scheduler)):
            plan = Plan(plan.steps, plan.source, "raises", in_state=True)
        warnings.warn(_message(name, type(_own(scheduler)).__name__, plan, unit, planned_end, end, now, asked,
                               needed=(end // frequency) * per_call, scheduler=_own(scheduler),
                               recorded=isinstance(saved_end, int)),
                      RuntimeWarning, stacklevel=3)


def _skips_past_its_end(scheduler: Any) -> bool:
    """Accelerate's wrapper (and hookloop's fast path for it) does not step a
    ``OneCycleLR`` past its ``total_steps``; stepped itself (unprepared, or
    once an epoch), it raises ``ValueError`` there."""
    return type(scheduler).__module__.startswith("accelerate.") and bool(getattr(scheduler, "step_with_optimizer",
                                                                                 False))


def _message(network: str, cls: str, plan: Plan, unit: str, planned_end: int, end: int, now: int, asked: str,
             needed: int, scheduler: Any, recorded: bool) -> str:
    first = max(planned_end, now) + 1
    span = f"{unit}s {first} to {end}" if first < end else f"{unit} {end}"
    lead = f"hookloop: network {network!r}: its scheduler {cls} "
    if plan.past == "ask":
        saver = (f", and the fit that saved the checkpoint ran to {unit} {planned_end}" if recorded else "")
        return (lead + f"sets a learning rate of {plan.final_lr:g} for {unit} {end}, the last of this fit "
                f"({asked}){saver}: its schedule ends before this fit does (hookloop cannot read the length "
                f"its lr_lambda was built for). Build it for {end} {unit}s before resuming (a LambdaLR keeps "
                "the lr_lambda it is built with, not the checkpoint's), or start a new run from the weights "
                "with a scheduler built for the new length (loop.load_checkpoint(path, weights_only=True))"
                + (f"; or fit no further than {unit} {planned_end}" if recorded else ""))
    if plan is UNKNOWN:
        return (lead + f"has a schedule whose length hookloop cannot read, and the fit that saved the checkpoint "
                f"ran to {unit} {planned_end}; this fit runs to {unit} {end} ({asked}). If the schedule was built "
                f"for {planned_end} {unit}s, {span} run past its end (a decay to 0 trains them at a learning "
                f"rate of 0): build it for {end} {unit}s before resuming (a LambdaLR keeps the lr_lambda it is "
                "built with), or start a new run from the weights with a scheduler built for it "
                "(loop.load_checkpoint(path, weights_only=True)). If it was built for this fit, all is well")
    lead += f"was planned for {planned_end} {unit}s ({plan.source}), and this fit runs to {unit} {end} ({asked}): "
    current = _current_lr(scheduler) if now >= planned_end else None
    lr = plan.final_lr if plan.final_lr is not None else current
    if plan.past == "rises":
        what = f"past its T_max the cosine climbs back up: {span} train at a rising learning rate"
    elif plan.past == "raises":
        what = (f"its step after {unit} {planned_end + 1} raises ValueError (a OneCycleLR steps no further than "
                "its total_steps): the fit fails there")
    elif lr is not None:
        what = (f"its learning rate is {lr:g} from {unit} {planned_end} on"
                + (" (it stops stepping there)" if plan.past == "stops" else "") + f": {span} train at it")
    elif plan.past == "stops":
        what = f"it stops stepping after {unit} {planned_end}: {span} train at its last learning rate"
    else:
        what = f"{span} run past the end of its schedule, at the learning rate it ends with"
    if plan.in_state:
        fix = (f"Its {plan.source.split('=')[0]} is part of its state, restored from the checkpoint: building it "
               f"for {end} {unit}s does not change it. To train on under a schedule of the new length, start a "
               f"new run from the weights with a scheduler built for it (loop.load_checkpoint(path, "
               f"weights_only=True): the optimizer state starts afresh)")
    else:
        fix = (f"Build it for {end} {unit}s before resuming (num_training_steps={needed}: a {cls} keeps the "
               "lr_lambda it is built with, not the checkpoint's)")
    return lead + what + ". " + fix + f"; or fit no further than {unit} {planned_end}"


def _current_lr(scheduler: Any) -> float | None:
    try:
        return float(scheduler.get_last_lr()[0])
    except Exception:  # noqa: BLE001 - only said if it can be told
        return None
