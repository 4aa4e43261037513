"""Everything that knows Accelerate's side of a checkpoint, in one place:
the names of the files ``accelerator.save_state`` writes, the accelerator's
private lists of prepared objects (``_models``, ``_optimizers``,
``_schedulers``, ``_custom_objects``, ``_dataloaders``), the process state,
reading its files the safe way (``weights_only=True``, safetensors), and
putting staged states into its objects as ``accelerator.load_state`` would.

When Accelerate changes, this is the module to read again.
"""

from __future__ import annotations

import contextlib
import random
import re
from typing import Any

import numpy as np
import torch
from accelerate.utils import OPTIMIZER_NAME, RNG_STATE_NAME, SAFE_WEIGHTS_NAME, SCHEDULER_NAME

from .errors import CheckpointError, first_line

SCALER_FILE = "scaler.pt"
#: Accelerate's data loader files: a seedable sampler, a stateful loader's state
LOADER_FILE = re.compile(r"^(sampler|dl_state_dict)(_\d+)?\.bin$")


# -- file names ----------------------------------------------------------------------


def _numbered(stem: str, ext: str, i: int) -> str:
    return f"{stem}.{ext}" if i == 0 else f"{stem}_{i}.{ext}"


def model_file(i: int) -> str:
    """``model.safetensors``, ``model_1.safetensors`` ..."""
    return SAFE_WEIGHTS_NAME if i == 0 else SAFE_WEIGHTS_NAME.replace(".", f"_{i}.")


def legacy_model_file(i: int) -> str:
    """``pytorch_model.bin`` ... (``save_state(safe_serialization=False)``)."""
    return f"pytorch_model{'_' + str(i) if i else ''}.bin"


def optimizer_file(i: int) -> str:
    return _numbered(OPTIMIZER_NAME, "bin", i)


def scheduler_file(i: int) -> str:
    return _numbered(SCHEDULER_NAME, "bin", i)


def sampler_file(i: int) -> str:
    return _numbered("sampler", "bin", i)


def loader_state_file(i: int) -> str:
    return _numbered("dl_state_dict", "bin", i)


def custom_file(i: int) -> str:
    """The state of the i-th object given to ``register_for_checkpointing``."""
    return f"custom_checkpoint_{i}.pkl"


def rng_file(rank: int) -> str:
    """``random_states_<rank>.pkl``."""
    return f"{RNG_STATE_NAME}_{rank}.pkl"


def written_by_save_state(path) -> bool:
    """Whether a directory looks written by ``accelerator.save_state``."""
    return (path / SAFE_WEIGHTS_NAME).exists() or (path / rng_file(0)).exists()


# -- the accelerator's prepared objects, and the process state ----------------------------


def models(acc) -> list:
    return acc._models


def optimizers(acc) -> list:
    return acc._optimizers


def schedulers(acc) -> list:
    return acc._schedulers


def custom_objects(acc) -> list:
    return acc._custom_objects


def process_index() -> int:
    """This process's rank, from Accelerate's process state (0 without one)."""
    from accelerate.state import PartialState

    return PartialState._shared_state.get("process_index", 0)


def process_count() -> int:
    """The number of processes, from Accelerate's process state (1 without one)."""
    from accelerate.state import PartialState

    return PartialState._shared_state.get("num_processes", 1)


def _index(objects, obj):
    return next((i for i, o in enumerate(objects) if o is obj), None)


def scheduler_objects(acc) -> list:
    """The schedulers ``save_state`` writes as ``scheduler*.bin``, in order
    (under DeepSpeed not those its engine saves, as Accelerate filters them)."""
    kind = getattr(acc.distributed_type, "name", "")
    if kind == "MEGATRON_LM":
        return []
    if kind == "DEEPSPEED":
        return [s for s in acc._schedulers if type(s).__name__ != "DeepSpeedSchedulerWrapper"]
    return acc._schedulers


def describe_networks(loop, files=None, unprepared=None) -> dict:
    """Which of Accelerate's files holds each network's model, optimizer and
    scheduler. ``files(part, i)``: the name of the i-th prepared part's file
    (default: the plain format's); ``unprepared(name, net, part)``: the entry
    of a part Accelerate did not prepare, or None (refused)."""
    acc = loop.accelerator
    out = {}
    names = {"model": model_file, "optimizer": optimizer_file, "scheduler": scheduler_file}
    for name, net in loop.networks.items():
        entry: dict[str, Any] = {}
        for part, objects in (("model", acc._models), ("optimizer", acc._optimizers),
                              ("scheduler", scheduler_objects(acc))):
            obj = getattr(net, part)
            if obj is None:
                entry[part] = None
                continue
            i = _index(objects, obj)
            if i is None and part == "model":  # Accelerate keeps DDP's inner module
                i = _index(objects, net.unwrapped)
            if i is None and unprepared is not None and (own := unprepared(name, net, part)):
                entry[part] = own
                continue
            if i is None:
                raise CheckpointError(
                    f"network {name!r}: its {part} was not prepared by loop.accelerator, so "
                    "accelerator.save_state would not save it. Let the Loop prepare it "
                    "(prepare=True), or prepare it with the same accelerator."
                )
            entry[part] = files(part, i) if files is not None else names[part](i)
        out[name] = entry
    return out


def accelerate_counts(acc) -> dict:
    return {
        "models": len(acc._models),
        "optimizers": len(acc._optimizers),
        "schedulers": len(acc._schedulers),
        "custom_objects": len(acc._custom_objects),
    }


def class_name(obj) -> str:
    """The class of an optimizer or scheduler, unwrapped from Accelerate's."""
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler

    inner = None
    if isinstance(obj, AcceleratedOptimizer):
        inner = obj.optimizer
    elif isinstance(obj, AcceleratedScheduler):
        inner = obj.scheduler
    cls = type(inner if inner is not None else obj)
    return f"{cls.__module__}.{cls.__qualname__}"


@contextlib.contextmanager
def manual_naming(acc):
    """``save_state(dir)`` writes elsewhere when automatic naming is on: off
    for this call."""
    config = acc.project_configuration
    automatic = config.automatic_checkpoint_naming
    config.automatic_checkpoint_naming = False
    try:
        yield
    finally:
        config.automatic_checkpoint_naming = automatic


# -- reading Accelerate's files --------------------------------------------------------


def torch_load(source, rel: str, where: str, what: str):
    """``torch.load(weights_only=True)`` of a verified file (or its bytes), as
    Accelerate reads its files (numpy's RNG types allowed). The error never
    suggests ``weights_only=False``."""
    import io

    from accelerate.utils import load as accelerate_load

    try:
        return accelerate_load(io.BytesIO(source) if isinstance(source, bytes) else str(source),
                               map_location="cpu")
    except Exception as exc:  # noqa: BLE001
        text = str(exc)
        if "weights_only" in text or "Unpickl" in type(exc).__name__ or "Weights only" in text:
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
            detail = f": it refers to {found.group(1)}" if found else ""
            problem = ("it is corrupt, or it holds objects other than tensors and plain data, "
                       f"which hookloop never unpickles{detail}")
            raise CheckpointError(f"{where}: cannot read {what} from {rel}: {problem}") from None
        raise CheckpointError(f"{where}: cannot read {what} from {rel}: it is corrupt "
                              f"({type(exc).__name__}: {first_line(exc)})") from None


def safetensors_load(source, rel: str, where: str, what: str) -> dict:
    from safetensors.torch import load as load_bytes
    from safetensors.torch import load_file

    try:
        return load_bytes(source) if isinstance(source, bytes) else load_file(str(source))
    except Exception as exc:  # noqa: BLE001 - SafetensorError and friends
        raise CheckpointError(f"{where}: cannot read {what} from {rel}: it is corrupt "
                              f"({type(exc).__name__}: {first_line(exc)})") from None


# -- committing staged states, as accelerator.load_state does ----------------------------


def commit(loop, staged, custom: list, where: str, networks=None) -> None:
    """Put the staged states (a :class:`~.staging.Staged`) into the loop's
    objects, as ``accelerator.load_state`` does (same objects, same order,
    same values). ``networks(apply)``: restores the models and optimizers
    of a sharded format instead (:func:`~.formats.commit`)."""
    acc = loop.accelerator
    path = staged.path

    def apply(what, rel, fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - checked before; name the file if it still fails
            raise CheckpointError(f"{where}: restoring {what} from {rel} failed after it was "
                                  f"checked: {type(exc).__name__}: {exc}") from exc

    for hook in acc._load_model_state_pre_hook.values():
        hook(list(acc._models) if networks is None else [], str(path))
    if networks is not None:  # a sharded format's own loaders, on files verified before
        networks(apply)
    for i, model in enumerate(acc._models if networks is None else ()):
        apply(f"the weights of accelerator model #{i}", model_file(i),
              lambda m=model, s=staged.models[i]: _load_model_state(m, s))
    for i, opt in enumerate(acc._optimizers if networks is None else ()):
        apply("an optimizer state", optimizer_file(i),
              lambda o=opt, s=staged.optimizers[i]: o.load_state_dict(s))
    for i, scheduler in enumerate(scheduler_objects(acc)):
        apply("a scheduler state", scheduler_file(i),
              lambda o=scheduler, s=staged.schedulers[i]: o.load_state_dict(s))
    _commit_dataloaders(acc, staged, where)
    if acc.scaler is not None and staged.scaler is not None:
        apply("the gradient scaler state", SCALER_FILE, lambda: acc.scaler.load_state_dict(staged.scaler))
    for i, (obj, state) in enumerate(zip(acc._custom_objects, custom)):
        apply(f"registered object #{i}", custom_file(i), lambda o=obj, s=state: o.load_state_dict(s))
    source = staged.process_index if staged.source_rank is None else staged.source_rank
    derive = None if source == staged.process_index else staged.process_index
    apply(f"the random states of process {staged.process_index}", rng_file(source),
          lambda: _restore_rng(acc, staged.rng, derive_for=derive))


def _load_model_state(model, state: dict) -> None:
    """``safetensors.torch.load_model`` from a state dict in memory (tied
    weights are stored once)."""
    from safetensors.torch import _remove_duplicate_names

    to_removes = _remove_duplicate_names(model.state_dict(), preferred_names=list(state))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = set(missing)
    for group in to_removes.values():
        for name in group:
            if name in missing:
                missing.remove(name)
            else:
                unexpected.append(name)
    if missing or unexpected:
        raise RuntimeError(f"missing keys {sorted(missing)}, unexpected keys {sorted(unexpected)}")


def _commit_dataloaders(acc, staged, where: str) -> None:
    """Accelerate's sampler / stateful-loader files, where Accelerate would load them."""
    from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

    for i, dataloader in enumerate(acc._dataloaders):
        sampler_rel = sampler_file(i)
        if isinstance(getattr(dataloader, "dataset", None), IterableDatasetShard) and sampler_rel in staged.extra:
            if isinstance(dataloader.get_sampler(), SeedableRandomSampler):
                what = "a data loader's sampler"
                dataloader.set_sampler(torch_load(staged.extra[sampler_rel], sampler_rel, where, what))
        state_rel = loader_state_file(i)
        if getattr(dataloader, "use_stateful_dataloader", False) and state_rel in staged.extra:
            state = torch_load(staged.extra[state_rel], state_rel, where, "a data loader's state")
            dataloader.load_state_dict(state)


def derived_seed(states: dict, rank: int) -> int:
    """The seed of a process that a checkpoint has no random states of (it
    was written by fewer processes): a 63-bit number from the SHA-256 of
    the saved rank 0's torch RNG state and ``rank``. The same on every
    resume of that checkpoint, another for every rank, and unrelated to
    the saved ranks' own states."""
    import hashlib

    digest = hashlib.sha256(b"hookloop: random states of rank %d from rank 0's\0" % rank)
    digest.update(torch.as_tensor(states["torch_manual_seed"]).contiguous().numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little") & ((1 << 63) - 1)


def _restore_rng(acc, states: dict, derive_for: int | None = None) -> None:
    """What ``load_accelerator_state`` does with ``random_states_<rank>.pkl``.
    ``derive_for``: the rank of this process, which the checkpoint has no
    states of (``states`` are rank 0's): python, numpy and torch (every
    device) are seeded from :func:`derived_seed` instead."""
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
