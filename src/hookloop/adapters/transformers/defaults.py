"""What ``Trainer`` sets up around its callbacks, made from a loop: the
``transformers`` import (only when a ``TrainerCallbacks`` is created), the
default and ``report_to`` callbacks, ``TrainingArguments`` describing the
loop, the ``TrainerState`` fields ``Trainer.train()`` sets at its start, and
the check that creating ``TrainingArguments`` left Accelerate its state."""

from __future__ import annotations

import dataclasses
import sys

from ...batches import length_of, loader_batch_size


def load_transformers():
    """``transformers.trainer_callback``, with a hint when it is missing."""
    try:
        import transformers  # noqa: F401
        from transformers import trainer_callback
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "hookloop.adapters.transformers.TrainerCallbacks needs transformers: "
            "pip install 'hookloop[hf]'"
        ) from exc
    return trainer_callback


def default_callbacks(tc):
    from transformers import trainer

    return list(getattr(trainer, "DEFAULT_CALLBACKS", [tc.DefaultFlowCallback]))


def reporting_callbacks(report_to):
    from transformers.integrations import get_reporting_integration_callbacks

    return get_reporting_integration_callbacks(report_to)


def default_args(loop):
    """``TrainingArguments`` describing the loop (see :class:`TrainerCallbacks`)."""
    from transformers import TrainingArguments

    from ...plugins.logger import Logger

    acc = loop.accelerator
    state = loop.state
    every = next((p.every for _, p in loop.plugins.pm.list_name_plugin() if isinstance(p, Logger)), 50)
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    eval_key = "eval_strategy" if "eval_strategy" in fields else "evaluation_strategy"
    wanted = {
        "output_dir": acc.project_dir or ".",
        "report_to": [],
        eval_key: "epoch" if loop.eval_data is not None else "no",
        "save_strategy": "no",
        "logging_strategy": "steps",
        "logging_steps": every,
        "gradient_accumulation_steps": acc.gradient_accumulation_steps,
        "per_device_train_batch_size": loader_batch_size(loop.train_data) or 8,
        "per_device_eval_batch_size": loader_batch_size(loop.eval_data) or 8,
        "num_train_epochs": float(state.max_epochs or 1),
        "max_steps": state.max_steps or -1,
        "use_cpu": acc.device.type == "cpu",
        # else TrainingArguments resets Accelerate's state, under the loop's Accelerator
        "accelerator_config": {"use_configured_state": True},
    }
    return TrainingArguments(**{k: v for k, v in wanted.items() if k in fields})


def start_state(st, loop, args):
    """What ``Trainer.train()`` sets in the ``TrainerState`` ``st`` before
    ``on_train_begin``, from the loop; returns the batches per epoch (None:
    unknown)."""
    acc = loop.accelerator
    st.global_step = loop.state.global_step
    total = loop.total_steps
    st.max_steps = total if total is not None else sys.maxsize  # epochs of unknown length
    length = length_of(loop.train_data)
    k = acc.gradient_accumulation_steps
    per_epoch = max(-(-length // k), 1) if length else None
    if loop.state.max_epochs is not None:
        st.num_train_epochs = loop.state.max_epochs
    elif per_epoch is not None:
        st.num_train_epochs = -(-st.max_steps // per_epoch)
    else:
        st.num_train_epochs = sys.maxsize
    st.train_batch_size = loader_batch_size(loop.train_data)
    st.is_local_process_zero = acc.is_local_main_process
    st.is_world_process_zero = acc.is_main_process
    st.compute_steps(args, st.max_steps)
    return length


def check_accelerate_state():
    """``TrainingArguments(...)`` resets Accelerate's process-wide state
    when it is created (unless ``accelerator_config={"use_configured_state":
    True}``): created after the loop's ``Accelerator``, it leaves that
    accelerator without a state, and every later use fails obscurely."""
    from accelerate.state import AcceleratorState

    if not AcceleratorState._shared_state:
        raise RuntimeError(
            "TrainerCallbacks: Accelerate's state was reset after the loop's Accelerator was "
            "created: creating transformers.TrainingArguments does that. Create the "
            "TrainingArguments before the Accelerator, or pass them "
            "accelerator_config={'use_configured_state': True}"
        )
