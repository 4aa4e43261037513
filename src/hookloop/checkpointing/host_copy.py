"""The state ``accelerator.save_state`` writes, taken at the safe point.

:func:`take` splits Accelerate's save in two, for the plain format (no
FSDP, DeepSpeed, Megatron-LM or XLA: :func:`supported`):

- the small files (schedulers, samplers and data loader states, the
  gradient scaler, each process's random states, the objects registered with
  ``register_for_checkpointing``) are written at once, by Accelerate's own
  ``save_accelerator_state`` / ``save_custom_state``: byte for byte its files;
- the heavy ones, every model's weights (``model.safetensors``, cleaned of
  aliases as Accelerate's ``save`` does) and every optimizer's state
  (``optimizer.bin``), are returned as state dicts for
  :func:`~.writer.write_file`: the live tensors (a synchronous save: training
  waits), or a copy in host memory (``copy=True``: training goes on while a
  background thread writes them).

The copy copies each tensor's whole storage once (views and shared storages
stay views and shared, as ``torch.save`` records them), into host buffers
kept from the previous save of the same sizes (no page faults, no pinned
allocation after the first), pinned and non-blocking from a GPU. Its
finiteness check is not on the training thread: it is a copy, so the
background writer checks it (:meth:`Snapshot.find_nonfinite`, one fused
reduction that releases the GIL) before it writes any file, and a
non-finite copy is never written.
"""

from __future__ import annotations

from typing import Any
import copy as _copy
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import accelerate as accel
from . import finite

#: Accelerate's distributed types whose ``save_state`` is the plain format
PLAIN_TYPES = {"NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
               "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON"}


def supported(acc) -> bool:
    """Whether ``acc``'s ``save_state`` writes the plain format, which
    :func:`take` reproduces."""
    return getattr(acc.distributed_type, "name", "") in PLAIN_TYPES


@dataclass
class Snapshot:
    """What :func:`take` leaves to write: ``files`` as ``(rel, kind, payload,
    metadata)`` for :func:`~.writer.write_file` (on the main process);
    ``copied``: bytes copied to host memory; ``floating``: ``(rel, key,
    copy)`` of every floating tensor copied (for :meth:`find_nonfinite`)."""

    files: list = field(default_factory=list)
    copied: int = 0
    storages: list = field(default_factory=list)  # the host buffers, back to the pool after the write
    floating: list = field(default_factory=list)

    def find_nonfinite(self) -> tuple | None:
        """``(rel, key, value)`` of the first copied tensor holding a NaN or an
        infinity, or None: one fused reduction over the host copy
        (:func:`~.finite.first_nonfinite`), off the training thread."""
        bad = finite.first_nonfinite(t for *_, t in self.floating)
        if bad is None:
            return None
        rel, key, t = self.floating[bad]
        flat = t.detach().reshape(-1)
        return rel, "".join(f"[{k!r}]" for k in key), flat[~flat.isfinite()][0].item()

    def release(self, acc) -> None:
        """The write is done: its host buffers serve the next copy."""
        pool = _POOLS.setdefault(acc, {})
        for storage in self.storages:
            pool.setdefault((storage.nbytes(), storage.is_pinned()), []).append(storage)
        self.storages, self.files, self.floating = [], [], []


#: accelerator -> host buffers by (bytes, pinned), from its last save
_POOLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def take(acc, folder: Path, *, copy: bool, check: bool = True) -> Snapshot:
    """Every process, at the safe point: write Accelerate's small files into
    ``folder`` and return the models' and optimizers' states to write (this
    process's share: the main process's, as Accelerate's ``save``), copied
    to host memory if ``copy`` (its floating tensors listed for
    :meth:`Snapshot.find_nonfinite` if ``check``). Calls the ``register_save_state_pre_hook`` hooks with the
    weights, and counts the save in ``project_configuration.iteration``, as
    ``save_state`` does."""
    from accelerate.checkpointing import save_accelerator_state, save_custom_state
    from accelerate.state import PartialState
    from accelerate.utils.other import clean_state_dict_for_safetensors

    config = acc.project_configuration
    each_node = config.save_on_each_node
    weights = [acc.get_state_dict(model, unwrap=False) for model in accel.models(acc)]
    for hook in acc._save_model_state_pre_hook.values():
        hook(accel.models(acc), weights, str(folder))
    state = PartialState()
    writes = state.is_local_main_process if each_node else state.is_main_process
    out = Snapshot()
    if writes:
        for i, weight in enumerate(weights):
            if isinstance(weight, OrderedDict):  # as accelerate.utils.save does
                weight = clean_state_dict_for_safetensors(weight)
            out.files.append([accel.model_file(i), "safetensors", weight, {"format": "pt"}])
        for i, optimizer in enumerate(accel.optimizers(acc)):
            out.files.append([accel.optimizer_file(i), "torch", optimizer.state_dict(), None])
    del weights
    save_accelerator_state(str(folder), [], [], accel.scheduler_objects(acc), acc._dataloaders,
                           state.process_index, acc.step, acc.scaler, save_on_each_node=each_node,
                           safe_serialization=True)
    for i, obj in enumerate(accel.custom_objects(acc)):
        save_custom_state(obj, str(folder), i, save_on_each_node=each_node)
    config.iteration += 1
    if copy:
        _to_host(out, acc, check)
    return out


class _Copier:
    """Copies tensors to host memory, each storage once, listing the
    floating copies (``check``) for :meth:`Snapshot.find_nonfinite`."""

    def __init__(self, pool: dict, check: bool):
        self.pool = pool
        self.checking = check
        self.storages: dict[tuple[Any, int], Any] = {}  # (device, data_ptr) -> host storage
        self.copied = 0
        self.floating: list[tuple[str, tuple[Any, ...], Any]] = []  # (rel, key, host copy)

    def _host_storage(self, source, device):
        nbytes = source.nbytes()
        pinned = device.type == "cuda"
        free = self.pool.get((nbytes, pinned))
        host = free.pop() if free else torch.empty(nbytes, dtype=torch.uint8,
                                                   pin_memory=pinned).untyped_storage()
        host.copy_(source, non_blocking=pinned)
        self.copied += nbytes
        return host

    def tensor(self, t: torch.Tensor, rel: str, key: tuple) -> torch.Tensor:
        source = t.untyped_storage()
        where = (t.device, source.data_ptr())
        host = self.storages.get(where)
        if host is None:
            host = self.storages[where] = self._host_storage(source, t.device)
        copied = torch.empty((0,), dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())
        if t.requires_grad and t.is_leaf:
            copied.requires_grad_(True)
        if self.checking and (t.is_floating_point() or t.is_complex()):
            self.floating.append((rel, key, copied))
        return copied

    def copy(self, obj, rel: str, key: tuple = ()):
        """``obj`` with every tensor copied and every container new (in its
        own type and order, so that it pickles as ``obj`` does); ``key``:
        the path to ``obj`` (formatted only for an error)."""
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, rel, key)
        if isinstance(obj, dict):
            new = obj.__class__() if type(obj) in (dict, OrderedDict) else _copy.copy(obj)
            for k, v in obj.items():
                new[k] = self.copy(v, rel, (*key, k))
            return new
        if isinstance(obj, list):
            return [self.copy(v, rel, (*key, i)) for i, v in enumerate(obj)]
        if type(obj) is tuple:
            return tuple(self.copy(v, rel, (*key, i)) for i, v in enumerate(obj))
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
            return obj
        return _copy.deepcopy(obj)  # anything else a state dict may hold: its own copy


def _to_host(out: Snapshot, acc, check: bool) -> None:
    """Replace every payload of ``out`` by its host copy."""
    copier = _Copier(_POOLS.setdefault(acc, {}), check)
    for entry in out.files:
        entry[2] = copier.copy(entry[2], entry[0])
    if any(device.type == "cuda" for device, _ in copier.storages):
        torch.cuda.current_stream().synchronize()  # the non-blocking copies have landed
    out.floating = copier.floating
    out.copied = copier.copied
    out.storages = list(copier.storages.values())
