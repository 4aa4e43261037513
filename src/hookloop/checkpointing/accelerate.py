"""The one module that knows Accelerate's side of a checkpoint: the names of
the files ``accelerator.save_state`` writes, the accelerator's private lists
of prepared objects and hooks, its process state and distributed types,
writing its files as ``save_state`` does, reading them the safe way
(``weights_only=True``; safetensors parsed by safetensors), and putting
states into its objects as ``accelerator.load_state`` does. Every private
name used here is listed by ``tests/checkpointing/test_accelerate_adapter.py``,
which fails on an Accelerate that moved one: when it does, read this again.
"""

from __future__ import annotations

import random
import re
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from accelerate.utils import OPTIMIZER_NAME, RNG_STATE_NAME, SAFE_WEIGHTS_NAME, SCHEDULER_NAME

from .errors import CheckpointError, first_line

SCALER_FILE = "scaler.pt"
#: Accelerate's distributed types whose ``save_state`` writes the plain format
PLAIN_TYPES = {"NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
               "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON"}
#: those whose states are sharded over the processes (their position maps onto no other number of them);
#: hookloop writes and reads FSDP's, and refuses the others (their engines save themselves)
SHARDED_TYPES = ("FSDP", "DEEPSPEED", "MEGATRON_LM")


def numbered(stem: str, i: int, ext: str = "bin") -> str:
    return f"{stem}.{ext}" if i == 0 else f"{stem}_{i}.{ext}"


def model_file(i: int) -> str:
    return numbered(SAFE_WEIGHTS_NAME.rsplit(".", 1)[0], i, "safetensors")


def legacy_model_file(i: int) -> str:
    """``pytorch_model.bin`` ... (``save_state(safe_serialization=False)``)."""
    return numbered("pytorch_model", i)


def optimizer_file(i: int) -> str:
    return numbered(OPTIMIZER_NAME, i)


def scheduler_file(i: int) -> str:
    return numbered(SCHEDULER_NAME, i)


def custom_file(i: int) -> str:
    """The state of the i-th object given to ``register_for_checkpointing``."""
    return f"custom_checkpoint_{i}.pkl"


def rng_file(rank: int) -> str:
    return f"{RNG_STATE_NAME}_{rank}.pkl"


#: Accelerate's data loader files: a seedable sampler, a stateful loader's state
LOADER_FILE = re.compile(r"^(sampler|dl_state_dict)(_\d+)?\.bin$")
#: Accelerate's per-object files besides the models' and optimizers' (each process reads its own)
SMALL_FILE = re.compile(rf"^({RNG_STATE_NAME}_\d+\.pkl|{SCHEDULER_NAME}(_\d+)?\.bin|custom_checkpoint_\d+\.pkl|"
                        rf"{re.escape(SCALER_FILE)}|(sampler|dl_state_dict)(_\d+)?\.bin)$")


def written_by_save_state(path) -> bool:
    return any((path / name).is_file() for name in (model_file(0), legacy_model_file(0),
                                                    optimizer_file(0), rng_file(0)))


# -- the accelerator's prepared objects, and the process state ----------------------------


def models(acc) -> list:
    return acc._models


def optimizers(acc) -> list:
    return acc._optimizers


def custom_objects(acc) -> list:
    return acc._custom_objects


def scheduler_objects(acc) -> list:
    """The schedulers ``save_state`` writes as ``scheduler*.bin``, in order."""
    return acc._schedulers


def kind(acc) -> str:
    """Accelerate's distributed type, by name (``"NO"``, ``"FSDP"`` ...)."""
    return getattr(getattr(acc, "distributed_type", None), "name", "")


def process_index() -> int:
    from accelerate.state import PartialState

    return PartialState._shared_state.get("process_index", 0)


def process_count() -> int:
    from accelerate.state import PartialState

    return PartialState._shared_state.get("num_processes", 1)


def counts(acc) -> dict:
    return {"models": len(acc._models), "optimizers": len(acc._optimizers),
            "schedulers": len(acc._schedulers), "custom_objects": len(acc._custom_objects)}


def class_name(obj) -> str:
    """The class of an optimizer or scheduler, unwrapped from Accelerate's."""
    inner = getattr(obj, "optimizer", None) or getattr(obj, "scheduler", None) \
        if type(obj).__module__.startswith("accelerate.") else None
    return f"{type(inner or obj).__module__}.{type(inner or obj).__qualname__}"


def describe(loop, files, unprepared=None) -> dict:
    """Which of Accelerate's files holds each network's model, optimizer and
    scheduler: ``files(part, i)`` names the i-th prepared one's;
    ``unprepared(name, net, part)`` the entry of one Accelerate did not
    prepare, or None (refused)."""
    acc, out = loop.accelerator, {}
    for name, net in loop.networks.items():
        entry: dict[str, Any] = {}
        for part, objects in (("model", acc._models), ("optimizer", acc._optimizers),
                              ("scheduler", acc._schedulers)):
            obj = getattr(net, part)
            # (Accelerate keeps DDP's inner module)
            i = next((i for i, o in enumerate(objects) if o is obj or (part == "model" and o is net.unwrapped)), None)
            if obj is None or i is not None:
                entry[part] = None if obj is None else files(part, i)
            elif unprepared is not None and (own := unprepared(name, net, part)):
                entry[part] = own
            else:
                raise CheckpointError(f"network {name!r}: its {part} was not prepared by loop.accelerator, "
                                      "so accelerator.save_state would not save it. Let the Loop prepare it "
                                      "(prepare=True), or prepare it with the same accelerator.")
        out[name] = entry
    return out


# -- tensor names: a compiled model's and its eager model's ---------------------------------

#: the attribute under which ``torch.compile``'s wrapper (``OptimizedModule``)
#: holds the model: a component of every tensor name of its ``state_dict``
#: (``_orig_mod.0.weight``; inside the name for a model compiled by regions)
COMPILED_WRAPPER = "_orig_mod"


def plain_name(key: str) -> str:
    """A tensor's name as the model has it uncompiled, as
    ``accelerator.save_model`` and ``torch.distributed.checkpoint`` name it."""
    return key if COMPILED_WRAPPER not in key else ".".join(p for p in key.split(".") if p != COMPILED_WRAPPER)


def in_model_names(state: dict, names) -> dict:
    """``state``, a checkpoint's weights under either naming (plain, as
    hookloop writes them; or a compiled model's, as hookloop up to
    0.4.0.dev0 and ``accelerator.save_state`` write them), under the names
    the model it is loaded into uses (``names``: its ``state_dict()``'s
    keys). A name with no counterpart stays as it is."""
    names = set(names)
    if all(key in names for key in state):
        return state
    by_plain = {plain_name(name): name for name in names}
    renamed = {by_plain.get(plain_name(key), key): value for key, value in state.items()}
    return renamed if len(renamed) == len(state) else state  # (two names for one tensor: left to the check)


# -- writing, as save_state does ------------------------------------------------------------


def save_state(acc, folder) -> None:
    """``accelerator.save_state(folder)`` itself (the sharded formats), with
    automatic naming off for the call (it would write elsewhere)."""
    config = acc.project_configuration
    automatic, config.automatic_checkpoint_naming = config.automatic_checkpoint_naming, False
    try:
        acc.save_state(str(folder))
    finally:
        config.automatic_checkpoint_naming = automatic


def heavy_states(acc, folder) -> list:
    """What ``save_state`` writes of the models and optimizers:
    ``[rel, kind, state, metadata]`` of this process's share (the main
    process's, as Accelerate's ``save``), after the
    ``register_save_state_pre_hook`` hooks saw the weights; the weights
    under their plain names (a compiled model's as its eager model names them)."""
    from accelerate.state import PartialState
    from accelerate.utils.other import clean_state_dict_for_safetensors

    weights = [acc.get_state_dict(model, unwrap=False) for model in acc._models]
    for hook in acc._save_model_state_pre_hook.values():
        hook(acc._models, weights, str(folder))
    state = PartialState()
    if not (state.is_local_main_process if acc.project_configuration.save_on_each_node else state.is_main_process):
        return []
    weights = [w if not any(COMPILED_WRAPPER in k for k in w) else type(w)((plain_name(k), v) for k, v in w.items())
               for w in weights]
    out = [[model_file(i), "safetensors", clean_state_dict_for_safetensors(w) if isinstance(w, OrderedDict) else w,
            {"format": "pt"}] for i, w in enumerate(weights)]  # (cleaned as accelerate.utils.save does)
    return out + [[optimizer_file(i), "torch", o.state_dict(), None] for i, o in enumerate(acc._optimizers)]


def save_small_files(acc, folder) -> None:
    """The rest of ``save_state``, byte for byte its files (schedulers,
    samplers and loader states, the scaler, this process's random states, the
    registered objects), and the save counted in ``project_configuration``."""
    from accelerate.checkpointing import save_accelerator_state, save_custom_state
    from accelerate.state import PartialState

    each_node = acc.project_configuration.save_on_each_node
    save_accelerator_state(str(folder), [], [], acc._schedulers, acc._dataloaders, PartialState().process_index,
                           acc.step, acc.scaler, save_on_each_node=each_node, safe_serialization=True)
    for i, obj in enumerate(acc._custom_objects):
        save_custom_state(obj, str(folder), i, save_on_each_node=each_node)
    acc.project_configuration.iteration += 1


# -- reading Accelerate's files --------------------------------------------------------


def torch_load(source, rel: str, where: str, what: str):
    """``torch.load(weights_only=True)`` of an opened file (read through its
    descriptor, not opened again) or bytes, as Accelerate reads its files
    (numpy's RNG types allowed). The error never suggests ``weights_only=False``."""
    import io

    from accelerate.utils import load as accelerate_load

    try:
        with io.BytesIO(source) if isinstance(source, bytes) else source.reader() as f:
            return accelerate_load(f, map_location="cpu")
    except Exception as exc:  # noqa: BLE001
        text = str(exc)
        if "weights_only" in text or "Unpickl" in type(exc).__name__ or "Weights only" in text:
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
            raise CheckpointError(f"{where}: cannot read {what} from {rel}: it is corrupt, or it holds "
                                  "objects other than tensors and plain data, which hookloop never unpickles"
                                  + (f": it refers to {found.group(1)}" if found else "")) from None
        raise CheckpointError(f"{where}: cannot read {what} from {rel}: it is corrupt "
                              f"({type(exc).__name__}: {first_line(exc)})") from None


def safetensors_load(opened, rel: str, where: str, what: str) -> tuple[dict, dict]:
    """``(tensors, metadata)`` of a safetensors file, parsed by safetensors
    from the open (checked) file's descriptor: its tensors map the file's
    pages, read when first touched."""
    from safetensors import safe_open

    try:
        with safe_open(opened.path(), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except Exception as exc:  # noqa: BLE001 - a header safetensors refuses, any dtype it does not know
        raise CheckpointError(f"{where}: cannot read {what} from {rel}: it is corrupt "
                              f"({type(exc).__name__}: {first_line(exc)})") from None


# -- putting states into Accelerate's objects, as load_state does -------------------------


def before_load(acc, path, with_models: bool) -> None:
    """The ``register_load_state_pre_hook`` hooks (given the models when
    they are loaded here, as ``load_state`` gives them)."""
    for hook in acc._load_model_state_pre_hook.values():
        hook(list(acc._models) if with_models else [], str(path))


def load_model_state(model, state: dict, strict: bool = True) -> dict:
    """``safetensors.torch.load_model`` from a state dict in memory (tied
    weights are stored once): ``{"missing", "unexpected"}`` names, which
    ``strict`` refuses."""
    from safetensors.torch import _remove_duplicate_names

    to_removes = _remove_duplicate_names(model.state_dict(), preferred_names=list(state))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = set(missing)
    for name in (n for group in to_removes.values() for n in group):
        if name in missing:
            missing.remove(name)
        else:
            unexpected.append(name)
    if strict and (missing or unexpected):
        raise RuntimeError(f"missing keys {sorted(missing)}, unexpected keys {sorted(unexpected)}")
    return {"missing": sorted(missing), "unexpected": list(unexpected)}


def load_scaler(acc, state, lazy_init: bool = False) -> None:
    acc.scaler.load_state_dict(state)
    if lazy_init:  # FSDP2 loads it before the optimizer, as Accelerate does
        acc.scaler._lazy_init_scale_growth_tracker(acc.scaler._device)


def restore_rest(acc, staged, custom: list, apply) -> None:
    """What ``load_state`` restores besides the models and optimizers:
    schedulers, the data loaders' samplers and states, the scaler, the
    registered objects (``custom``: their states) and the random states.
    ``apply(what, rel, fn)`` names the file if ``fn`` fails."""
    from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

    for i, scheduler in enumerate(acc._schedulers):
        apply("a scheduler state", scheduler_file(i), lambda o=scheduler, s=staged.schedulers[i]: o.load_state_dict(s))
    where = f"checkpoint {str(staged.path)!r}"
    mid_epoch = bool(((staged.doc or {}).get("loop") or {}).get("step_in_epoch"))
    for i, loader in enumerate(acc._dataloaders):
        rel = numbered("sampler", i)
        if (isinstance(getattr(loader, "dataset", None), IterableDatasetShard) and rel in staged.extra
                and isinstance(loader.get_sampler(), SeedableRandomSampler)):
            loader.set_sampler(torch_load(staged.extra[rel], rel, where, "a data loader's sampler"))
        rel = numbered("dl_state_dict", i)
        if not getattr(loader, "use_stateful_dataloader", False):
            continue
        if mid_epoch and rel in staged.extra:
            loader.load_state_dict(torch_load(staged.extra[rel], rel, where, "a data loader's state"))
        else:
            # Between epochs the saved state is of a finished iterator: torchdata would make one
            # from it, then a fresh one (two seeds drawn from the global random state where the
            # uninterrupted run draws one) and hand a Stateful dataset its finished position. The
            # next epoch starts afresh: ``{}`` also drops the iterator the loader made when prepared
            # (which it would reuse, drawing no seed at all).
            loader.load_state_dict({})
    if acc.scaler is not None and staged.scaler is not None:
        apply("the gradient scaler state", SCALER_FILE, lambda: load_scaler(acc, staged.scaler))
    for i, (obj, state) in enumerate(zip(acc._custom_objects, custom)):
        apply(f"registered object #{i}", custom_file(i), lambda o=obj, s=state: o.load_state_dict(s))
    source = staged.source_rank
    derive = None if source == staged.process_index else staged.process_index
    apply(f"the random states of process {staged.process_index}", rng_file(source),
          lambda: restore_rng(acc, staged.rng, derive_for=derive))


def derived_seed(states: dict, rank: int) -> int:
    """The seed of a process that a checkpoint has no random states of (it
    was written by fewer processes): a 63-bit number from the SHA-256 of the
    saved rank 0's torch RNG state and ``rank``. The same on every resume of
    that checkpoint, another for every rank, unrelated to the saved ranks' own."""
    import hashlib

    digest = hashlib.sha256(b"hookloop: random states of rank %d from rank 0's\0" % rank)
    digest.update(torch.as_tensor(states["torch_manual_seed"]).contiguous().numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little") & ((1 << 63) - 1)


def restore_rng(acc, states: dict, derive_for: int | None = None) -> None:
    """What ``load_accelerator_state`` does with ``random_states_<rank>.pkl``.
    ``derive_for``: the rank of this process, which the checkpoint has no
    states of (``states`` are rank 0's): seeded from :func:`derived_seed`."""
    if "step" in states:
        acc.step = states["step"]
    if derive_for is not None:
        seed = derived_seed(states, derive_for)
        random.seed(seed)
        np.random.seed(seed % (1 << 32))
        torch.manual_seed(seed)  # (and every CUDA device's)
        return
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    for key, value in states.items():
        match = re.fullmatch(r"torch_(\w+)_manual_seed", key)
        backend = getattr(torch, match.group(1), None) if match else None
        if backend is not None and callable(getattr(backend, "is_available", None)) and backend.is_available():
            backend.set_rng_state_all(value)
    if "xm_seed" in states:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(states["xm_seed"])
