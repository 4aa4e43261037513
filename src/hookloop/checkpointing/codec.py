"""hookloop's own state as data, never a pickle: plugin states as JSON plus
tensors (:func:`to_data` / :func:`from_data`), and each process's rank file
(``hookloop-rank<rank>.safetensors``: its random and data-generator states).

Plugin state protocol: every registered plugin with both ``state_dict()``
and ``load_state_dict(state)`` is saved under its plugin name
(:func:`stateful_plugins`).
"""

from __future__ import annotations

from typing import Any
import json
import random
import warnings
from pathlib import Path

import numpy as np
import torch

from ..epoch_values import EpochValues
from ..rng import SAMPLER_PREFIX, data_generators, sampler_states, unrestorable_samplers
from .errors import CheckpointError
from .store import FORMAT


def stateful_plugins(loop):
    """``(name, plugin)`` for every registered plugin with both
    ``state_dict`` and ``load_state_dict``, in registration order."""
    for name, plugin in loop.plugins.pm.list_name_plugin():
        if plugin is None:
            continue
        if callable(getattr(plugin, "state_dict", None)) and callable(
            getattr(plugin, "load_state_dict", None)
        ):
            yield name, plugin


# -- plugin state as data ------------------------------------------------------------

_SPECIAL = ("__tensor__", "__ndarray__", "__tuple__", "__items__")


def to_data(obj, tensors: dict, prefix: str, where: str, path: str = ""):
    """``obj`` as JSON-able data. Tensors and numpy arrays go into
    ``tensors`` (under a new key starting with ``prefix``) and are referenced
    by that key; ``where`` and ``path`` name the culprit in errors."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        key = f"{prefix}/{len(tensors)}"
        if isinstance(obj, torch.Tensor):
            tensors[key] = obj.detach().to("cpu", copy=True).contiguous()
            return {"__tensor__": key}
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj).copy())
        return {"__ndarray__": key}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (tuple, list)):
        items = [to_data(v, tensors, prefix, where, f"{path}[{i}]") for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in _SPECIAL for k in obj):
            return {k: to_data(v, tensors, prefix, where, f"{path}[{k!r}]") for k, v in obj.items()}
        return {"__items__": [
            [to_data(k, tensors, prefix, where, f"{path} key {k!r}"),
             to_data(v, tensors, prefix, where, f"{path}[{k!r}]")]
            for k, v in obj.items()
        ]}
    raise CheckpointError(
        f"{where}{path} is a {type(obj).__module__}.{type(obj).__qualname__}, which a "
        "checkpoint cannot store as data (allowed: dict, list, tuple, str, int, float, bool, "
        "None, torch.Tensor, numpy array)"
    )


def from_data(obj, tensors: dict):
    """What :func:`to_data` was given, from its result and the tensors."""
    if isinstance(obj, list):
        return [from_data(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if len(obj) == 1:
            (tag, value), = obj.items()
            if tag == "__tensor__":
                return tensors[value]
            if tag == "__ndarray__":
                return tensors[value].numpy()
            if tag == "__tuple__":
                return tuple(from_data(v, tensors) for v in value)
            if tag == "__items__":
                return {_hashable(from_data(k, tensors)): from_data(v, tensors) for k, v in value}
        return {k: from_data(v, tensors) for k, v in obj.items()}
    return obj


def _hashable(key):
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


# -- the rank file: what a resumed epoch needs to redraw the same shuffle ---------------


def _rng_tensors(prefix: str, rng: dict, tensors: dict, meta: dict) -> None:
    py_version, py_state, py_gauss = rng["python"]
    np_name, np_keys, np_pos, np_has_gauss, np_cached = rng["numpy"]
    tensors[f"{prefix}.torch"] = rng["torch"].clone()
    tensors[f"{prefix}.numpy"] = torch.from_numpy(np.asarray(np_keys, dtype=np.int64))
    tensors[f"{prefix}.python"] = torch.tensor(py_state, dtype=torch.int64)
    meta[f"{prefix}.numpy"] = json.dumps([np_name, int(np_pos), int(np_has_gauss), float(np_cached)])
    meta[f"{prefix}.python"] = json.dumps([py_version, py_gauss])


def _rng_from_tensors(prefix: str, tensors: dict, meta: dict) -> dict:
    np_name, np_pos, np_has_gauss, np_cached = json.loads(meta[f"{prefix}.numpy"])
    py_version, py_gauss = json.loads(meta[f"{prefix}.python"])
    return {
        "torch": tensors[f"{prefix}.torch"],
        "numpy": (np_name, tensors[f"{prefix}.numpy"].numpy().astype(np.uint32), np_pos,
                  np_has_gauss, np_cached),
        "python": (py_version, tuple(int(v) for v in tensors[f"{prefix}.python"].tolist()), py_gauss),
    }


def write_rank_file(file: Path, loop) -> None:
    """This process's part of the run state: the random states its epoch
    started from (and, for an epoch continued on another number of processes,
    the generator state its shuffle is drawn with: ``epoch.shuffle``), its
    data generators now, and its ``loop.log(on_epoch=True)`` values of the
    epoch so far."""
    from safetensors.torch import save_file

    tensors: dict = {}
    meta = {"format": FORMAT}
    epoch = loop.state.epoch_start
    if epoch is not None:
        _rng_tensors("epoch", epoch["rng"], tensors, meta)
        for path, state in epoch["generators"].items():
            if not path.startswith(SAMPLER_PREFIX):
                tensors[f"epoch.gen.{path}"] = state.clone()
        _sampler_entries("epoch", epoch["generators"], tensors, meta)
        if epoch.get("shuffle") is not None:  # an epoch continued on another loader (rng.translate_epoch)
            tensors["epoch.shuffle"] = epoch["shuffle"].clone()
    if loop.train_data is not None:
        for path, gen in data_generators(loop.train_data).items():
            tensors[f"now.gen.{path}"] = gen.get_state()
        _sampler_entries("now", sampler_states(loop.train_data), tensors, meta)
        _warn_unrestorable_samplers(loop)
    logged = []
    for i, (key, (reduce, total, count)) in enumerate(loop.state.logged.state_dict().items()):
        if isinstance(total, torch.Tensor):
            tensors[f"log.{i}"] = total.to(torch.float64).reshape(())
            logged.append([key, reduce, None, count])
        else:
            logged.append([key, reduce, float(total), count])
    if logged:
        meta["logged"] = json.dumps(logged)
    save_file(tensors, str(file), metadata=meta)


def _sampler_entries(prefix: str, states: dict, tensors: dict, meta: dict) -> None:
    """The user's own samplers' states (``"sampler:<role>"`` entries) as data."""
    samplers = {k: v for k, v in states.items() if k.startswith(SAMPLER_PREFIX)}
    if samplers:
        meta[f"{prefix}.samplers"] = json.dumps(to_data(
            samplers, tensors, f"{prefix}.sampler", "the state of the training data's sampler "))


def _samplers_from(prefix: str, tensors: dict, meta: dict) -> dict:
    return from_data(json.loads(meta[f"{prefix}.samplers"]), tensors) if f"{prefix}.samplers" in meta else {}


def _warn_unrestorable_samplers(loop) -> None:
    """At a loop's first save: name the user's samplers whose order a
    resume cannot restore (:func:`~hookloop.rng.unrestorable_samplers`)."""
    if getattr(loop, "_samplers_checked", False):
        return
    loop._samplers_checked = True
    if not loop.accelerator.is_main_process:
        return
    for name, why in unrestorable_samplers(loop.train_data).items():
        warnings.warn(
            f"hookloop: the training data's sampler {name} will not resume exactly from a checkpoint: "
            f"{why}. Keep its random generators as attributes (torch.Generator, numpy Generator, "
            "random.Random), or give it state_dict()/load_state_dict() (torchdata's Stateful), or "
            "draw from the global random state (docs/checkpoints.md, What resumes bit for bit)",
            RuntimeWarning, stacklevel=2)


def parse_rank_file(tensors: dict, meta: dict):
    """``(epoch_start, generators_now, logged)`` from a rank file's tensors and
    metadata, every random state checked by loading it into a scratch
    generator (a garbled one fails here, not inside ``random.setstate``
    during ``fit``); ``logged`` as :meth:`EpochValues.state_dict` gives it."""
    epoch: dict[str, Any] | None = None
    if "epoch.torch" in tensors:
        epoch = {
            "rng": _rng_from_tensors("epoch", tensors, meta),
            "generators": {k[len("epoch.gen."):]: v for k, v in tensors.items()
                           if k.startswith("epoch.gen.")},
        }
        epoch["generators"].update(_samplers_from("epoch", tensors, meta))
        if "epoch.shuffle" in tensors:
            epoch["shuffle"] = tensors["epoch.shuffle"]
        check_rng(epoch["rng"]["python"], epoch["rng"]["numpy"], epoch["rng"]["torch"])
        for path, state in [*epoch["generators"].items(), *([("", epoch["shuffle"])] if "shuffle" in epoch else [])]:
            if not path.startswith(SAMPLER_PREFIX):
                torch.Generator().set_state(state)
    now = {k[len("now.gen."):]: v for k, v in tensors.items() if k.startswith("now.gen.")}
    for state in now.values():
        torch.Generator().set_state(state)
    now.update(_samplers_from("now", tensors, meta))
    logged = {}
    for i, (key, reduce, total, count) in enumerate(json.loads(meta.get("logged", "[]"))):
        logged[key] = [reduce, tensors[f"log.{i}"] if total is None else total, count]
    EpochValues().load_state_dict(logged)  # checked: fails here, not at the epoch's end
    return epoch, now, logged


def check_rng(python, numpy, torch_state) -> None:
    """Load random states into scratch generators: raises if any is not valid."""
    random.Random().setstate(python)
    np.random.RandomState().set_state(numpy)
    torch.Generator().set_state(torch_state)
