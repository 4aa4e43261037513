"""Checkpoints: what one contains, and how it is written, found and read back.

A checkpoint is one directory written by :func:`save`, inside a checkpoint
root (``Checkpoint(dir=...)``; default ``<accelerator.project_dir or the
working directory>/checkpoints/version_<N>``)::

    checkpoints/
      latest                       the name of the newest complete checkpoint
      step-00000040/               a checkpoint after global step 40
      step-00000048-epoch-end/     after step 48 and its epoch's end (eval done)
      .tmp-step-00000056-<run>/    a save in progress, or killed: ignored, removed

Inside one, everything Accelerate's ``accelerator.save_state`` writes, plus
hookloop's own state as data (JSON and safetensors, never a pickle)::

    model.safetensors, model_1.safetensors ...   every prepared model (Accelerate)
    optimizer.bin, optimizer_1.bin ...           every optimizer's state_dict (Accelerate)
    scheduler.bin ...                            every scheduler's state_dict (Accelerate)
    random_states_<rank>.pkl                     each process's RNG and accumulation counter
    hookloop-rank<rank>.safetensors              each process's random, data-loader and sampler
                                                 states at the start of the current epoch,
                                                 and its loop.log values of the epoch so far
    hookloop.safetensors                         the tensors in plugin states
    hookloop.json                                written last: the loop position, which
                                                 network is which file, each stateful
                                                 plugin's state, the size and CRC-32 of
                                                 every other file, the run id and root,
                                                 the run settings, and its own CRC-32

Writes are atomic: a save goes into ``.tmp-<name>-<run>``, every file is
fsync'ed, the directory is renamed into place (the commit point), and only
then is ``latest`` replaced. Nothing is written that is not finite, and
rotation deletes only the run's own checkpoints. A resume is one pass:
``latest`` read once, the manifest once, every file opened once, verified,
then parsed by its library; committed as ``accelerator.load_state`` would,
or nothing.

One module per job (none imports a plugin):

    errors      CheckpointError, NonFiniteCheckpoint
    store       the root on disk: names, ``latest``, run folders, cleaning; reading bounded and confined
    lock        the run lock: a live run is never taken over
    manifest    hookloop.json: one reader, one writer
    accelerate  the one adapter of Accelerate's file names and privates, writing and restoring its files
    formats     the plain and the sharded formats (FSDP, the user's DCP)
    codec       plugin state as data; the per-process rank file
    finite      no non-finite state saved or loaded
    collective  every rank fails together
    stage       read and verify into memory; does it fit the loop
    elastic     another cut of the global batch: where the checkpoint continues
    resume      find, load, commit; a new run from the weights
    script      continue a hand-written script's ``save_state`` folder
    saving      a save, and the runs of a root (ownership, best-k, rotation, the policy)
    writer      files written as they are checksummed; the host copy; the writer process
"""

from __future__ import annotations

from ..rng import Resume
from .codec import stateful_plugins
from .errors import CheckpointError, NonFiniteCheckpoint
from .finite import first_nonfinite, first_nonfinite_update
from .manifest import read_manifest
from .resume import WeightsLoaded, find, load, load_weights, resolve
from .saving import (
    CheckpointPolicy,
    best_checkpoint_path,
    checkpoint_plugins,
    checkpoint_root,
    checkpoint_roots,
    save,
)
from .script import load_script, script_folder
from .stage import Staged, run_settings, stage
from .store import (
    NAME_PATTERN,
    check_writable,
    checkpoint_name,
    clean,
    default_directory,
    list_checkpoints,
    read_latest,
    sort_key,
)

__all__ = [
    "CheckpointError", "CheckpointPolicy", "NonFiniteCheckpoint", "Resume", "Staged", "WeightsLoaded",
    "best_checkpoint_path", "check_writable", "checkpoint_name", "checkpoint_plugins", "checkpoint_root",
    "checkpoint_roots", "clean", "default_directory", "find", "first_nonfinite", "first_nonfinite_update",
    "list_checkpoints", "load", "load_script", "load_weights", "read_latest", "read_manifest", "resolve",
    "run_settings",
    "save", "script_folder", "sort_key", "stage", "stateful_plugins", "NAME_PATTERN",
]
