"""Continuing a hand-written Accelerate script's run: a folder written by a
plain ``accelerator.save_state(dir)`` (no ``hookloop.json``) restored into
a loop as ``accelerator.load_state(dir)`` restores it into the script's
objects, and the position the script would continue from.

What such a folder holds: ``model.safetensors`` (or ``pytorch_model.bin``,
``model_1...`` per further model), ``optimizer.bin``, ``scheduler.bin``,
``random_states_<rank>.pkl`` (python, numpy, torch RNG and Accelerate's
accumulation counter), ``scaler.pt``, ``custom_checkpoint_<i>.pkl``, and
``sampler.bin`` / ``dl_state_dict.bin`` for a seedable sampler or a stateful
loader. With Accelerate's automatic naming the folders are
``<project_dir>/checkpoints/checkpoint_<i>``: the newest is taken, as
``accelerator.load_state()`` takes it.

Every file is read bounded and confined (:mod:`.safe_read`), with
``weights_only=True`` or safetensors; the safetensors headers are compared
with the models before any tensor is read; then the states are committed by
:func:`~.accelerate.commit`, as for a hookloop checkpoint.

The folder holds no position: it comes from the folder's name, as
Accelerate's ``examples/by_feature/checkpointing.py`` and Transformers'
``run_*_no_trainer.py`` name it (``epoch_<e>``: saved after epoch ``e``;
``step_<n>``: after ``n`` optimizer updates), else from ``position=``.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any

from ..batches import length_of, updates_per_epoch
from ..rng import Resume, capture_rng
from ..state import POSITION, RunIdentity
from . import accelerate as accel
from . import formats, safe_read
from .codec import check_rng
from .collective import every_rank
from .compat import compare_shapes, header_shapes
from .errors import CheckpointError, first_line
from .finite import check_staged_finite
from .layout import STATE_FILE
from .loading import _check_optimizers, _custom_states
from .policy import checkpoint_plugins
from .staging import Staged

#: the names the example scripts give their folders
NAMED = re.compile(r"^(epoch|step)_(\d+)$")
#: Accelerate's automatic naming: ``<project_dir>/checkpoints/checkpoint_<i>``
AUTOMATIC = re.compile(r"^checkpoint_(\d+)$")
_RNG = re.compile(r"^random_states_(\d+)\.pkl$")
_CUSTOM = re.compile(r"^custom_checkpoint_(\d+)\.pkl$")
_MODEL = re.compile(r"^(?:model(?:_(\d+))?\.safetensors|pytorch_model(?:_(\d+))?\.bin)$")
_NUMBERED = {"optimizer": re.compile(r"^optimizer(?:_(\d+))?\.bin$"),
             "scheduler": re.compile(r"^scheduler(?:_(\d+))?\.bin$")}

#: what to pass when the position is not in the folder's name
HOW = ("pass it: loop.load_checkpoint(path, position='step_<updates>') or "
       "position={'epoch': <e>, 'step_in_epoch': <batches>} (epoch counted from 0; "
       "position='epoch_<e>' for a folder saved at the end of epoch e)")


def _saved_by_script(path: Path) -> bool:
    if not path.is_dir() or path.is_symlink() or (path / STATE_FILE).exists():
        return False
    names = (accel.model_file(0), accel.legacy_model_file(0), accel.optimizer_file(0), accel.rng_file(0))
    return any((path / name).is_file() for name in names)


def script_folder(path) -> Path | None:
    """The folder of ``accelerator.save_state`` that ``path`` names, or
    None: ``path`` itself, or (automatic naming) the newest
    ``checkpoint_<i>`` in ``path`` or in ``path/checkpoints``."""
    path = Path(path)
    if _saved_by_script(path):
        return path
    for parent in (path, path / "checkpoints"):
        if not parent.is_dir() or (parent / STATE_FILE).exists():
            continue
        numbered = [(int(m.group(1)), p) for p in parent.iterdir()
                    if (m := AUTOMATIC.match(p.name)) and _saved_by_script(p)]
        if numbered:
            return max(numbered, key=lambda item: item[0])[1]
    return None


# -- the position ----------------------------------------------------------------------


def position_of(loop, folder: Path, position, where: str) -> tuple[dict, list[str]]:
    """The loop position (``epoch``, ``step_in_epoch``, ``global_step``,
    ``micro_step``) the script would continue from, and warnings.
    ``position``: None (the folder's name), ``"epoch_<e>"``, ``"step_<n>"``
    or a dict of position fields (``epoch`` and ``step_in_epoch`` at least)."""
    given = position if position is not None else folder.name
    source = "position=" if position is not None else "the folder's name"
    batches = length_of(loop.train_data)
    k = loop.configured_accumulation
    per_epoch = updates_per_epoch(loop.train_data, k)
    if isinstance(given, str):
        named = NAMED.match(given)
        if named is None:
            if position is not None:
                raise CheckpointError(f"{where}: position={position!r} is not 'epoch_<e>', 'step_<n>' "
                                      f"or a dict of {', '.join(POSITION)}")
            raise CheckpointError(
                f"{where} was written by accelerator.save_state without hookloop, so it records no "
                f"position, and its name is not epoch_<e> or step_<n> (as the example scripts name "
                f"theirs): {HOW}. Loop(resume_from=...) takes it from the name only")
        kind, n = named.group(1), int(named.group(2))
        if not per_epoch:
            raise CheckpointError(f"{where}: train_data has no length (or no batch), so {kind}_{n} "
                                  f"({source}) gives no position: pass position={{'epoch': ..., "
                                  "'step_in_epoch': ..., 'global_step': ...}")
        assert batches is not None  # per_epoch is known only from the length
        if kind == "epoch":  # saved after epoch n and its evaluation: the next one starts
            return {"epoch": n + 1, "step_in_epoch": 0, "global_step": (n + 1) * per_epoch,
                    "micro_step": (n + 1) * batches}, []
        # n updates: whole epochs of per_epoch updates, then k batches per update
        epoch, done = divmod(n, per_epoch)
        pos = {"epoch": epoch, "step_in_epoch": done * k, "global_step": n,
               "micro_step": epoch * batches + done * k}
        notes = []
        script_epoch, script_skip = divmod(n * k, batches)  # run_*_no_trainer.py's arithmetic
        if (script_epoch, script_skip) != (epoch, done * k):
            notes.append(
                f"{where}: step_{n} is {n} updates of {k} batches; with {batches} batches per epoch "
                f"(not a multiple of {k}) an epoch has {per_epoch} updates, so the run continues in "
                f"epoch {epoch} after {done * k} batches (the example scripts' n * {k} // {batches} "
                f"would say epoch {script_epoch} after {script_skip})")
        return pos, notes
    if not isinstance(given, dict):
        raise CheckpointError(f"{where}: position={position!r} is not 'epoch_<e>', 'step_<n>' or a "
                              f"dict of {', '.join(POSITION)}")
    unknown = [key for key in given if key not in POSITION]
    missing = [key for key in ("epoch", "step_in_epoch") if key not in given]
    if unknown or missing:
        problem = (f"has no {', '.join(map(repr, missing))}" if missing
                   else f"has unknown key(s) {', '.join(map(repr, unknown))}")
        raise CheckpointError(f"{where}: position={position!r} {problem}: it takes "
                              f"{', '.join(POSITION)} (epoch and step_in_epoch needed)")
    bad = [key for key, value in given.items()
           if not isinstance(value, int) or isinstance(value, bool) or value < 0]
    if bad:
        raise CheckpointError(f"{where}: position[{bad[0]!r}] must be a non-negative int, got "
                              f"{given[bad[0]]!r}")
    epoch, step = given["epoch"], given["step_in_epoch"]
    if batches is not None and step > batches:
        raise CheckpointError(f"{where}: position step_in_epoch={step} is more than the {batches} "
                              "batches of an epoch of train_data")
    if step % k and step != batches:
        raise CheckpointError(f"{where}: position step_in_epoch={step} is inside an accumulation "
                              f"group of {k} batches: give a position at an update")
    if batches is None and "global_step" not in given:
        raise CheckpointError(f"{where}: train_data has no length: pass position['global_step'] "
                              "(the optimizer updates done) too")
    pos = {"epoch": epoch, "step_in_epoch": step,
           "global_step": given.get("global_step", (epoch * per_epoch if per_epoch else 0)
                                    + math.ceil(step / k)),
           "micro_step": given.get("micro_step", epoch * (batches or 0) + step)}
    return pos, []


# -- staging -----------------------------------------------------------------------------


def _numbers(files: set, pattern) -> list[int]:
    out = []
    for name in files:
        match = pattern.match(name)
        if match:
            out.append(int(next((g for g in match.groups() if g is not None), 0)))
    return sorted(set(out))


def stage(loop, folder: Path, where: str, strict: bool) -> tuple[Staged, list[str]]:
    """This process's files of ``folder`` read, checked against the loop and
    deserialised, nothing changed yet; and warnings (``strict=False``: files
    this loop has no object for)."""
    acc = loop.accelerator
    fmt = formats.accelerate_format(acc)
    if fmt["format"] != formats.PLAIN or formats.describe(loop) is not None:
        raise CheckpointError(f"{where}: continuing an accelerator.save_state folder is supported "
                              f"for unsharded runs; this one saves {fmt['format']}: load it with "
                              "accelerator.load_state, then build the Loop with prepare=False")
    safe_read.check_folder(folder)
    files = {p.name for p in folder.iterdir() if p.is_file() or p.is_symlink()}
    rank, notes = acc.process_index, []
    label = {}
    for name, entry in formats.describe_networks(loop).items():
        for part in ("model", "optimizer", "scheduler"):
            if entry.get(part):
                label[entry[part]] = (f"the weights of network {name!r}" if part == "model"
                                      else f"the {part} state of network {name!r}", name)

    def read(rel, what, loader=None):
        file = folder / rel
        size = safe_read.file_size(file, folder, what)
        with safe_read.open_checked(file, folder, limit=size, what=what) as opened:
            return opened.read() if loader is None else loader(opened.source(), rel, where, what)

    def counts(kind, held, have, names):
        extra = [i for i in held if i >= have]
        if extra:
            msg = (f"{where} holds {len(held)} {kind}(s) ({', '.join(names(i) for i in held)}); "
                   f"this loop has {have}")
            if strict:
                raise CheckpointError(msg + ": build the Loop with the script's models, optimizers "
                                            "and schedulers, in the order it prepared them")
            notes.append(msg + ": the others are not loaded")

    models = []
    counts("model", _numbers(files, _MODEL), len(acc._models),
           lambda i: accel.model_file(i) if accel.model_file(i) in files else accel.legacy_model_file(i))
    for i, model in enumerate(acc._models):
        rel = accel.model_file(i) if accel.model_file(i) in files else accel.legacy_model_file(i)
        what, network = label.get(accel.model_file(i), (f"the weights of accelerator model #{i}", f"#{i}"))
        if rel not in files:
            raise CheckpointError(f"{where} holds no {what} ({accel.model_file(i)} or "
                                  f"{accel.legacy_model_file(i)})")
        if rel.endswith(".safetensors"):  # the header first: a wrong model fails before any read
            try:
                saved = header_shapes(folder / rel, safe_read.file_size(folder / rel, folder, what))
            except CheckpointError as exc:
                raise CheckpointError(f"{where}: cannot read {rel}: {exc}") from None
            compare_shapes(saved, model.state_dict(), network, where)
            models.append(read(rel, what, accel.safetensors_load))
        else:
            state = read(rel, what, accel.torch_load)
            if not isinstance(state, dict):
                raise CheckpointError(f"{where}: cannot read {what} from {rel}: not a state dict")
            compare_shapes({k: tuple(v.shape) for k, v in state.items()}, model.state_dict(), network, where)
            models.append(state)
    parts: dict[str, Any] = {}
    for kind, objects, file in (("optimizer", acc._optimizers, accel.optimizer_file),
                                ("scheduler", accel.scheduler_objects(acc), accel.scheduler_file)):
        counts(kind, _numbers(files, _NUMBERED[kind]), len(objects), file)
        parts[kind] = []
        for i in range(len(objects)):
            rel = file(i)
            what = label.get(rel, (f"the state of accelerator {kind} #{i}",))[0]
            if rel not in files:
                raise CheckpointError(f"{where} holds no {what} ({rel})")
            state = read(rel, what, accel.torch_load)
            if kind == "optimizer" and not (isinstance(state, dict) and isinstance(state.get("state"), dict)
                                            and isinstance(state.get("param_groups"), list)):
                raise CheckpointError(f"{where}: cannot read {what} from {rel}: it is not an optimizer "
                                      "state_dict (no 'state' and 'param_groups')")
            parts[kind].append(state)

    written_by = _numbers(files, _RNG)
    if accel.rng_file(rank) not in files:
        raise CheckpointError(f"{where} holds no random states of process {rank} ({accel.rng_file(rank)}): "
                              f"it was written by {len(written_by)} process(es), this run has "
                              f"{acc.num_processes}: continue it on as many processes as wrote it")
    if len(written_by) != acc.num_processes:
        msg = (f"{where} was written by {len(written_by)} process(es), this run has {acc.num_processes}: "
               "the data is cut otherwise, and the position is the script's, not the same examples")
        if strict:
            raise CheckpointError(msg + "; continue it on as many processes (or strict=False)")
        notes.append(msg)
    rel, what = accel.rng_file(rank), f"the random states of process {rank}"
    rng = read(rel, what, accel.torch_load)
    try:
        check_rng(rng["random_state"], rng["numpy_random_seed"], rng["torch_manual_seed"])
    except Exception as exc:  # noqa: BLE001 - any invalid content
        raise CheckpointError(f"{where}: cannot read {what} from {rel}: they are not valid random "
                              f"states ({type(exc).__name__}: {first_line(exc)})") from exc
    scaler = None
    if accel.SCALER_FILE in files:
        scaler = read(accel.SCALER_FILE, "the gradient scaler state", accel.torch_load)
    elif acc.scaler is not None:
        notes.append(f"{where} holds no {accel.SCALER_FILE}: the gradient scaler starts fresh")
    extra = {rel: read(rel, "a data loader state") for rel in sorted(files) if accel.LOADER_FILE.match(rel)}
    custom = {}
    held = _numbers(files, _CUSTOM)
    for i in range(len(acc._custom_objects)):
        rel = accel.custom_file(i)
        what = f"the state of object #{i} registered with accelerator.register_for_checkpointing"
        if rel not in files:
            raise CheckpointError(f"{where} holds no {what} ({rel})")
        data = read(rel, what)
        try:
            custom[rel] = ("data", accel.torch_load(data, rel, where, what))
        except CheckpointError:
            custom[rel] = ("pickle", data)
    unclaimed = [accel.custom_file(i) for i in held if i >= len(acc._custom_objects)]
    if unclaimed:
        notes.append(f"{where}: {', '.join(unclaimed)} (objects the script registered with "
                     "accelerator.register_for_checkpointing) not loaded: no object of this loop's "
                     "accelerator is registered to receive them")
    check_staged_finite(models, parts["optimizer"], {}, where)
    doc = {"accelerate": accel.accelerate_counts(acc), "files": {}}
    staged = Staged(folder, doc, rank, models, parts["optimizer"], parts["scheduler"], rng, scaler,
                    extra, custom, None, {}, {}, {}, rank, None)
    return staged, notes


# -- loading -----------------------------------------------------------------------------


def load(loop, path, *, position=None, strict: bool = True, trust_pickles=None) -> Resume:
    """Restore ``loop`` from the ``accelerator.save_state`` folder ``path``
    names (every process), as ``accelerator.load_state`` restores the
    script's objects: models, optimizers, schedulers, the gradient scaler,
    the sampler or stateful loader, registered objects (plain data, or
    trusted by name), each process's random states. All or nothing: every
    file is read and checked first (tensor names and shapes, optimizer
    states against their optimizers, finiteness), then committed.

    The position is the script's (:func:`position_of`); the next
    :meth:`~hookloop.Loop.fit` continues as the script continued: the
    loader iterated afresh from the restored random states, the epoch's
    first ``step_in_epoch`` batches skipped
    (``accelerator.skip_first_batches``), or, at an epoch boundary, the next
    epoch. Plugins keep their state (the folder has none of theirs); the
    run gets a new run id. Returns how to continue (a
    :class:`~hookloop.rng.Resume` without an epoch start).
    """
    acc = loop.accelerator
    folder = script_folder(path)
    if folder is None:
        held = " (a hookloop checkpoint, which holds its position)" if (Path(path) / STATE_FILE).exists() else ""
        raise CheckpointError(f"position= is for a folder written by accelerator.save_state, and "
                              f"{str(path)!r} is not one{held}")
    where = f"checkpoint {str(folder)!r}"
    if trust_pickles is None:
        trust_pickles = {name for plugin in checkpoint_plugins(loop)
                         for name in getattr(plugin, "trust_pickles", ())}
    with every_rank(acc):  # every process fails together, none waits
        pos, notes = position_of(loop, folder, position, where)
        staged, more = stage(loop, folder, where, strict)
        custom = _custom_states(staged, set(trust_pickles), where)
        _check_optimizers(loop, staged, where, groups=False)
        _check_optimizers(loop, staged, where, groups=True)
    formats.commit(loop, staged, custom, where)
    state = loop.state
    state.load_state_dict(pos)
    state.load_run_dict({})  # nothing evaluated at this update, no epoch ended here, no stop
    state.epoch_start = None  # the script keeps none: the epoch is iterated afresh
    state.logged.clear()
    state.run = RunIdentity()  # a new run: the script's had no id
    for message in notes + more:
        warnings.warn(f"hookloop: {message}", RuntimeWarning, stacklevel=3)
    loop.print(f"hookloop: resumed from {folder} (epoch {loop.state.epoch}, "  # main process only
               f"update {loop.state.global_step})")
    return Resume(epoch_start=None, rng=capture_rng(), generators=None, path=folder)
