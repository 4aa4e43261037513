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


# -- several evaluation sets ------------------------------------------------------------


def eval_sets(data: Any) -> list[tuple[str | None, Any]]:
    """The evaluation sets of ``eval_data``, by name: ``[(None, data)]`` for
    one set; a dict ``{"val": loader, "test": loader}`` by its keys; a list
    or tuple of ``DataLoader`` objects as ``"0"``, ``"1"`` ... (a list of
    anything else is one set: its batches)."""
    if isinstance(data, Mapping):
        return [(str(name), loader) for name, loader in data.items()]
    if isinstance(data, (list, tuple)) and data and any(isinstance(d, DataLoader) for d in data):
        return [(str(i), loader) for i, loader in enumerate(data)]
    return [(None, data)]


def with_sets(data: Any, loaders: Sequence[Any]) -> Any:
    """``data`` (as :func:`eval_sets` reads it) with its sets' loaders replaced."""
    if isinstance(data, Mapping):
        return dict(zip(data, loaders))
    if eval_sets(data)[0][0] is not None:  # a list or tuple of loaders
        return type(data)(loaders)
    return loaders[0]


def check_eval_data(data: Any, what: str = "eval_data") -> None:
    """Refuse, at ``Loop(...)``, evaluation data that gives no batches:
    naming the set (``eval_data['test']``) and what to pass instead."""
    if data is None:
        return
    sets = eval_sets(data)
    if not sets:
        raise ValueError(f"{what} is empty: pass a DataLoader, or a dict of them by name")
    from torch.utils.data import Dataset, IterableDataset

    for name, loader in sets:
        where = what if name is None else f"{what}[{name!r}]" if isinstance(data, Mapping) else f"{what}[{name}]"
        if isinstance(loader, (str, bytes, Mapping, torch.Tensor)) or loader is None or (
                isinstance(loader, Dataset) and not isinstance(loader, IterableDataset)) or not hasattr(
                loader, "__iter__"):
            raise ValueError(
                f"{where} is a {type(loader).__module__}.{type(loader).__qualname__}, not batches: pass a "
                "DataLoader (DataLoader(dataset, batch_size=...)); several evaluation sets as a dict of "
                "them, {'val': val_loader, 'test': test_loader}, or a list")


def metric_key(eval_set: str | None, key: str) -> str:
    """The name of metric ``key`` (``eval_loss``, ``perplexity``) of evaluation
    set ``eval_set``: itself for the one set; ``eval_<set>_<key without
    eval_>`` for a named one (``eval_test_loss``), as the Hugging Face
    Trainer names the metrics of a dict of evaluation sets."""
    return key if eval_set is None else f"eval_{eval_set}_{key.removeprefix('eval_')}"


def outputs_of(loop: LoopLike, batch: Any, eval_set: str | None = None) -> Any:
    """``eval_step``'s result for one batch; an error naming the strategy if
    no plugin gave one."""
    outputs = loop.hook.eval_step(loop=loop, batch=batch, eval_set=eval_set)
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
    ``limit``: at most this many batches (the sanity check's one).

    Several evaluation sets (:func:`eval_sets`) are one evaluation: one
    ``on_eval_start``, every set's batches (``eval_step`` and
    ``after_eval_step`` told the set's name), one ``on_eval_end`` whose
    metrics hold each set's under its own keys (:func:`metric_key`)."""
    hook = loop.hook
    named = hook.named("after_eval_step")  # who returned what (None: pluggy's caller runs it)
    sets = eval_sets(data)
    logged = logbook.eval_values
    owners = dict(metrics._owners) if isinstance(metrics, Metrics) else {}
    found = dict(metrics or {})
    with eval_mode(loop.networks):
        hook.on_eval_start(loop=loop)
        for eval_set, loader in sets:
            values = Values(loop)
            logged.clear()
            loaders_before = list(loop.accelerator.gradient_state.dataloader_references)
            batches = iter(loader)
            try:
                with torch.no_grad():
                    for batch in batches:
                        outputs = outputs_of(loop, batch, eval_set)
                        versions = [(t, t._version) for t in _tensors(batch)]  # (in-place changes: seen)
                        if named is not None:
                            results = named(loop=loop, batch=batch, outputs=outputs, eval_set=eval_set)
                        else:
                            results = [(None, r) for r in hook.after_eval_step(
                                loop=loop, batch=batch, outputs=outputs, eval_set=eval_set)]
                        if any(t._version != v for t, v in versions):
                            raise _changed_in_place(loop, batch, versions)
                        values.add(results, batch)
                        if limit is not None and values.batches >= limit:
                            break
                    else:
                        if limit is not None and values.batches == 0:
                            where = "eval_data" if eval_set is None else f"evaluation set {eval_set!r}"
                            raise ValueError(f"{where} is empty (0 batches): check the dataset and batch_size")
            finally:
                if limit is not None:
                    abandon(batches, loop.accelerator, loaders_before)
            for source in (logged.reduce(loop.accelerator), values.means()):
                found.update((metric_key(eval_set, k), v) for k, v in source.items())
            owners.update((metric_key(eval_set, k), v) for o in (logged.owners, values.owners) for k, v in o.items())
        metrics = Metrics(found, plugins=loop.plugins, owners=owners,
                          eval_sets=[name for name, _ in sets if name is not None])
        hook.on_eval_end(loop=loop, metrics=metrics)
    return metrics


def sanity_check(loop: LoopLike, data: Iterable[Any], logbook: Logbook) -> None:
    """The sanity check: a whole evaluation (``on_eval_start``, one batch of
    ``data`` through ``eval_step`` and ``after_eval_step``, ``on_eval_end``)
    with ``loop.state.stage == "sanity"``, so that a wrong evaluation set, a
    metric plugin or a misspelt ``monitor`` fails in seconds, not after an
    epoch. Its metrics go nowhere; every random state (global, and the
    loader's generators) is put back afterwards."""
    with rng.keep_rng(*(loader for _, loader in eval_sets(data))):
        run(loop, data, logbook, limit=1)


def predict(loop: Any, data: Any, pad_index: float | None = -100) -> Any:
    """The gathered ``eval_step`` outputs of every batch of ``data``, joined
    (:func:`concat`); with several processes each batch's outputs are first
    made alike over them (:func:`even_across_processes`), as gathering needs."""
    acc = loop.accelerator
    several = acc.num_processes > 1
    parts: list[Any] = []
    with eval_mode(loop.networks), torch.no_grad():
        for batch in data:
            outputs = outputs_of(loop, batch)
            if several:
                outputs = even_across_processes(acc, outputs, pad_index, len(parts))
            parts.append(acc.gather_for_metrics(outputs))
    return concat(parts, pad_index)


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
    sets = eval_sets(data)
    if len(sets) > 1 or sets[0][0] is not None:
        check_eval_data(data, "data")
        return with_sets(data, [loader_for(loop, loader) for _, loader in sets])
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


# -- joining predictions: over processes, then over batches ---------------------------
#
# Per-token outputs of batches padded each to its own longest sequence differ
# in size after the first dimension, from batch to batch and from process to
# process. As the Hugging Face Trainer does (``nested_concat``,
# ``pad_across_processes``, ``padding_index=-100``), they are padded at the end
# of every dimension after the first to the largest size seen; anything that
# still cannot be joined is an error naming the output and the shapes.

#: the most dimensions of an output whose sizes processes compare
MAX_DIMS = 8


def concat(parts: Sequence[Any], pad_index: float | None = None, path: str = "outputs") -> Any:
    """Batches of gathered outputs joined into one: tensors on dim 0 (padded
    with ``pad_index`` where their other sizes differ), the same structure
    around them. ``path`` names the output in errors (``outputs['logits']``)."""
    if not parts:
        return None
    first = parts[0]
    make: Any = type(first)  # the parts' own class, whatever its constructor takes
    if isinstance(first, torch.Tensor):
        return _join(parts, pad_index, path)
    if isinstance(first, Mapping):
        for i, part in enumerate(parts):
            if not isinstance(part, Mapping) or set(part) != set(first):
                raise _unjoinable(path, f"batch 0 has the keys {sorted(map(str, first))}, batch {i} "
                                        f"{_describe(part)} (eval_step returns one structure for every batch)")
        joined = {key: concat([p[key] for p in parts], pad_index, f"{path}[{key!r}]") for key in first}
        try:
            return make(**joined)  # a Hugging Face ModelOutput, a dict subclass
        except TypeError:
            return make(joined)
    if isinstance(first, Sequence) and not isinstance(first, (str, bytes)):
        for i, part in enumerate(parts):
            if not isinstance(part, Sequence) or len(part) != len(first):
                raise _unjoinable(path, f"batch 0 has {len(first)} entries, batch {i} {_describe(part)} "
                                        "(eval_step returns one structure for every batch)")
        items = (concat([p[i] for p in parts], pad_index, f"{path}[{i}]") for i in range(len(first)))
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return make(*items)
        return make(items)
    if first is None:
        return None
    return list(parts)


def _join(parts: Sequence[Any], pad_index: float | None, path: str) -> torch.Tensor:
    """One output's tensors of every batch, concatenated on dim 0."""
    tensors: list[torch.Tensor] = []
    for i, part in enumerate(parts):
        if not isinstance(part, torch.Tensor):
            raise _unjoinable(path, f"batch 0 is a tensor, batch {i} {_describe(part)}")
        tensors.append(part.reshape(1) if part.ndim == 0 else part)
    if len({t.ndim for t in tensors}) > 1:
        raise _unjoinable(path, "its batches have different numbers of dimensions: " + _shapes(tensors))
    target = [max(sizes) for sizes in zip(*(t.shape[1:] for t in tensors))]
    if any(list(t.shape[1:]) != target for t in tensors):
        if pad_index is None:
            raise _unjoinable(path, "its batches differ in size after the first dimension ("
                              f"{_shapes(tensors)}) and pad_index is None: predict(data, pad_index=-100) "
                              "pads them to the largest size")
        tensors = [_pad(t, target, pad_index, path) for t in tensors]
    try:
        return torch.cat(tensors)
    except RuntimeError as exc:  # (another device, a dtype torch does not join)
        raise _unjoinable(path, f"{_shapes(tensors)}: {exc}") from None


def even_across_processes(accelerator: Any, outputs: Any, pad_index: float | None, batch: int) -> Any:
    """``outputs`` of one batch, each tensor padded with ``pad_index`` after
    its first dimension to the largest size any process has (one gather of
    every tensor's shape, not one per tensor and dimension), so that
    ``gather_for_metrics`` can join them. Sizes that differ with
    ``pad_index=None``, and numbers of dimensions that differ, are an error
    naming the output, raised on every process alike."""
    leaves: list[tuple[str, torch.Tensor]] = []
    _tensor_leaves(outputs, "outputs", leaves)
    if not leaves:
        return outputs
    table = torch.zeros(len(leaves), MAX_DIMS + 1, dtype=torch.int64)
    for row, (path, tensor) in zip(table, leaves):
        if tensor.ndim > MAX_DIMS + 1:
            raise _unjoinable(path, f"it has {tensor.ndim} dimensions; predict pads at most {MAX_DIMS + 1}")
        row[0] = tensor.ndim
        row[1:tensor.ndim] = torch.tensor(tensor.shape[1:], dtype=torch.int64)
    every = accelerator.gather(table.to(accelerator.device)[None]).cpu()  # (processes, leaves, 1 + dims)
    padded: dict[str, torch.Tensor] = {}
    for i, (path, tensor) in enumerate(leaves):
        shapes = every[:, i]
        if len(set(shapes[:, 0].tolist())) > 1 or bool((shapes[:, 1:] != shapes[0, 1:]).any()):
            seen = "; ".join(f"process {p}: {[int(n) for n in s[1:int(s[0])]]}" for p, s in enumerate(shapes))
            if len(set(shapes[:, 0].tolist())) > 1:
                raise _unjoinable(path, f"in batch {batch} the processes' outputs have different numbers of "
                                        f"dimensions (sizes after the first: {seen})")
            if pad_index is None:
                raise _unjoinable(path, f"in batch {batch} the processes' outputs differ in size after the first "
                                        f"dimension ({seen}) and pad_index is None: predict(data, "
                                        "pad_index=-100) pads them to the largest size")
            target = shapes[:, 1:tensor.ndim].max(dim=0).values.tolist()
            padded[path] = _pad(tensor, target, pad_index, path)
    if not padded:
        return outputs
    return _replace_leaves(outputs, "outputs", padded)


def _pad(tensor: torch.Tensor, sizes: Sequence[int], pad_index: float, path: str) -> torch.Tensor:
    """``tensor`` with its dimensions after the first grown to ``sizes``,
    the new entries ``pad_index``; the old ones in place."""
    if tensor.dtype == torch.bool:
        raise _unjoinable(path, f"it is a bool tensor, which cannot hold pad_index={pad_index!r}")
    try:
        out = tensor.new_full((tensor.shape[0], *sizes), pad_index)
    except (RuntimeError, TypeError) as exc:  # -100 in uint8: an overflow
        raise _unjoinable(path, f"a {tensor.dtype} tensor cannot hold pad_index={pad_index!r} ({exc})") from None
    out[tuple(slice(0, n) for n in tensor.shape)] = tensor
    return out


def _tensor_leaves(outputs: Any, path: str, into: list[tuple[str, torch.Tensor]]) -> None:
    """The tensors in ``outputs`` (dicts, lists, tuples), each with its path."""
    if isinstance(outputs, torch.Tensor):
        into.append((path, outputs))
    elif isinstance(outputs, Mapping):
        for key, value in outputs.items():
            _tensor_leaves(value, f"{path}[{key!r}]", into)
    elif isinstance(outputs, Sequence) and not isinstance(outputs, (str, bytes)):
        for i, value in enumerate(outputs):
            _tensor_leaves(value, f"{path}[{i}]", into)


def _replace_leaves(outputs: Any, path: str, new: Mapping[str, torch.Tensor]) -> Any:
    """``outputs`` with the tensors at the paths of ``new`` replaced, each
    container rebuilt as its own class (as :func:`concat` does)."""
    if isinstance(outputs, torch.Tensor):
        return new.get(path, outputs)
    make: Any = type(outputs)
    if isinstance(outputs, Mapping):
        items = {key: _replace_leaves(value, f"{path}[{key!r}]", new) for key, value in outputs.items()}
        try:
            return make(**items)
        except TypeError:
            return make(items)
    if isinstance(outputs, Sequence) and not isinstance(outputs, (str, bytes)):
        values = (_replace_leaves(value, f"{path}[{i}]", new) for i, value in enumerate(outputs))
        return make(*values) if isinstance(outputs, tuple) and hasattr(outputs, "_fields") else make(values)
    return outputs


def _shapes(tensors: Sequence[torch.Tensor]) -> str:
    """The distinct shapes (and dtypes) of ``tensors``, with the first batch of each."""
    first: dict[tuple[tuple[int, ...], torch.dtype], int] = {}
    for i, t in enumerate(tensors):
        first.setdefault((tuple(t.shape), t.dtype), i)
    return ", ".join(f"batch {i}: {list(shape)} {str(dtype).removeprefix('torch.')}"
                     for (shape, dtype), i in list(first.items())[:4])


def _describe(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"has the keys {sorted(map(str, value))}"
    if isinstance(value, torch.Tensor):
        return f"is a tensor of shape {list(value.shape)}"
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return f"has {len(value)} entries"
    return f"is a {type(value).__name__}"


def _unjoinable(path: str, problem: str) -> ValueError:
    return ValueError(f"predict: {path} cannot be joined: {problem}")
