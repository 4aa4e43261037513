"""What the loop refuses or warns about before and while it trains, and how
it says so: each message names the argument, hook or plugin at fault."""

from __future__ import annotations

import warnings

from .strategies.base import StepOutput

def run_length(epochs, max_steps):
    if (epochs is None) == (max_steps is None):
        raise ValueError(
            f"fit() takes exactly one of epochs=N or max_steps=N (got epochs={epochs!r}, "
            f"max_steps={max_steps!r})"
        )
    for label, value in (("epochs", epochs), ("max_steps", max_steps)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"fit(): {label} must be a positive int, got {value!r}")


def positive(label, value):
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"fit(): {label} must be a positive int or None, got {value!r}")


def train_data(data):
    if data is None:
        raise ValueError("this Loop has no train_data: pass train_data=... to Loop(...)")
    try:
        n = len(data)
    except TypeError:
        return
    if n == 0:
        raise ValueError("train_data is empty (0 batches): check the dataset and batch_size")


def warn_nothing_to_do(state, epochs, max_steps):
    asked = f"fit(epochs={epochs})" if epochs is not None else f"fit(max_steps={max_steps})"
    where = (f"epoch {state.epoch}, update {state.global_step}"
             + (f", {state.step_in_epoch} batches into the epoch" if state.step_in_epoch else ""))
    if state.should_stop:
        why = (f"the run was stopped there ({state.stop_reason}) and resumed: call fit again to "
               "train on")
    else:
        why = ("ask for more epochs or steps (they count over the whole run, a resumed one "
               "included)")
    warnings.warn(
        f"hookloop: {asked} trains nothing: the run is already at {where}; {why}. "
        "fit returns the metrics its last epoch ended with",
        RuntimeWarning,
        stacklevel=3,
    )


def accelerator_state(accelerator):
    """An ``Accelerator`` whose process-wide state was reset after it was
    made (creating ``transformers.TrainingArguments`` does that) fails later
    with an obscure ``AttributeError``: say what happened instead."""
    from accelerate.state import AcceleratorState

    if not AcceleratorState._shared_state:
        raise RuntimeError(
            "accelerator=: Accelerate's process-wide state was reset after this Accelerator was "
            "created (creating transformers.TrainingArguments does that). Create the "
            "TrainingArguments first, or pass them accelerator_config={'use_configured_state': True}"
        )


def step_output(loop, result):
    if isinstance(result, StepOutput):
        return result
    impls = [i.plugin_name for i in reversed(loop.plugins.pm.hook.training_step.get_hookimpls())]
    what = "no plugin returned a result" if result is None else f"it returned {type(result).__name__}"
    raise TypeError(
        f"training_step must return hookloop.StepOutput(outputs, loss): {what} "
        f"(training_step plugins, first called first: {', '.join(impls)})"
    )


def accumulation_changed_inside_step(before, now):
    raise ValueError(
        f"gradient_accumulation_steps changed from {before} to {now} inside training_step: "
        "this batch's loss was already divided by one and synchronised at the other. Change it "
        "only at an update boundary, e.g. in on_epoch_start, or in after_step when "
        "loop.accelerator.sync_gradients is true"
    )


def accumulation_changed_in_group(before: int, new: int, in_group: int, update: int):
    raise ValueError(
        f"gradient_accumulation_steps changed from {before} to {new} "
        f"{in_group} batch(es) into an accumulation group (update "
        f"{update}): change it only at an update boundary, e.g. in "
        "on_epoch_start, or in after_step when loop.accelerator.sync_gradients is true"
    )
