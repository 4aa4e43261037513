"""Continuing a hand-written Accelerate script's run: a folder written by a
plain ``accelerator.save_state(dir)`` (no ``hookloop.json``) restored into a
loop as ``accelerator.load_state(dir)`` restores it into the script's
objects (read by :func:`~.stage.stage_script`: bounded, confined,
``weights_only=True`` or safetensors, the tensor names and shapes compared
with the models), and the position the script would continue from.

With Accelerate's automatic naming the folders are
``<project_dir>/checkpoints/checkpoint_<i>``: the newest is taken, as
``accelerator.load_state()`` takes it. The folder holds no position: it comes
from the folder's name, as Accelerate's ``examples/by_feature/checkpointing.py``
and Transformers' ``run_*_no_trainer.py`` name it (``epoch_<e>``: saved after
epoch ``e``; ``step_<n>``: after ``n`` optimizer updates), else from
``position=``.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

from ..batches import length_of, updates_per_epoch
from ..rng import Resume, capture_rng
from ..state import POSITION, RunIdentity
from . import accelerate as accel
from . import formats
from .collective import every_rank
from .errors import CheckpointError
from .resume import commit, restore_early
from .saving import trusted_pickles
from .stage import Folder, custom_states, stage_script
from .store import STATE_FILE

#: the names the example scripts give their folders
NAMED = re.compile(r"^(epoch|step)_(\d+)$")
#: Accelerate's automatic naming: ``<project_dir>/checkpoints/checkpoint_<i>``
AUTOMATIC = re.compile(r"^checkpoint_(\d+)$")

#: what to pass when the position is not in the folder's name
HOW = ("pass it: loop.load_checkpoint(path, position='step_<updates>') or "
       "position={'epoch': <e>, 'step_in_epoch': <batches>} (epoch counted from 0; "
       "position='epoch_<e>' for a folder saved at the end of epoch e)")


def _saved_by_script(path: Path) -> bool:
    return (path.is_dir() and not path.is_symlink() and not (path / STATE_FILE).exists()
            and accel.written_by_save_state(path))


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


def load_script(loop, path, *, position=None, strict: bool = True, trust_pickles=None) -> Resume:
    """Restore ``loop`` from the ``accelerator.save_state`` folder ``path``
    names (every process), as ``accelerator.load_state`` restores the
    script's objects: models, optimizers, schedulers, the gradient scaler,
    the sampler or stateful loader, registered objects (plain data, or
    trusted by name), each process's random states. All or nothing.

    The position is the script's (:func:`position_of`); the next ``fit``
    continues as the script continued: the loader iterated afresh from the
    restored random states, the epoch's first ``step_in_epoch`` batches
    skipped, or, at an epoch boundary, the next epoch. Plugins keep their
    state (the folder has none of theirs); the run gets a new run id."""
    acc, folder = loop.accelerator, script_folder(path)
    if folder is None:
        held = " (a hookloop checkpoint, which holds its position)" if (Path(path) / STATE_FILE).exists() else ""
        raise CheckpointError(f"position= is for a folder written by accelerator.save_state, and "
                              f"{str(path)!r} is not one{held}")
    where = f"checkpoint {str(folder)!r}"
    trusted = set(trusted_pickles(loop) if trust_pickles is None else trust_pickles)
    with every_rank(acc):  # every process fails together, none waits
        pos, notes = position_of(loop, folder, position, where)
        staged, more = stage_script(loop, Folder(folder), strict)
        custom = custom_states(staged, trusted, where)
    restore_early(loop, staged, formats.describe_networks(loop), where)
    commit(loop, staged, custom, where)
    state = loop.state
    state.load_state_dict(pos)
    state.load_run_dict({})  # nothing evaluated at this update, no epoch ended here, no stop
    state.epoch_start = None  # the script keeps none: the epoch is iterated afresh
    state.logged.clear()
    state.run = RunIdentity()  # a new run: the script's had no id
    for message in notes + more:
        warnings.warn(f"hookloop: {message}", RuntimeWarning, stacklevel=3)
    loop.print(f"hookloop: resumed from {folder} (epoch {state.epoch}, update {state.global_step})")
    return Resume(epoch_start=None, rng=capture_rng(), generators=None, path=folder)
