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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from accelerate.data_loader import DataLoaderStateMixin
from torch.utils.data import DataLoader

from . import rng
from .batches import abandon
from .logbook import Metrics

if TYPE_CHECKING:  # names for the annotations only
    from .logbook import Logbook
    from .network import Network
    from .protocols import LoopLike

@contextlib.contextmanager
def eval_mode(networks: Mapping[str, Network]) -> Iterator[None]:
    """Every network in eval mode; the modes they had put back after."""
    modes = [(n.model, n.model.training) for n in networks.values()]
    for model, _ in modes:
        model.eval()
    try:
        yield
    finally:
        for model, training in modes:
            model.train(training)


def outputs_of(loop: LoopLike, batch: Any) -> Any:
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


def run(loop: LoopLike, data: Iterable[Any], logbook: Logbook, metrics: Mapping[str, float] | None = None,
        limit: int | None = None) -> Metrics:
    """One evaluation of ``data``: ``on_eval_start``, per batch ``eval_step``
    and ``after_eval_step``, ``on_eval_end``, in eval mode without
    gradients. Returns the metrics (:class:`~hookloop.logbook.Metrics`):
    ``metrics`` (entries to start from: the epoch's ``loop.log(on_epoch=True)``
    values), then what was logged with ``loop.log(on_epoch=True)`` during the
    evaluation, then the mean over every example of every per-example value
    ``after_eval_step`` returned; plugins may add to it in ``on_eval_end``.
    ``limit``: at most this many batches (the sanity check's one)."""
    hook = loop.hook
    named = hook.named("after_eval_step")  # who returned what (None: pluggy's caller runs it)
    values = Values(loop)
    logged = logbook.eval_values
    logged.clear()
    loaders_before = list(loop.accelerator.gradient_state.dataloader_references)
    batches = iter(data)
    try:
        with eval_mode(loop.networks):
            hook.on_eval_start(loop=loop)
            with torch.no_grad():
                for batch in batches:
                    outputs = outputs_of(loop, batch)
                    versions = [(t, t._version) for t in _tensors(batch)]  # (in-place changes: seen)
                    if named is not None:
                        results = named(loop=loop, batch=batch, outputs=outputs)
                    else:
                        results = [(None, r) for r in hook.after_eval_step(loop=loop, batch=batch,
                                                                           outputs=outputs)]
                    if any(t._version != v for t, v in versions):
                        raise _changed_in_place(loop, batch, versions)
                    values.add(results, batch)
                    if limit is not None and values.batches >= limit:
                        break
                else:
                    if limit is not None and values.batches == 0:
                        raise ValueError("eval_data is empty (0 batches): check the dataset and batch_size")
            owners = {**(metrics._owners if isinstance(metrics, Metrics) else {}), **logged.owners,
                      **values.owners}
            metrics = Metrics({**(metrics or {}), **logged.reduce(loop.accelerator), **values.means()},
                              plugins=loop.plugins, owners=owners)
            hook.on_eval_end(loop=loop, metrics=metrics)
    finally:
        if limit is not None:
            abandon(batches, loop.accelerator, loaders_before)
    return metrics


def sanity_check(loop: LoopLike, data: Iterable[Any], logbook: Logbook) -> None:
    """The sanity check: a whole evaluation (``on_eval_start``, one batch of
    ``data`` through ``eval_step`` and ``after_eval_step``, ``on_eval_end``)
    with ``loop.state.stage == "sanity"``, so that a wrong evaluation set, a
    metric plugin or a misspelt ``monitor`` fails in seconds, not after an
    epoch. Its metrics go nowhere; every random state (global, and the
    loader's generators) is put back afterwards."""
    with rng.keep_rng(data):
        run(loop, data, logbook, limit=1)


def predict(loop: Any, data: Any) -> Any:
    """The gathered ``eval_step`` outputs of every batch of ``data``, joined."""
    gather = loop.accelerator.gather_for_metrics
    parts: list[Any] = []
    with eval_mode(loop.networks), torch.no_grad():
        for batch in data:
            parts.append(gather(outputs_of(loop, batch)))
    return concat(parts)


def loader_for(loop: Any, data: Any, required: bool = False) -> Any:
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


class Values:
    """The per-example values ``after_eval_step`` implementations return,
    summed per name over an evaluation, each name owned by the plugin that
    returns it (a second plugin returning it is an error naming both, unless
    one ``replaces`` the other), each value checked to be one per example of
    the gathered batch."""

    def __init__(self, loop: LoopLike) -> None:
        self.loop = loop
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        #: name -> the plugin that returns it (None: not known, pluggy's caller ran)
        self.owners: dict[str, str | None] = {}
        self.batches = 0
        self._processes = loop.accelerator.num_processes

    def add(self, results: Iterable[tuple[str | None, object]], batch: Any) -> None:
        self.batches += 1
        examples = None
        for plugin, values in results:
            if not isinstance(values, Mapping) or not all(isinstance(v, torch.Tensor) for v in values.values()):
                raise _bad_result(self.loop, plugin, values)
            for key, value in values.items():
                if not self._owned(key, plugin):
                    continue
                if examples is None:
                    examples = batch_examples(batch)
                if self.loop.plugins.sources.get(plugin or "") != "built-in":  # (the checks are for plugins)
                    _check_count(self.loop, plugin, key, value, examples, self._processes)
                value = value.detach().to(torch.float64)
                self.sums[key] = self.sums.get(key, 0.0) + value.sum()
                self.counts[key] = self.counts.get(key, 0) + value.numel()

    def _owned(self, key: str, plugin: str | None) -> bool:
        """Whether ``plugin``'s value of ``key`` counts (another may own it)."""
        from .logbook import collision, replaces

        if key not in self.owners:
            self.owners[key] = plugin
            return True
        owner = self.owners[key]
        if owner == plugin or owner is None or plugin is None:
            return True
        if replaces(self.loop.plugins, plugin, owner, key):  # this one replaces the owner: its values go
            self.owners[key] = plugin
            self.sums.pop(key, None)
            self.counts.pop(key, None)
            return True
        if replaces(self.loop.plugins, owner, plugin, key):
            return False
        raise collision("after_eval_step value", key, owner, plugin)

    def means(self) -> dict[str, float]:
        keys = list(self.sums)
        if not keys:
            return {}
        means = torch.stack([self.sums[k] / max(self.counts[k], 1) for k in keys]).tolist()
        return dict(zip(keys, means))


def batch_examples(batch: Any) -> int | None:
    """The number of examples in one process's batch (the first dimension of
    its first tensor), or None if it has none."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else None
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, Sequence) else ()
    for item in items:
        if isinstance(item, torch.Tensor) and item.ndim:
            return item.shape[0]
    return None


def _check_count(loop: LoopLike, plugin: str | None, key: str, value: torch.Tensor,
                 examples: int | None, processes: int) -> None:
    """One value per example of the gathered batch: not a batch mean, not
    one process's values (the last batch may hold fewer: Accelerate drops
    the examples it repeated to even out the processes)."""
    if examples is None:
        return
    n, expected = value.numel(), examples * processes
    last = loop.accelerator.gradient_state.end_of_dataloader
    if n == expected or (last and n <= expected and (processes > 1 or n > 1)):
        return  # (the last batch holds fewer: even one example, on one rank)
    who = f"plugin {plugin!r}" if plugin else "an after_eval_step implementation"
    if n == 1 and expected > 1:
        problem = ("a single value (a batch mean?): return one value per example, e.g. "
                   "loss(reduction='none'), so that every example counts once in the mean")
    elif processes > 1 and n == examples and not last:
        problem = (f"this process's {examples} values, not the batch's {expected} over "
                   f"{processes} processes: pass them through loop.accelerator.gather_for_metrics, "
                   "or every process computes another mean")
    else:
        problem = f"{n} values for a batch of {expected} examples ({examples} per process)"
    raise ValueError(f"after_eval_step: {who} returned {key!r} as {problem}")


def _tensors(batch: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors of a batch (in dicts, lists and tuples, a few levels deep)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    return [t for item in items for t in _tensors(item, depth + 1)] if depth < 4 else []


def _changed_in_place(loop: Any, batch: Any, versions: list[tuple[torch.Tensor, int]]) -> ValueError:
    """An ``after_eval_step`` implementation changed the batch in place (its
    tensors' version counters moved): name it, and what it changed."""
    impls = [i.plugin_name for i in reversed(loop.plugins.pm.hook.after_eval_step.get_hookimpls())
             if loop.plugins.sources.get(i.plugin_name) != "built-in"]
    who = (f"plugin {impls[0]!r}" if len(impls) == 1 else
           f"one of the plugins {', '.join(map(repr, impls))}" if impls else "an after_eval_step implementation")
    changed = [i for i, (t, v) in enumerate(versions) if t._version != v]
    shapes = ", ".join(f"tensor #{i} of shape {list(versions[i][0].shape)}" for i in changed[:3])
    exc = ValueError(f"after_eval_step: {who} changed the evaluation batch in place ({shapes} of the batch): "
                     "the metrics computed after it would be wrong. Work on a copy (t.clone()) instead")
    if len(impls) == 1:
        exc.hookloop_culprit = (impls[0], "after_eval_step")  # type: ignore[attr-defined]
    return exc


def _bad_result(loop: Any, plugin: str | None, values: object) -> TypeError:
    impls = [i.plugin_name for i in reversed(loop.plugins.pm.hook.after_eval_step.get_hookimpls())]
    who = f"plugin {plugin!r}" if plugin else f"after_eval_step plugins: {', '.join(impls)}"
    return TypeError(
        "after_eval_step must return None or a dict {metric name: tensor of per-example "
        f"values}}, got {type(values).__name__} {_short(values)} ({who})"
    )


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."


def concat(parts: Sequence[Any]) -> Any:
    """Batches of gathered outputs joined into one: tensors on dim 0, the
    same structure around them."""
    if not parts:
        return None
    first = parts[0]
    make: Any = type(first)  # the parts' own class, whatever its constructor takes
    if isinstance(first, torch.Tensor):
        return torch.cat([p.reshape(1) if p.ndim == 0 else p for p in parts])
    if isinstance(first, Mapping):
        joined = {key: concat([p[key] for p in parts]) for key in first}
        try:
            return make(**joined)  # a Hugging Face ModelOutput, a dict subclass
        except TypeError:
            return make(joined)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return make(*(concat([p[i] for p in parts]) for i in range(len(first))))
    if isinstance(first, Sequence) and not isinstance(first, (str, bytes)):
        return make(concat([p[i] for p in parts]) for i in range(len(first)))
    if first is None:
        return None
    return list(parts)
