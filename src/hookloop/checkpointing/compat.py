"""May this checkpoint be loaded into this loop, and where does it continue?
Checked on its manifest before its files are read: the format, the networks,
the optimizer and scheduler classes, the objects prepared on the accelerator,
the run settings that decide the data order and the step count
(:func:`run_settings`, the plan of :mod:`.elastic`) and the stateful
plugins; then, on what was read, the tensor names and shapes
(:func:`compare_shapes`).
"""

from __future__ import annotations

from ..batches import length_of, loader_batch_size
from ..rng import generator_roles
from . import accelerate as accel
from . import elastic, formats
from .codec import stateful_plugins
from .elastic import SETTINGS, Plan  # noqa: F401 - SETTINGS: importable from here as in 0.3.0
from .errors import CheckpointError
from .reading import compare_shapes, match_models


def run_settings(loop) -> dict:
    """What decides the data order and the step count of ``loop``'s run, as
    recorded in every checkpoint (``settings``) and compared on resume.
    None: unknown (not compared)."""
    acc, data = loop.accelerator, loop.train_data
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
    size = out["batch_size"]
    per_batch = None if size is None else size if out["split_batches"] is True else size * acc.num_processes
    out["examples_per_batch"] = per_batch
    out["global_batch_size"] = per_batch * out["gradient_accumulation_steps"] if per_batch is not None else None
    out["examples_in_epoch"] = loop.state.step_in_epoch * per_batch if per_batch is not None else None
    roles = generator_roles(data)  # which generator draws the shuffle (another loader redraws it)
    out["sampler_generator"], out["loader_generator"] = roles["sampler"], roles["loader"]
    return out


def _sampler_name(data):
    """The class of the innermost sampler under a (prepared) loader's batch
    samplers. Never truth-tests a sampler: a stream's has no length."""
    obj = data
    for _ in range(7):
        inner = next((v for v in (getattr(obj, "batch_sampler", None), getattr(obj, "sampler", None))
                      if v is not None), None)
        if inner is None:
            break
        obj = inner
    return None if data is None or obj is data else type(obj).__name__


def check_resume(loop, path, doc: dict, strict: bool) -> tuple[list[str], Plan]:
    """Everything that must match before a file is read, and where the
    checkpoint continues (:class:`~.elastic.Plan`). Returns the warnings to
    give (non-strict mismatches, a mapped position) and the plan."""
    where = f"checkpoint {str(path)!r}"
    formats.check_resume(loop, doc, where)  # the same format (and, sharded, processes)
    _check_networks(loop, doc, where)
    plan = elastic.plan(loop, path, doc, run_settings(loop), strict)
    return plan.messages + _check_plugins(loop, doc, where, strict), plan


def _check_networks(loop, doc: dict, where: str) -> None:
    acc, saved = loop.accelerator, doc["networks"]
    if list(saved) != list(loop.networks):
        raise CheckpointError(f"{where} holds networks {list(saved)}; this loop has {list(loop.networks)}")
    now = formats.describe_networks(loop)
    for name, entry in now.items():
        for part in ("model", "optimizer", "scheduler"):
            if (entry[part] is None) != (saved[name].get(part) is None):
                here, there = ("the checkpoint", "this loop") if entry[part] is None else ("this loop",
                                                                                           "the checkpoint")
                raise CheckpointError(f"{where}: network {name!r} has a {part} in {here} but not in {there}")
    if accel.counts(acc) != doc["accelerate"]:
        raise CheckpointError(f"{where} was written with {doc['accelerate']} objects prepared on the "
                              f"accelerator; this run has {accel.counts(acc)}")
    classes = doc.get("classes") or {}
    for name, net in loop.networks.items():
        for part in ("optimizer", "scheduler"):
            file = now[name][part]
            if file is None or file not in classes:
                continue
            current = accel.class_name(getattr(net, part))
            if classes[file] != current:
                short = classes[file].rsplit(".", 1)[-1]
                raise CheckpointError(
                    f"{where}: network {name!r}: {file} holds the state of a {short} {part} "
                    f"({classes[file]}), but this network's {part} is a {current.rsplit('.', 1)[-1]} "
                    f"({current}): the state of one does not fit the other. Resume with the {part} "
                    "the checkpoint was written with"
                )


def check_shapes(loop, staged, where: str) -> None:
    """The tensor names and shapes of the staged models (or, sharded, in
    DCP's metadata) against the loop's; the staged weights put under the
    names of the models they are restored into (:func:`~.reading.match_models`:
    a compiled run's checkpoint into an eager model, and the reverse)."""
    for saved, shapes, network, rel in formats.dcp_shapes(loop, staged.sharded) if staged.sharded else ():
        compare_shapes(saved, shapes, network, where, rel)
    staged.models = match_models(staged.models, accel.models(loop.accelerator), formats.describe_networks(loop),
                                 where)


def _check_plugins(loop, doc: dict, where: str, strict: bool) -> list[str]:
    messages = []
    saved, current = set(doc["plugins"]), dict(stateful_plugins(loop))
    only_saved, only_now = sorted(saved - set(current)), sorted(set(current) - saved)
    if only_saved:
        msg = (f"{where} holds the state of plugin(s) {', '.join(map(repr, only_saved))}, which "
               f"this loop does not run (stateful plugins now: {', '.join(map(repr, current)) or 'none'})")
        if strict:
            raise CheckpointError(msg + ": add them, or pass strict=False to drop their state")
        messages.append(msg + ": their state is not restored")
    if only_now:
        msg = (f"plugin(s) {', '.join(map(repr, only_now))} have state (state_dict/load_state_dict) "
               f"but {where} has none for them (it was written without them)")
        if strict:
            raise CheckpointError(msg + ": pass strict=False to start them fresh")
        messages.append(msg + ": they start fresh")
    return messages
