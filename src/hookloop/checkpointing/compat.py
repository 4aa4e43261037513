"""May this checkpoint be loaded into this loop? Everything that must match
before anything is read in full: the number of processes, the networks and
their tensor shapes, the optimizer and scheduler classes, the objects
prepared on the accelerator, the run settings that decide the data order and
the step count (:func:`run_settings`), and the stateful plugins.
"""

from __future__ import annotations

from pathlib import Path

from ..batches import length_of, loader_batch_size
from . import accelerate as accel
from . import safe_read
from .codec import stateful_plugins
from .errors import CheckpointError

#: what each recorded run setting decides (shown when a resume differs)
SETTINGS = {
    "gradient_accumulation_steps": "an update would average another number of batches, and "
                                   "global_step would count other updates",
    "batches_per_epoch": "the epoch would have another length, and the data position another meaning",
    "batch_size": "the batches, their order and the step count would differ",
    "dataset_length": "the shuffle would be drawn over other examples",
    "sampler": "the data would be drawn in another order",
    "drop_last": "the epoch would have another length",
    "use_seedable_sampler": "the shuffle would be drawn from another generator",
    "data_seed": "the shuffle would be drawn from another seed",
    "split_batches": "the batches would be split differently between processes",
    "even_batches": "the last batches would be shared out differently between processes",
    "dispatch_batches": "the batches would be read and shared out differently between processes",
}


def run_settings(loop) -> dict:
    """What decides the data order and the step count of ``loop``'s run, as
    recorded in every checkpoint (``settings``) and compared on resume.
    None: unknown (not compared)."""
    acc = loop.accelerator
    data = loop.train_data
    config = getattr(acc, "dataloader_config", None)
    out = {
        "num_processes": acc.num_processes,
        # as the Loop was built: a plugin may change it during a run (an
        # accumulation schedule), and a resume is compared before any fit starts
        "gradient_accumulation_steps": getattr(loop, "configured_accumulation",
                                               acc.gradient_accumulation_steps),
        "batches_per_epoch": length_of(data),
        "batch_size": loader_batch_size(data),
        "dataset_length": length_of(getattr(data, "dataset", None)),
        "sampler": _sampler_name(data),
        "drop_last": getattr(data, "drop_last", None),
    }
    for key in ("use_seedable_sampler", "data_seed", "split_batches", "even_batches", "dispatch_batches"):
        value = getattr(config, key, None)
        out[key] = value if isinstance(value, (bool, int, str)) else None
    return out


def _sampler_name(data):
    """The class of the innermost sampler under a (prepared) loader's batch
    samplers. Never truth-tests a sampler: a stream's has no length."""
    if data is None:
        return None
    obj = _first_of(data, "batch_sampler", "sampler")
    for _ in range(6):
        inner = _first_of(obj, "batch_sampler", "sampler")
        if inner is None:
            break
        obj = inner
    return type(obj).__name__ if obj is not None else None


def _first_of(obj, *names):
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None


def check_compatible(loop, path: Path, doc: dict, strict: bool) -> list[str]:
    """Everything that must match before anything is loaded; returns the
    warnings to give (non-strict plugin mismatches)."""
    where = f"checkpoint {str(path)!r}"
    _check_networks(loop, path, doc, where)
    return _check_settings(loop, doc, where, strict) + _check_plugins(loop, doc, where, strict)


def _check_networks(loop, path: Path, doc: dict, where: str) -> None:
    acc = loop.accelerator
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
    now = accel.describe_networks(loop)
    for name, entry in now.items():
        for part in ("model", "optimizer", "scheduler"):
            if (entry[part] is None) != (saved_nets[name].get(part) is None):
                here, there = ("the checkpoint", "this loop") if entry[part] is None else (
                    "this loop", "the checkpoint")
                raise CheckpointError(
                    f"{where}: network {name!r} has a {part} in {here} but not in {there}"
                )
    counts = accel.accelerate_counts(acc)
    if counts != doc["accelerate"]:
        raise CheckpointError(
            f"{where} was written with {doc['accelerate']} objects prepared on the "
            f"accelerator; this run has {counts}"
        )
    classes = doc.get("classes") or {}
    for name, net in loop.networks.items():
        for part in ("optimizer", "scheduler"):
            file = now[name][part]
            if file is None or file not in classes:
                continue
            current = accel.class_name(getattr(net, part))
            if classes[file] != current:
                raise CheckpointError(
                    f"{where}: network {name!r}: {file} holds the state of a "
                    f"{_short(classes[file])} {part} ({classes[file]}), but this network's {part} is "
                    f"a {_short(current)} ({current}): the state of one does not fit the other. "
                    f"Resume with the {part} the checkpoint was written with"
                )
    owner = {entry["model"]: name for name, entry in now.items()}
    for index, model in enumerate(accel.models(acc)):
        file = accel.model_file(index)
        _check_shapes(path / file, model, owner.get(file, f"accelerator model #{index}"), where,
                      (doc.get("files") or {}).get(file))


def _check_settings(loop, doc: dict, where: str, strict: bool) -> list[str]:
    saved_settings = doc.get("settings") or {}
    current_settings = run_settings(loop)
    differ = []
    for key, was in saved_settings.items():
        now_value = current_settings.get(key)
        if key == "num_processes" or was is None or now_value is None or was == now_value:
            continue
        differ.append(f"{key}={was!r} (this run has {key}={now_value!r}: "
                      f"{SETTINGS.get(key, 'the data order or the step count would differ')})")
    if not differ:
        return []
    msg = (f"{where} was written with other settings than this run's, which decide the data "
           f"order and the step count: {'; '.join(differ)}")
    if strict:
        raise CheckpointError(msg + ". The resumed run would not continue the saved one; pass "
                              "strict=False to resume anyway (with a warning)")
    return [msg + ". Resuming anyway (strict=False)"]


def _check_plugins(loop, doc: dict, where: str, strict: bool) -> list[str]:
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


def _short(qualified: str) -> str:
    return qualified.rsplit(".", 1)[-1]


def _check_shapes(file: Path, model, network: str, where: str, size: int | None = None) -> None:
    """Compare a saved model's tensor names and shapes with the model's,
    reading only the safetensors header (``size``: the file's size as the
    manifest records it, the most that is opened)."""
    expected = model.state_dict()
    try:
        saved = header_shapes(file, size)
    except CheckpointError as exc:
        raise CheckpointError(f"{where}: cannot read {file.name}: {exc}") from None
    except OSError as exc:
        raise CheckpointError(f"{where}: cannot read {file.name}: {type(exc).__name__}: "
                              f"{exc.strerror or exc}") from None

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


def header_shapes(file: Path, size: int | None = None) -> dict:
    """``{tensor name: shape}`` from the header of safetensors file ``file``,
    read through :func:`~.safe_read.open_checked` (a regular file inside its
    checkpoint folder, at most ``size`` bytes when given) and parsed with a
    size and depth limit; :class:`CheckpointError` if it is not one."""
    limit = size if size is not None else 1 << 62
    with safe_read.open_checked(file, file.parent, limit=limit, what="a safetensors header",
                                why="the size the manifest records") as opened:
        head = opened.read_at(0, 8)
        if len(head) < 8:
            raise CheckpointError(f"it is {opened.size} bytes, too short for a safetensors header")
        length = int.from_bytes(head, "little")
        if length > min(safe_read.HEADER_LIMIT, opened.size - 8):
            raise CheckpointError(f"its header claims {length} bytes (the file has {opened.size}): "
                                  "it is corrupt")
        header = safe_read.loads_json(opened.read_at(8, length), file)
    bad = CheckpointError("its header is not a safetensors header: it is corrupt")
    if not isinstance(header, dict):
        raise bad
    shapes = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise bad
        shapes[key] = tuple(shape)
    return shapes
