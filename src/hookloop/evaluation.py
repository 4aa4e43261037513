"""Evaluation and prediction: the mechanics behind :meth:`Loop.evaluate`,
:meth:`Loop.predict` and the sanity check.

The loop decides *when* to evaluate; this module runs one evaluation (every
batch through ``eval_step`` and ``after_eval_step``, the per-example values
averaged over every example of every process), joins predictions, and puts
networks in eval mode and back. Random states are kept with
:func:`hookloop.rng.keep_rng` where an evaluation must leave no trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

import torch
from accelerate.data_loader import DataLoaderStateMixin
from torch.utils.data import DataLoader

from . import rng
from .batches import abandon

_END = object()


@contextlib.contextmanager
def eval_mode(networks):
    """Every network in eval mode; the modes they had put back after."""
    modes = [(n.model, n.model.training) for n in networks.values()]
    for model, _ in modes:
        model.eval()
    try:
        yield
    finally:
        for model, training in modes:
            model.train(training)


def outputs_of(loop, batch):
    """``eval_step``'s result for one batch; an error naming the strategy if
    no plugin gave one."""
    outputs = loop.hook.eval_step(loop=loop, batch=batch)
    if outputs is None:
        raise TypeError(
            f"no plugin returned a result from eval_step for strategy "
            f"{loop.strategy.name!r}: implement eval_step (return the model's outputs for "
            "the batch) to evaluate or predict"
        )
    return outputs


def run(loop, data, logged, metrics: dict | None = None) -> dict:
    """One evaluation of ``data``: ``on_eval_start``, per batch ``eval_step``
    and ``after_eval_step``, ``on_eval_end``, in eval mode without
    gradients. Returns the metrics: ``metrics`` (entries to start from: the
    epoch's ``loop.log(on_epoch=True)`` values), then what was logged with
    ``loop.log(on_epoch=True)`` during the evaluation (``logged``), then the
    mean of every per-example value ``after_eval_step`` returned; plugins
    may add to it in ``on_eval_end``."""
    hook = loop.hook
    sums: dict = {}
    counts: dict = {}
    logged.clear()
    with eval_mode(loop.networks):
        hook.on_eval_start(loop=loop)
        with torch.no_grad():
            for batch in data:
                outputs = outputs_of(loop, batch)
                for values in hook.after_eval_step(loop=loop, batch=batch, outputs=outputs):
                    add_values(loop, values, sums, counts)
        means = [sums[key] / max(counts[key], 1) for key in sums]
        metrics = {**(metrics or {}), **logged.reduce(loop.accelerator)}
        metrics.update(zip(sums, torch.stack(means).tolist()) if means else ())
        hook.on_eval_end(loop=loop, metrics=metrics)
    return metrics


def sanity_check(loop, data) -> None:
    """One batch of ``data`` through ``eval_step`` and ``after_eval_step``,
    with every random state (global and the loader's generators) put back
    afterwards."""
    loaders_before = list(loop.accelerator.gradient_state.dataloader_references)
    with rng.keep_rng(data):
        batches = iter(data)
        try:
            batch = next(batches, _END)
            if batch is _END:
                raise ValueError("eval_data is empty (0 batches): check the dataset and batch_size")
            with eval_mode(loop.networks), torch.no_grad():
                outputs = outputs_of(loop, batch)
                for values in loop.hook.after_eval_step(loop=loop, batch=batch, outputs=outputs):
                    add_values(loop, values, {}, {})
        finally:
            abandon(batches, loop.accelerator, loaders_before)


def predict(loop, data):
    """The gathered ``eval_step`` outputs of every batch of ``data``, joined."""
    gather = loop.accelerator.gather_for_metrics
    parts = []
    with eval_mode(loop.networks), torch.no_grad():
        for batch in data:
            parts.append(gather(outputs_of(loop, batch)))
    return concat(parts)


def loader_for(loop, data, required=False):
    """The data to evaluate or predict: ``eval_data`` when ``data`` is None;
    a plain ``DataLoader`` prepared with the loop's accelerator (once per
    loader: ``loop._prepared`` remembers it)."""
    if data is None:
        if required or loop.eval_data is None:
            raise ValueError(
                "no data to evaluate: pass evaluate(data=...), or eval_data=... to Loop(...)"
                if not required else "predict(data) needs data: a DataLoader"
            )
        return loop.eval_data
    if not loop._prepare_data or not isinstance(data, DataLoader) or isinstance(data, DataLoaderStateMixin):
        return data
    prepared = loop._prepared.get(data)
    if prepared is None:
        prepared = loop._prepared[data] = loop.accelerator.prepare_data_loader(data)
    return prepared


def add_values(loop, values, sums, counts) -> None:
    """Add one ``after_eval_step`` result (per-example values) to the sums."""
    if not isinstance(values, Mapping) or not all(isinstance(v, torch.Tensor) for v in values.values()):
        impls = [i.plugin_name for i in reversed(loop.plugins.pm.hook.after_eval_step.get_hookimpls())]
        raise TypeError(
            "after_eval_step must return None or a dict {metric name: tensor of per-example "
            f"values}}, got {type(values).__name__} {_short(values)} (after_eval_step plugins: "
            f"{', '.join(impls)})"
        )
    for key, value in values.items():
        value = value.detach().to(torch.float64)
        sums[key] = sums.get(key, 0.0) + value.sum()
        counts[key] = counts.get(key, 0) + value.numel()


def _short(value) -> str:
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."


def concat(parts):
    """Batches of gathered outputs joined into one: tensors on dim 0, the
    same structure around them."""
    if not parts:
        return None
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([p.reshape(1) if p.ndim == 0 else p for p in parts])
    if isinstance(first, Mapping):
        joined = {key: concat([p[key] for p in parts]) for key in first}
        try:
            return type(first)(**joined)  # a Hugging Face ModelOutput, a dict subclass
        except TypeError:
            return type(first)(joined)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(concat([p[i] for p in parts]) for i in range(len(first))))
    if isinstance(first, Sequence) and not isinstance(first, (str, bytes)):
        return type(first)(concat([p[i] for p in parts]) for i in range(len(first)))
    if first is None:
        return None
    return list(parts)
