"""What the loop refuses or warns about before and while it trains, and how
it says so: each message names the argument, hook or plugin at fault."""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, NoReturn

from .strategies.base import StepOutput

def run_length(epochs: int | None, max_steps: int | None) -> None:
    if (epochs is None) == (max_steps is None):
        raise ValueError(
            f"fit() takes exactly one of epochs=N or max_steps=N (got epochs={epochs!r}, "
            f"max_steps={max_steps!r})"
        )
    for label, value in (("epochs", epochs), ("max_steps", max_steps)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"fit(): {label} must be a positive int, got {value!r}")


def positive(label: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"fit(): {label} must be a positive int or None, got {value!r}")


def train_data(data: Any) -> None:
    if data is None:
        raise ValueError("this Loop has no train_data: pass train_data=... to Loop(...)")
    try:
        n = len(data)
    except TypeError:
        return
    if n == 0:
        raise ValueError("train_data is empty (0 batches): check the dataset and batch_size")


def warn_nothing_to_do(state: Any, epochs: int | None, max_steps: int | None) -> None:
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


def accelerator_state(accelerator: Any) -> None:
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


def step_output(loop: Any, result: Any) -> StepOutput:
    if isinstance(result, StepOutput):
        return result
    impls = [i.plugin_name for i in reversed(loop.plugins.pm.hook.training_step.get_hookimpls())]
    what = "no plugin returned a result" if result is None else f"it returned {type(result).__name__}"
    raise TypeError(
        f"training_step must return hookloop.StepOutput(outputs, loss): {what} "
        f"(training_step plugins, first called first: {', '.join(impls)})"
    )


def accumulation_changed_inside_step(before: int, now: int) -> NoReturn:
    raise ValueError(
        f"gradient_accumulation_steps changed from {before} to {now} inside training_step: "
        "this batch's loss was already divided by one and synchronised at the other. Change it "
        "only at an update boundary, e.g. in on_epoch_start, or in after_step when "
        "loop.accelerator.sync_gradients is true"
    )


def accumulation_changed_in_group(before: int, new: int, in_group: int, update: int) -> NoReturn:
    raise ValueError(
        f"gradient_accumulation_steps changed from {before} to {new} "
        f"{in_group} batch(es) into an accumulation group (update "
        f"{update}): change it only at an update boundary, e.g. in "
        "on_epoch_start, or in after_step when loop.accelerator.sync_gradients is true"
    )


#: accelerators :func:`launch` has warned about (each warning once per accelerator)
_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()


def _env_flag(name: str) -> bool:
    """As Accelerate reads ``ACCELERATE_USE_FSDP`` / ``ACCELERATE_USE_DEEPSPEED``."""
    return os.environ.get(name, "false").lower() == "true"


def launch(accelerator: Any) -> None:
    """Launch mistakes, at ``Loop(...)`` before anything is prepared.

    Refused (``RuntimeError``): the launcher started several processes
    (``WORLD_SIZE`` or ``LOCAL_WORLD_SIZE`` > 1, as ``torchrun`` and
    ``accelerate launch`` set them) but the Accelerator has one: each
    process would train alone, on all the data, into the same checkpoints.

    Warned about (``RuntimeWarning``, once per accelerator, on the main
    process): FSDP or DeepSpeed asked for (a plugin given to
    ``Accelerator(...)``, which sets ``ACCELERATE_USE_FSDP`` /
    ``ACCELERATE_USE_DEEPSPEED``, or ``accelerate launch --use_fsdp`` /
    ``--use_deepspeed``) but not taken (Accelerate keeps the distributed
    type it had, e.g. ``MULTI_CPU`` DDP on a CPU); ``mixed_precision="fp16"``
    on a CPU, which trains in fp32; ``torchrun --max-restarts`` with torch
    2.13 without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (see
    :func:`_elastic_store`); an Accelerate release hookloop's fast path was
    not checked against (once per process:
    :func:`hookloop.accelerate_fastpath.warn_if_unverified`)."""
    launched: dict[str, int] = {}
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        try:
            launched[name] = int(os.environ.get(name, "1"))
        except ValueError:
            continue
    if accelerator.num_processes == 1 and max(launched.values(), default=1) > 1:
        said = ", ".join(f"{k}={v}" for k, v in launched.items() if v > 1)
        raise RuntimeError(
            f"the launcher started several processes ({said}) but this Accelerator has one "
            f"(distributed type {_name(accelerator.distributed_type)}, device "
            f"{accelerator.device}): Accelerate did not set up distributed training, so each "
            "process would train alone, on all the data, into the same checkpoint folder. On a "
            "machine without GPUs, pass Accelerator(cpu=True) or set ACCELERATE_USE_CPU=1 (an "
            "accelerate launch --multi_gpu without it gives every process rank 0); otherwise "
            "check that every process sees its GPU (CUDA_VISIBLE_DEVICES, "
            "torch.cuda.device_count())"
        )
    if accelerator in _WARNED:
        return
    _WARNED.add(accelerator)
    if not accelerator.is_main_process:
        return
    kind = _name(accelerator.distributed_type)
    for flag, wanted, what in (("ACCELERATE_USE_FSDP", "FSDP", "FSDP (fsdp_plugin=, --use_fsdp)"),
                               ("ACCELERATE_USE_DEEPSPEED", "DEEPSPEED",
                                "DeepSpeed (deepspeed_plugin=, --use_deepspeed)")):
        if _env_flag(flag) and kind != wanted:
            warnings.warn(
                f"hookloop: {what} was asked for ({flag}=true) but Accelerate did not take it: "
                f"it runs {_runs(kind)}, {accelerator.num_processes} process(es) on "
                f"{accelerator.device.type}. "
                + ("Accelerate uses it only with several GPU processes (accelerate launch "
                   "--multi_gpu or a config); on a CPU it is never used"
                   if wanted == "FSDP" else
                   "Accelerate uses it only on GPUs (not with cpu=True) and with deepspeed installed"),
                RuntimeWarning,
                stacklevel=3,
            )
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        warnings.warn(
            "hookloop: mixed_precision='fp16' on a CPU trains in fp32: Accelerate has no fp16 "
            "autocast on a CPU. Use mixed_precision='bf16', which works on a CPU, or 'no'",
            RuntimeWarning,
            stacklevel=3,
        )
    from .accelerate_fastpath import warn_if_unverified

    warn_if_unverified(stacklevel=3)
    _elastic_store()


#: torch releases whose TorchElastic agents publish the store they share with the workers for
#: the first rendezvous round only: a restarted or re-formed group cannot connect
#: (measured with 2.13.0 here: every restart under --max-restarts failed in gloo's
#: connectFullMesh, "Connection refused"; a joining node waited out the rendezvous)
RDZV_STORE_BUG = ("2.13.",)


def _elastic_store() -> None:
    """Warn at a TorchElastic job's first start when its restarts would fail."""
    import torch

    env = os.environ
    try:
        restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return
    if (not env.get("TORCHELASTIC_RUN_ID") or restarts < 1 or env.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
            or env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1"
            or not torch.__version__.startswith(RDZV_STORE_BUG)):
        return
    warnings.warn(
        f"hookloop: torchrun --max-restarts={restarts} with torch {torch.__version__}: its agents "
        "share the rendezvous store with the workers for the first round only, so a restarted "
        "group (after a failure, or when a node joins or leaves) cannot connect. Start torchrun "
        "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (a store of the workers' "
        "own each round); see docs/distributed.md",
        RuntimeWarning,
        stacklevel=4,
    )


def _name(distributed_type: Any) -> str:
    name: str = getattr(distributed_type, "value", str(distributed_type))
    return name


def _runs(kind: str) -> str:
    if kind.startswith("MULTI"):
        return f"plain DDP ({kind}: every process holds the whole model and optimizer state)"
    if kind == "NO":
        return "without any distributed training (NO)"
    return kind
