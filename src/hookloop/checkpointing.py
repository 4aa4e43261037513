"""Checkpoints: what one contains, and how it is written, found and read back.

A checkpoint is one directory written by :func:`save`, inside a checkpoint
root (``Checkpoint(dir=...)``; default ``<accelerator.project_dir or the
working directory>/checkpoints``)::

    checkpoints/
      latest                       the name of the newest complete checkpoint
      step-00000040/               a checkpoint after global step 40
      step-00000048-epoch-end/     after step 48 and its epoch's end (eval done)
      .tmp-step-00000056/          a save in progress, or killed: ignored, removed

Inside one, everything Accelerate's ``accelerator.save_state`` writes, plus
hookloop's own state as data (JSON and safetensors, never a pickle)::

    model.safetensors, model_1.safetensors ...   every prepared model (Accelerate)
    optimizer.bin, optimizer_1.bin ...           every optimizer's state_dict (Accelerate)
    scheduler.bin ...                            every scheduler's state_dict (Accelerate)
    random_states_<rank>.pkl                     each process's python, numpy, torch
                                                 (and CUDA) RNG, and the accumulation
                                                 step counter (Accelerate)
    hookloop-rank<rank>.safetensors              each process's RNG and data-loader
                                                 generator states at the start of the
                                                 current epoch (to redraw its shuffle)
    hookloop.safetensors                         the tensors in plugin states
    hookloop.json                                written last: the loop position, which
                                                 network is which file, each stateful
                                                 plugin's state, and the size of every
                                                 other file (a truncated copy is refused)

Accelerate loads ``optimizer.bin``, ``scheduler.bin`` and ``random_states``
with ``torch.load(weights_only=True)``. hookloop does not hand its own state
to ``accelerator.register_for_checkpointing``: Accelerate would write it with
``torch.save`` and read it back with ``weights_only=False`` (a pickle: code
execution from a tampered checkpoint).

Writes are atomic: a save goes into ``.tmp-<name>`` in the same root, every
file is fsync'ed, the directory is renamed into place, and only then is
``latest`` replaced (write, fsync, ``os.replace``). A save killed at any
point leaves the previous checkpoint intact and ``latest`` naming a complete
one.

Plugin state protocol: every registered plugin with both ``state_dict()`` and
``load_state_dict(state)`` is saved under its plugin name. ``state_dict()``
returns data: dicts, lists, tuples, str, int, float, bool, None, tensors and
numpy arrays (tensors come back on the CPU; tuples come back as tuples).
``load_state_dict`` is called after the networks are restored and before
``on_fit_start``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import OPTIMIZER_NAME, RNG_STATE_NAME, SAFE_WEIGHTS_NAME, SCHEDULER_NAME

FORMAT = "hookloop-checkpoint"
VERSION = 1
STATE_FILE = "hookloop.json"
TENSORS_FILE = "hookloop.safetensors"
RANK_FILE = "hookloop-rank{rank}.safetensors"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
_NAME = re.compile(r"^step-(\d+)(-epoch-end)?$")


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read back: the message names the
    directory and the culprit (a file, a network's tensor, a plugin)."""


# ---------------------------------------------------------------------------
# names and places
# ---------------------------------------------------------------------------


def default_directory(accelerator) -> Path:
    """``<accelerator.project_dir>/checkpoints``, or ``./checkpoints``."""
    return Path(accelerator.project_dir or os.getcwd()) / "checkpoints"


def checkpoint_name(global_step: int, epoch_end: bool = False) -> str:
    return f"step-{global_step:08d}" + ("-epoch-end" if epoch_end else "")


def _sort_key(path: Path):
    match = _NAME.match(path.name)
    return (int(match.group(1)), bool(match.group(2)))


def list_checkpoints(root) -> list[Path]:
    """The checkpoint directories in ``root``, oldest first (by step, an
    epoch-end one after the mid-epoch one of the same step). Not validated."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir()]
    return sorted(found, key=_sort_key)


def read_latest(root) -> str | None:
    try:
        name = (Path(root) / LATEST).read_text(encoding="utf-8").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return name or None


def resolve(resume_from, root) -> Path | None:
    """The checkpoint directory ``resume_from`` names.

    ``"latest"``: the checkpoint ``root/latest`` names; if it is missing or
    unusable, the newest usable one in ``root`` (with a warning); ``None`` if
    nothing was ever saved there (a first run). A checkpoint root given as a
    path resolves the same way, except that finding nothing is an error. Any
    other path is returned as it is (:func:`read_manifest` checks it).
    """
    lenient = resume_from == "latest"
    if lenient:
        root = Path(root)
    else:
        path = Path(os.fspath(resume_from)).expanduser()
        looks_like_root = (
            path.is_dir() and not (path / STATE_FILE).exists()
            and ((path / LATEST).exists() or list_checkpoints(path))
        )
        if not looks_like_root:
            return path
        root = path
    name = read_latest(root)
    if name is not None:
        candidate = root / name
        try:
            read_manifest(candidate)
            return candidate
        except CheckpointError as exc:
            warnings.warn(
                f"hookloop: {root / LATEST} names {name!r}, which is not usable ({exc}); "
                "resuming from the newest usable checkpoint instead",
                RuntimeWarning,
                stacklevel=3,
            )
    candidates = list_checkpoints(root)
    for candidate in reversed(candidates):
        try:
            read_manifest(candidate)
            return candidate
        except CheckpointError:
            continue
    if lenient and name is None and not candidates:
        return None
    raise CheckpointError(
        f"resume_from={str(resume_from)!r}: no usable checkpoint in {root} "
        f"(found {', '.join(p.name for p in candidates) or 'none'})"
    )


def clean(root) -> None:
    """Remove what killed saves and rotations left behind (``.tmp-*``,
    ``.trash-*``). Main process only."""
    root = Path(root)
    if not root.is_dir():
        return
    for path in root.iterdir():
        if path.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(path, ignore_errors=True)
        elif path.name.startswith(LATEST + ".tmp"):
            with contextlib.suppress(OSError):
                path.unlink()


def check_writable(root) -> None:
    """Create ``root`` and write (then remove) a probe file, or raise
    :class:`CheckpointError` naming the directory and the reason."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f"{TMP_PREFIX}probe-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"hookloop")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(
            f"cannot write checkpoints to {str(root)!r}: {type(exc).__name__}: {exc}. "
            "Pass Checkpoint(dir=...) a directory this process can write."
        ) from exc


# ---------------------------------------------------------------------------
# reading and checking a checkpoint
# ---------------------------------------------------------------------------


def read_manifest(path) -> dict:
    """``hookloop.json`` of a complete checkpoint, after checking that every
    file it lists exists with the size it was written with. Raises
    :class:`CheckpointError` for a missing, foreign, truncated or unfinished
    directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} is a file, not a checkpoint directory")
    state_file = path / STATE_FILE
    if not state_file.is_file():
        if path.name.startswith(TMP_PREFIX):
            why = "it is a save that never finished (a temporary directory)"
        elif (path / SAFE_WEIGHTS_NAME).exists() or (path / f"{RNG_STATE_NAME}_0.pkl").exists():
            why = ("it looks written by accelerator.save_state without hookloop; "
                   "load it with accelerator.load_state")
        else:
            entries = sorted(p.name for p in path.iterdir())
            shown = ", ".join(entries[:6]) + (" ..." if len(entries) > 6 else "")
            why = f"it contains: {shown or 'nothing'}"
        raise CheckpointError(
            f"{str(path)!r} is not a hookloop checkpoint: it has no {STATE_FILE} ({why})"
        )
    try:
        doc = json.loads(state_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {STATE_FILE} is not valid JSON ({exc}): "
            "the checkpoint is truncated or corrupt"
        ) from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(
            f"{str(path)!r} is not a hookloop checkpoint: {STATE_FILE} has no "
            f"'format': {FORMAT!r}"
        )
    if not isinstance(doc.get("version"), int) or doc["version"] > VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format version {doc.get('version')!r}; this "
            f"hookloop reads version {VERSION} and older: upgrade hookloop"
        )
    for key in ("loop", "networks", "accelerate", "plugins", "files", "num_processes"):
        if key not in doc:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: {STATE_FILE} lacks {key!r}: the checkpoint is corrupt"
            )
    for rel, size in doc["files"].items():
        file = path / rel
        if not file.is_file():
            raise CheckpointError(
                f"checkpoint {str(path)!r}: {rel} is missing: the checkpoint is incomplete"
            )
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: {rel} is {actual} bytes but {size} were "
                "written: the checkpoint is truncated or corrupt"
            )
    return doc


def _check_compatible(loop, path: Path, doc: dict, strict: bool) -> list[str]:
    """Everything that must match before anything is loaded; returns the
    warnings to give (non-strict plugin mismatches)."""
    acc = loop.accelerator
    where = f"checkpoint {str(path)!r}"
    if doc["num_processes"] != acc.num_processes:
        raise CheckpointError(
            f"{where} was written by {doc['num_processes']} process(es); this run has "
            f"{acc.num_processes}. The data position and the per-process random states "
            "only mean the same thing with the same number of processes."
        )
    saved_nets = doc["networks"]
    if list(saved_nets) != list(loop.networks):
        raise CheckpointError(
            f"{where} holds networks {list(saved_nets)}; this loop has {list(loop.networks)}"
        )
    now = _describe_networks(loop)
    for name, entry in now.items():
        for part in ("model", "optimizer", "scheduler"):
            if (entry[part] is None) != (saved_nets[name].get(part) is None):
                here, there = ("the checkpoint", "this loop") if entry[part] is None else (
                    "this loop", "the checkpoint")
                raise CheckpointError(
                    f"{where}: network {name!r} has a {part} in {here} but not in {there}"
                )
    counts = _accelerate_counts(acc)
    if counts != doc["accelerate"]:
        raise CheckpointError(
            f"{where} was written with {doc['accelerate']} objects prepared on the "
            f"accelerator; this run has {counts}"
        )
    owner = {entry["model"]: name for name, entry in now.items()}
    for index, model in enumerate(acc._models):
        file = _model_file(index)
        _check_shapes(path / file, model, owner.get(file, f"accelerator model #{index}"), where)

    messages = []
    saved = set(doc["plugins"])
    current = dict(stateful_plugins(loop))
    only_saved = sorted(saved - set(current))
    only_now = sorted(set(current) - saved)
    if only_saved:
        msg = (
            f"{where} holds the state of plugin(s) {', '.join(map(repr, only_saved))}, which "
            f"this loop does not run (stateful plugins now: {', '.join(map(repr, current)) or 'none'})"
        )
        if strict:
            raise CheckpointError(msg + ": add them, or pass strict=False to drop their state")
        messages.append(msg + ": their state is not restored")
    if only_now:
        msg = (
            f"plugin(s) {', '.join(map(repr, only_now))} have state (state_dict/load_state_dict) "
            f"but {where} has none for them (it was written without them)"
        )
        if strict:
            raise CheckpointError(msg + ": pass strict=False to start them fresh")
        messages.append(msg + ": they start fresh")
    return messages


def _check_shapes(file: Path, model, network: str, where: str) -> None:
    """Compare a saved model's tensor names and shapes with the model's,
    reading only the safetensors header."""
    from safetensors import safe_open

    expected = model.state_dict()
    try:
        with safe_open(str(file), framework="pt") as f:
            saved = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as exc:  # noqa: BLE001 - any unreadable header means corrupt
        raise CheckpointError(f"{where}: cannot read {file.name}: {exc}") from exc

    def show(key):
        return key[len("module."):] if key.startswith("module.") else key

    for key, shape in saved.items():
        if key not in expected:
            raise CheckpointError(
                f"{where}: network {network!r} has a tensor {show(key)!r} (shape {list(shape)}) "
                "in the checkpoint that this model does not have: a model of another architecture?"
            )
        if tuple(expected[key].shape) != shape:
            raise CheckpointError(
                f"{where}: network {network!r} tensor {show(key)!r} has shape {list(shape)} in "
                f"the checkpoint but {list(expected[key].shape)} in this model"
            )
    saved_ptrs = {expected[k].data_ptr() for k in saved}
    for key, tensor in expected.items():
        # safetensors drops the second name of a tied (shared) tensor
        if key not in saved and tensor.data_ptr() not in saved_ptrs:
            raise CheckpointError(
                f"{where}: network {network!r} tensor {show(key)!r} is not in the checkpoint: "
                "a model of another architecture?"
            )


# ---------------------------------------------------------------------------
# what is saved besides Accelerate's files
# ---------------------------------------------------------------------------


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


def _model_file(i):
    return SAFE_WEIGHTS_NAME if i == 0 else SAFE_WEIGHTS_NAME.replace(".", f"_{i}.")


def _index(objects, obj):
    return next((i for i, o in enumerate(objects) if o is obj), None)


def _describe_networks(loop) -> dict:
    """Which of Accelerate's files holds each network's model, optimizer and
    scheduler."""
    acc = loop.accelerator
    out = {}
    for name, net in loop.networks.items():
        entry = {}
        for part, objects, stem in (
            ("model", acc._models, None),
            ("optimizer", acc._optimizers, OPTIMIZER_NAME),
            ("scheduler", acc._schedulers, SCHEDULER_NAME),
        ):
            obj = getattr(net, part)
            if obj is None:
                entry[part] = None
                continue
            i = _index(objects, obj)
            if i is None and part == "model":  # Accelerate keeps DDP's inner module
                i = _index(objects, net.unwrapped)
            if i is None:
                raise CheckpointError(
                    f"network {name!r}: its {part} was not prepared by loop.accelerator, so "
                    "accelerator.save_state would not save it. Let the Loop prepare it "
                    "(prepare=True), or prepare it with the same accelerator."
                )
            entry[part] = _model_file(i) if stem is None else (
                f"{stem}.bin" if i == 0 else f"{stem}_{i}.bin"
            )
        out[name] = entry
    return out


def _accelerate_counts(acc) -> dict:
    return {
        "models": len(acc._models),
        "optimizers": len(acc._optimizers),
        "schedulers": len(acc._schedulers),
        "custom_objects": len(acc._custom_objects),
    }


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


# ---------------------------------------------------------------------------
# random states: what a resumed epoch needs to redraw the same shuffle
# ---------------------------------------------------------------------------


def capture_rng() -> dict:
    """The global python, numpy, torch (and initialised CUDA) RNG states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def data_generators(data) -> dict:
    """The ``torch.Generator`` objects a dataloader draws its shuffle and
    worker seeds from, by attribute path (each object once)."""
    found: dict = {}

    def add(path, gen):
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found.values()):
            found[path] = gen

    add("synchronized_generator", getattr(data, "synchronized_generator", None))
    add("generator", getattr(data, "generator", None))
    for path in ("sampler", "batch_sampler", "batch_sampler.sampler",
                 "batch_sampler.batch_sampler", "batch_sampler.batch_sampler.sampler", "dataset"):
        obj = data
        for part in path.split("."):
            obj = getattr(obj, part, None)
        add(path + ".generator", getattr(obj, "generator", None))
    return found


def capture_epoch(data) -> dict:
    """What an epoch's iterator starts from: the global RNG and the data
    generators, taken just before the iterator is created."""
    return {
        "rng": capture_rng(),
        "generators": {p: g.get_state() for p, g in data_generators(data).items()},
    }


def _restore_generators(data, states: dict) -> None:
    current = data_generators(data)
    for path, state in states.items():
        if path in current:  # one created lazily later (seedable sampler) is reseeded anyway
            current[path].set_state(state)


@dataclass
class Resume:
    """How to continue a run: the RNG states to put back, and when.

    ``epoch_start`` is what the interrupted epoch's iterator started from
    (None: unknown); ``rng`` is the global RNG when the run stopped;
    ``generators`` the data generators then (from a checkpoint only)."""

    epoch_start: dict | None
    rng: dict
    generators: dict | None = None
    path: Path | None = None

    def restore_now(self, data) -> None:
        """Put the RNG where the run stopped (at an epoch boundary)."""
        restore_rng(self.rng)
        if self.generators:
            _restore_generators(data, self.generators)

    def batches(self, accelerator, data, skip: int):
        """The rest of the interrupted epoch: the same batches in the same
        order, without loading the ``skip`` seen ones, and the RNG where
        the run stopped when the first of them comes out."""
        batches = _skip(accelerator, data, skip)
        if self.epoch_start is None:
            self.restore_now(data)
            return batches
        # redraw the epoch's shuffle: start the iterator from the epoch's RNG
        restore_rng(self.epoch_start["rng"])
        _restore_generators(data, self.epoch_start["generators"])
        it = iter(batches)
        first = next(it, _END)
        restore_rng(self.rng)
        return it if first is _END else itertools.chain([first], it)


_END = object()


def _skip(accelerator, data, skip):
    """``accelerator.skip_first_batches``, which needs a batch sampler; a
    map-style loader without one (``batch_size=None``) has its first
    ``skip`` batches drawn and dropped instead."""
    from torch.utils.data import IterableDataset

    if getattr(data, "batch_sampler", None) is None and not isinstance(
        getattr(data, "dataset", None), IterableDataset
    ):
        return itertools.islice(iter(data), skip, None)
    return accelerator.skip_first_batches(data, skip)


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


def _write_rank_file(file: Path, loop) -> None:
    """This process's epoch-start RNG and its data generators now."""
    from safetensors.torch import save_file

    tensors: dict = {}
    meta = {"format": FORMAT}
    epoch = loop._epoch_rng
    if epoch is not None:
        _rng_tensors("epoch", epoch["rng"], tensors, meta)
        for path, state in epoch["generators"].items():
            tensors[f"epoch.gen.{path}"] = state.clone()
    if loop.train_data is not None:
        for path, gen in data_generators(loop.train_data).items():
            tensors[f"now.gen.{path}"] = gen.get_state()
    save_file(tensors, str(file), metadata=meta)


def _read_rank_file(file: Path, where: str):
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{where}: cannot read {file.name}: {exc}") from exc
    epoch = None
    if "epoch.torch" in tensors:
        epoch = {
            "rng": _rng_from_tensors("epoch", tensors, meta),
            "generators": {k[len("epoch.gen."):]: v for k, v in tensors.items()
                           if k.startswith("epoch.gen.")},
        }
    now = {k[len("now.gen."):]: v for k, v in tensors.items() if k.startswith("now.gen.")}
    return epoch, now


# ---------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------


def save(loop, root, *, reason: str, epoch_end: bool = False, name: str | None = None,
         update_latest: bool = True, keep_last: int | None = None) -> Path:
    """Write a checkpoint of ``loop`` into ``root`` atomically; every process
    must call this (each writes its random states). Returns its directory.

    :param epoch_end: the loop is in ``on_epoch_end``, after the epoch's
        evaluation: record the position as the start of the next epoch, so
        that a resumed run does not evaluate this epoch again.
    :param name: default ``step-<global_step>`` (``-epoch-end``).
    :param update_latest: point ``root/latest`` at it (False for emergency
        checkpoints, which may be taken in the middle of a step).
    :param keep_last: afterwards, delete all but the newest ``keep_last``
        regular checkpoints (never the one ``latest`` names).
    """
    acc = loop.accelerator
    root = Path(root)
    position = loop.state.state_dict()
    if epoch_end:
        position.update(epoch=position["epoch"] + 1, step_in_epoch=0)
    name = name or checkpoint_name(position["global_step"], epoch_end)
    final = root / name
    tmp = root / f"{TMP_PREFIX}{name}"
    networks = _describe_networks(loop)
    states = {n: p.state_dict() for n, p in stateful_plugins(loop)}  # every rank: may be collective
    main = acc.is_main_process

    error = None
    plugins, tensors = {}, {}
    if main:
        try:  # refuse state that is not data before anything is written
            plugins = {n: to_data(s, tensors, f"plugins/{n}", f"plugin {n!r}: state_dict()")
                       for n, s in states.items()}
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except CheckpointError as exc:
            error = str(exc)
        except OSError as exc:
            error = f"cannot create {tmp}: {type(exc).__name__}: {exc}"
    _all_ok(acc, error)

    try:
        error = None
        try:
            with _manual_naming(acc):
                acc.save_state(str(tmp))
            _write_rank_file(tmp / RANK_FILE.format(rank=acc.process_index), loop)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = f"process {acc.process_index} could not write into {tmp}: {type(exc).__name__}: {exc}"
        _all_ok(acc, error)

        if main:
            try:
                _finish(loop, tmp, final, position, networks, plugins, tensors, reason)
                if update_latest:
                    _point_latest(root, name)
                if keep_last:
                    _rotate(root, keep_last)
            except Exception as exc:  # noqa: BLE001
                error = f"cannot finish checkpoint {final}: {type(exc).__name__}: {exc}"
        _all_ok(acc, error)
    except CheckpointError:
        if main:  # a failed save leaves nothing behind; the previous checkpoint stays latest
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _finish(loop, tmp: Path, final: Path, position, networks, plugins, tensors, reason) -> None:
    """Main process: hookloop's files, fsync, rename into place."""
    from safetensors.torch import save_file

    import accelerate

    from . import __version__

    save_file(tensors, str(tmp / TENSORS_FILE), metadata={"format": FORMAT})
    files = {}
    for file in sorted(tmp.rglob("*")):
        if file.is_file():
            _fsync_file(file)
            files[file.relative_to(tmp).as_posix()] = file.stat().st_size
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "reason": reason,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": {"hookloop": __version__, "torch": torch.__version__,
                     "accelerate": accelerate.__version__},
        "num_processes": loop.accelerator.num_processes,
        "loop": position,
        "networks": networks,
        "accelerate": _accelerate_counts(loop.accelerator),
        "plugins": plugins,
        "files": files,
    }
    with open(tmp / STATE_FILE, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    _publish(tmp, final)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished save into place (replacing one of the same name:
    moved aside first, since a directory cannot be renamed over a full one)."""
    trash = None
    if final.exists():
        trash = final.with_name(f"{TRASH_PREFIX}{final.name}-{os.getpid()}")
        os.rename(final, trash)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def _point_latest(root: Path, name: str) -> None:
    tmp = root / f"{LATEST}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def _rotate(root: Path, keep_last: int) -> None:
    keep = read_latest(root)
    regular = list_checkpoints(root)
    for path in regular[: max(0, len(regular) - keep_last)]:
        if path.name == keep:
            continue
        # rename first: a kill during rmtree must not leave a valid name on a
        # half-deleted directory
        trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{os.getpid()}")
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems refuse fsync on a directory
        _fsync_file(path)


def _all_ok(acc, error: str | None) -> None:
    """A barrier that also tells every rank whether any failed, so that all
    raise together instead of some waiting forever."""
    if acc.num_processes > 1:
        from accelerate.utils import gather_object

        errors = [e for e in gather_object([error]) if e]
        error = errors[0] if errors else None
    if error:
        raise CheckpointError(error)


@contextlib.contextmanager
def _manual_naming(acc):
    """``save_state(dir)`` writes elsewhere when automatic naming is on: off
    for this call."""
    config = acc.project_configuration
    automatic = config.automatic_checkpoint_naming
    config.automatic_checkpoint_naming = False
    try:
        yield
    finally:
        config.automatic_checkpoint_naming = automatic


# ---------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------


def load(loop, path, *, strict: bool = True) -> Resume:
    """Restore ``loop`` from the checkpoint at ``path`` (every process).

    Everything is checked before anything is changed: a missing, foreign or
    truncated directory, another number of processes, other networks or
    tensor shapes, another set of stateful plugins (``strict=False``: a
    warning naming them) all raise :class:`CheckpointError` with the loop
    untouched. Returns how to continue (used by :meth:`Loop.fit`).
    """
    from accelerate.utils import load as accelerate_load

    acc = loop.accelerator
    path = Path(path)
    doc = read_manifest(path)
    where = f"checkpoint {str(path)!r}"
    messages = _check_compatible(loop, path, doc, strict)
    if doc["loop"].get("step_in_epoch") and getattr(loop.train_data, "use_stateful_dataloader", False):
        raise CheckpointError(
            f"{where} stops in the middle of an epoch, and train_data is a stateful data loader "
            "(use_stateful_dataloader=True), which hookloop does not resume mid-epoch: use a "
            "plain DataLoader (hookloop redraws its order and skips the seen batches)"
        )
    rng_file = path / f"{RNG_STATE_NAME}_{acc.process_index}.pkl"
    try:
        # as Accelerate reads it (weights_only=True); it would only log a
        # failure at INFO level and carry on with other random numbers
        saved_rng = accelerate_load(rng_file)
        saved_torch = saved_rng["torch_manual_seed"]
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(
            f"{where}: cannot read the random states of process {acc.process_index} "
            f"from {rng_file.name}: {type(exc).__name__}: {exc}"
        ) from exc
    epoch_start, generators = _read_rank_file(path / RANK_FILE.format(rank=acc.process_index), where)
    tensors = {}
    if (path / TENSORS_FILE).exists():
        from safetensors.torch import load_file

        tensors = load_file(str(path / TENSORS_FILE))
    plugin_states = {n: from_data(s, tensors) for n, s in doc["plugins"].items()}

    acc.load_state(str(path))
    if not torch.equal(torch.get_rng_state(), saved_torch):
        raise CheckpointError(f"{where}: Accelerate did not restore the random states of "
                              f"process {acc.process_index} from {rng_file.name}")
    rng = capture_rng()
    loop.state.load_state_dict(doc["loop"])
    current = dict(stateful_plugins(loop))
    for name, state in plugin_states.items():
        if name not in current:
            continue
        try:
            current[name].load_state_dict(state)
        except Exception as exc:
            raise CheckpointError(
                f"{where}: plugin {name!r} could not load its state: {type(exc).__name__}: {exc}"
            ) from exc
    for message in messages:
        warnings.warn(f"hookloop: {message}", RuntimeWarning, stacklevel=3)
    return Resume(epoch_start=epoch_start, rng=rng, generators=generators, path=path)


__all__ = [
    "CheckpointError",
    "Resume",
    "check_writable",
    "checkpoint_name",
    "clean",
    "default_directory",
    "list_checkpoints",
    "load",
    "read_latest",
    "read_manifest",
    "resolve",
    "save",
    "stateful_plugins",
]
