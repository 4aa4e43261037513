"""May this checkpoint be loaded into this loop, and where does it continue?
Everything that must match before anything is read in full: the networks and
their tensor shapes, the optimizer and scheduler classes, the objects
prepared on the accelerator, the run settings that decide the data order and
the step count (:func:`run_settings`), and the stateful plugins. How the
global batch is cut (processes, batch size, accumulation) may differ: the
data position is then mapped in examples (:mod:`.elastic`).
"""

from __future__ import annotations

from pathlib import Path

from ..batches import length_of, loader_batch_size
from ..rng import generator_roles
from . import accelerate as accel
from . import elastic, formats, safe_read
from .codec import stateful_plugins
from .elastic import SETTINGS, Plan  # noqa: F401 - SETTINGS: importable from here as in 0.3.0
from .errors import CheckpointError

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
    # the cut of the global batch, and where the epoch is in its global order
    # (docs/checkpoints.md, Another number of processes)
    size = out["batch_size"]
    per_batch = None if size is None else size if out["split_batches"] is True else size * acc.num_processes
    out["examples_per_batch"] = per_batch
    accumulation = out["gradient_accumulation_steps"]
    out["global_batch_size"] = per_batch * accumulation if per_batch is not None else None
    out["examples_in_epoch"] = loop.state.step_in_epoch * per_batch if per_batch is not None else None
    roles = generator_roles(data)  # which generator draws the shuffle (another loader redraws it)
    out["sampler_generator"], out["loader_generator"] = roles["sampler"], roles["loader"]
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


def check_resume(loop, path: Path, doc: dict, strict: bool) -> tuple[list[str], Plan]:
    """Everything that must match before anything is loaded, and where the
    checkpoint continues (:class:`~.elastic.Plan`: the position in this
    run's batches, on another number of processes or with another batch
    size). Returns the warnings to give (non-strict mismatches, a mapped
    position) and the plan."""
    where = f"checkpoint {str(path)!r}"
    formats.check_resume(loop, doc, where)  # the same format (and, sharded, processes)
    _check_networks(loop, path, doc, where)
    plan = elastic.plan(loop, path, doc, run_settings(loop), strict)
    return plan.messages + _check_plugins(loop, doc, where, strict), plan


def check_compatible(loop, path: Path, doc: dict, strict: bool) -> list[str]:
    """:func:`check_resume`'s warnings (hookloop 0.3.0's name)."""
    return check_resume(loop, path, doc, strict)[0]


def _check_networks(loop, path: Path, doc: dict, where: str) -> None:
    acc = loop.accelerator
    saved_nets = doc["networks"]
    if list(saved_nets) != list(loop.networks):
        raise CheckpointError(
            f"{where} holds networks {list(saved_nets)}; this loop has {list(loop.networks)}"
        )
    now = formats.describe_networks(loop)
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
    if "sharding" in doc:  # the shapes in DCP's metadata; none in a FULL_STATE_DICT / DeepSpeed file
        return formats.check_shapes(loop, path, doc, where)
    owner = {entry["model"]: name for name, entry in now.items()}
    for index, model in enumerate(accel.models(acc)):
        file = accel.model_file(index)
        _check_shapes(path / file, model, owner.get(file, f"accelerator model #{index}"), where,
                      (doc.get("files") or {}).get(file))


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
    compare_shapes(saved, expected, network, where)


def compare_shapes(saved: dict, expected: dict, network: str, where: str) -> None:
    """``saved`` (tensor name -> shape) against a model's ``state_dict()``
    (``expected``): the same names (a tied tensor's second name may be
    missing) and shapes, or a :class:`CheckpointError` naming the tensor."""

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
