"""A new run from a checkpoint's weights alone
(``Loop.load_checkpoint(path, weights_only=True)``, :func:`load_weights`).

Only every network's model is read and replaced: no optimizer, scheduler,
random states, data position, plugin state or run identity, so nothing but
the networks' names and their tensors' names and shapes has to match. It
works across any number of processes, batch sizes and run settings, from a
hookloop checkpoint (each network by name; sizes and checksums verified) or
from a folder of Accelerate's plain format (``accelerator.save_state``
without hookloop: the models by their order, ``model.safetensors``,
``model_1.safetensors`` ... or ``pytorch_model*.bin``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from . import accelerate as accel
from . import formats
from . import safe_read
from .collective import every_rank
from .compat import compare_shapes
from .errors import CheckpointError
from .finite import first_nonfinite
from .layout import STATE_FILE
from .manifest import read_manifest, verified

_SHARDED = ("FSDP", "DEEPSPEED", "MEGATRON_LM")


def load_weights(loop, path, *, staged=None) -> Path:
    """Replace every network's weights with those of checkpoint ``path``
    (every process reads them; all fail together, with nothing changed).
    ``staged``: what :func:`~.loading.find` read of ``path``, used instead
    of reading its model files again. Returns ``path``."""
    acc = loop.accelerator
    path = Path(path)
    where = f"checkpoint {str(path)!r}"
    kind = getattr(getattr(acc, "distributed_type", None), "name", "")
    if kind in _SHARDED:
        raise CheckpointError(f"{where}: load_checkpoint(weights_only=True) reads whole models, and "
                              f"this run's models are sharded ({kind}): resume it with "
                              "load_checkpoint(path) on the same number of processes instead")
    now = formats.describe_networks(loop)  # network -> {"model": its file in this run, ...}
    sharded = [name for name, entry in now.items() if str(entry["model"]).startswith(f"{formats.DCP_DIR}/")]
    if sharded:
        raise CheckpointError(f"{where}: load_checkpoint(weights_only=True) reads whole models, and "
                              f"this run's network(s) {', '.join(map(repr, sharded))} are sharded "
                              "(fully_shard): resume with load_checkpoint(path) on the same number of "
                              "processes instead")
    index = {accel.model_file(i): i for i in range(len(accel.models(acc)))}
    states = {}
    with every_rank(acc):  # every process fails together, none waits
        if not os.path.lexists(path / STATE_FILE) and _plain(path):
            read = _read_plain(path, where, {name: index[entry["model"]] for name, entry in now.items()})
        else:
            read = _read_hookloop(path, where, now, staged)
        for name, state in read.items():
            model = accel.models(acc)[index[now[name]["model"]]]
            compare_shapes({k: tuple(v.shape) for k, v in state.items()}, model.state_dict(), name, where)
            floating = [(k, t) for k, t in state.items()
                        if isinstance(t, torch.Tensor) and t.is_floating_point()]
            bad = first_nonfinite(t for _, t in floating)
            if bad is not None:
                key, t = floating[bad]
                flat = t.reshape(-1)
                raise CheckpointError(
                    f"{where}: the weights of network {name!r} are not finite (tensor {key!r}: "
                    f"{flat[~flat.isfinite()][0].item()})"
                )
            states[name] = (model, state)
    for name, (model, state) in states.items():
        try:
            accel._load_model_state(model, state)
        except Exception as exc:  # noqa: BLE001 - checked before; name the network if it still fails
            raise CheckpointError(f"{where}: restoring the weights of network {name!r} failed after "
                                  f"they were checked: {type(exc).__name__}: {exc}") from exc
    return path


def _plain(path: Path) -> bool:
    """Whether ``path`` looks like a folder of ``accelerator.save_state``."""
    names = (accel.model_file(0), accel.legacy_model_file(0))
    return path.is_dir() and any((path / name).exists() for name in names)


def _read_hookloop(path: Path, where: str, now: dict, staged) -> dict:
    """Each network's weights from a hookloop checkpoint, by network name."""
    doc = read_manifest(path)  # (every file there with its size; the manifest's own checksum)
    saved = doc["networks"]
    if not isinstance(saved, dict) or sorted(saved) != sorted(now):
        names = sorted(saved) if isinstance(saved, dict) else saved
        raise CheckpointError(f"{where} holds the weights of networks {names}; this loop has "
                              f"{sorted(now)}: load_checkpoint(weights_only=True) loads every "
                              "network by its name")
    use_staged = staged is not None and os.path.realpath(staged.path) == os.path.realpath(path)
    out = {}
    for name in now:
        rel = (saved[name] or {}).get("model") if isinstance(saved[name], dict) else None
        count = (doc.get("accelerate") or {}).get("models", 0)
        i = next((i for i in range(count) if rel == accel.model_file(i)), None)
        if rel is None or i is None:
            raise CheckpointError(f"{where}: network {name!r} has no weights in it")
        what = f"the weights of network {name!r}"
        if use_staged:
            out[name] = staged.models[i]
        elif rel not in doc["files"] and accel.legacy_model_file(i) in doc["files"]:
            rel = accel.legacy_model_file(i)
            with verified(path, rel, doc, where, what) as opened:
                out[name] = accel.torch_load(opened.source(), rel, where, what)
        else:
            with verified(path, rel, doc, where, what) as opened:
                out[name] = accel.safetensors_load(opened.source(), rel, where, what)
    return out


def _read_plain(path: Path, where: str, mine: dict) -> dict:
    """Each network's weights from Accelerate's plain format, by the order
    in which the models were prepared (``mine``: network -> its model's
    index; ``model.safetensors`` is the first)."""
    safe_read.check_folder(path)
    files = {p.name for p in path.iterdir()}
    held = [i for i in range(len(files) + 1)
            if accel.model_file(i) in files or accel.legacy_model_file(i) in files]
    if sorted(held) != sorted(mine.values()):
        raise CheckpointError(
            f"{where} (written by accelerator.save_state) holds {len(held)} model(s) "
            f"({', '.join(_name(path, i) for i in held) or 'none'}); this loop has {len(mine)} "
            f"({', '.join(f'{n!r}' for n in mine)}): their weights are matched by the order in which "
            "the models were prepared"
        )
    out = {}
    for name, i in mine.items():
        rel = _name(path, i)
        what = f"the weights of network {name!r}"
        size = safe_read.file_size(path / rel, path, what)
        with safe_read.open_checked(path / rel, path, limit=size, what=what) as opened:
            loader = accel.safetensors_load if rel.endswith(".safetensors") else accel.torch_load
            out[name] = loader(opened.source(), rel, where, what)
    return out


def _name(path: Path, i: int) -> str:
    rel = accel.model_file(i)
    return rel if (path / rel).exists() else accel.legacy_model_file(i)
