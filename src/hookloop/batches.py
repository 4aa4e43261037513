"""Batches: how the built-in strategies read a batch and a model's outputs,
and how long a dataloader is.

A batch that is a mapping is passed as ``model(**batch)`` and its targets are
``batch["labels"]`` (or ``batch["label"]``); a sequence ``(inputs, targets,
...)`` is passed as ``model(inputs)`` with ``targets = batch[1]``; a lone
tensor is passed as ``model(batch)`` and has no targets.
"""

from collections.abc import Mapping, Sequence

import torch


def forward(model, batch):
    kind = type(batch)  # the common exact types first: ABC checks cost ~0.1 µs each
    if kind is list or kind is tuple:
        if batch:
            return model(batch[0])
    elif kind is dict:
        return model(**batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)) and len(batch) >= 1:
        return model(batch[0])
    raise TypeError(
        f"the supervised strategy cannot use a batch of type {type(batch).__name__}: "
        "expected a mapping (passed as model(**batch)), an (inputs, targets) "
        "pair (passed as model(inputs)) or a tensor"
    )


def targets_of(batch):
    kind = type(batch)
    if (kind is list or kind is tuple) and len(batch) >= 2:
        return batch[1]
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
        return batch.get("label") if labels is None else labels
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)) and len(batch) >= 2:
        return batch[1]
    return None


def loss_of(outputs):
    """The loss a model computed itself (Hugging Face models given labels)."""
    if type(outputs) is torch.Tensor:
        return None
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    return getattr(outputs, "loss", None) if not isinstance(outputs, torch.Tensor) else None


def logits_of(outputs):
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping) and "logits" in outputs:
        return outputs["logits"]
    logits = getattr(outputs, "logits", None)
    if logits is not None:
        return logits
    if isinstance(outputs, Sequence) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    raise TypeError(
        f"cannot find logits in model outputs of type {type(outputs).__name__}: "
        "return a tensor, or an object with a `logits` attribute, or write a "
        "compute_loss plugin"
    )


def length_of(obj) -> int | None:
    """``len(obj)``, or None for no object or one without a length (an
    iterable dataset, a generator)."""
    if obj is None:
        return None
    try:
        return len(obj)
    except TypeError:
        return None


def updates_per_epoch(data, accumulation: int) -> int | None:
    """Optimizer updates in a whole epoch of ``data`` under gradient
    accumulation ``accumulation``: a prepared loader's last partial group is
    an update too (Accelerate synchronises at the end of the data); None
    without a length."""
    from accelerate.data_loader import DataLoaderStateMixin

    batches = length_of(data)
    if batches is None:
        return None
    return -(-batches // accumulation) if isinstance(data, DataLoaderStateMixin) else batches // accumulation


def loader_batch_size(data) -> int | None:
    """The batch size a (prepared) dataloader was built with, looked up
    through the batch samplers Accelerate wraps it in; None if unknown."""
    obj = data
    for _ in range(4):
        if obj is None:
            return None
        size = getattr(obj, "batch_size", None)
        if isinstance(size, int):
            return size
        obj = getattr(obj, "batch_sampler", None)
    return None


def abandon(batches, accelerator, before) -> None:
    """Stop iterating prepared dataloaders before their end. Accelerate
    unregisters a dataloader from its gradient state only when its iteration
    runs out; an abandoned one would stay the "active" dataloader. ``before``:
    the gradient state's dataloaders before the iteration began (the ones
    since are ended: the loader itself, or the copy that skips a resumed
    epoch's first batches)."""
    from accelerate.data_loader import DataLoaderStateMixin

    close = getattr(batches, "close", None)
    if close is not None:
        close()
    references = accelerator.gradient_state.dataloader_references
    for loader in [r for r in references if r is not None and all(r is not b for b in before)]:
        if isinstance(loader, DataLoaderStateMixin):
            loader.end()
