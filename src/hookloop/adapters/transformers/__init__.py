"""Hugging Face ``TrainerCallback``\\ s, unchanged, on a hookloop :class:`~hookloop.Loop`.

    from transformers import EarlyStoppingCallback, TrainingArguments
    from transformers.integrations import TensorBoardCallback
    from hookloop.adapters.transformers import TrainerCallbacks

    loop = Loop(model=model, optimizer=opt, scheduler=sched, train_data=train, eval_data=val,
                plugins=[TrainerCallbacks(
                    [EarlyStoppingCallback(early_stopping_patience=2), TensorBoardCallback()],
                    args=TrainingArguments(output_dir="out", eval_strategy="epoch",
                                           save_strategy="epoch", metric_for_best_model="eval_loss",
                                           load_best_model_at_end=True))])

The plugin keeps a true ``TrainerState`` and a ``TrainerControl`` and fires
the Trainer's events, through the Trainer's own ``CallbackHandler`` (so with
the keyword arguments the Trainer passes), at the points of the loop where
``Trainer.train()`` fires them; what the callbacks ask for through
``TrainerControl`` the loop does (stop, end the epoch, evaluate, save, log).
See ``docs/trainer-callbacks.md`` for the mapping and where it differs from
the Trainer, and why.

``transformers`` is imported when a :class:`TrainerCallbacks` is created,
never by ``import hookloop`` (``pip install hookloop[hf]``).

The package, one job a module: :mod:`.plugin` (the plugin and its hooks:
events in, control out), :mod:`.logs` (the Trainer's training log),
:mod:`.evaluation` (evaluations as the callbacks see them), :mod:`.saves`
(checkpoints, ``on_save``, the best model), :mod:`.codec` (the state, as
plain data), :mod:`.defaults` (what the Trainer sets up, from the loop),
:mod:`.values` (small conversions).
"""

from .plugin import TrainerCallbacks

__all__ = ["TrainerCallbacks"]
