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
    hookloop-rank<rank>.safetensors              each process's RNG and data-loader generator
                                                 states at the start of the current epoch,
                                                 and its loop.log values of the epoch so far
    hookloop.safetensors                         the tensors in plugin states
    hookloop.json                                written last: the loop position, which
                                                 network is which file, each stateful
                                                 plugin's state, the size and CRC-32 of
                                                 every other file, the run id and root,
                                                 the run settings, and its own CRC-32

Writes are atomic: a save goes into ``.tmp-<name>-<run>``, every file is
fsync'ed, the directory is renamed into place, and only then is ``latest``
replaced. Nothing is written that is not finite, and rotation deletes only
the run's own checkpoints.

A resume is one pass (``Loop.load_checkpoint``: :func:`~.loading.find`, then
:func:`~.loading.load`): ``latest`` read once (a fallback decided there),
the manifest read once and checked against the loop, every file opened once
and verified while it is deserialised, then committed as
``accelerator.load_state`` would, or nothing. hookloop does not hand its own
state to ``accelerator.register_for_checkpointing`` (Accelerate would read it
back with ``weights_only=False``, a pickle); such objects of the user's load
only as plain data, or when trusted by name (``trust_pickles``).

Plugin state: every registered plugin with both ``state_dict()`` and
``load_state_dict(state)`` is saved under its plugin name, as data (dicts,
lists, tuples, str, int, float, bool, None, tensors, numpy arrays);
``load_state_dict`` is called after the networks are restored, an optional
``load_state_dict_early(state, loop)`` before any optimizer state.

The package, one role per module (none imports a plugin):

    errors      CheckpointError, NonFiniteCheckpoint
    safe_read   reading a root's files bounded and confined, each opened once; CRC-32
    layout      names and places: file names, ``latest``, run folders, cleaning a root
    manifest    hookloop.json: write, read once, verify
    accelerate  Accelerate's file names, privates, writing and committing its files
    formats     the formats as objects: plain, FSDP, DeepSpeed, Megatron-LM, DCP
    reading     the one reader of Accelerate's files: a checkpoint staged in memory
    compat      may this checkpoint be loaded into this loop
    elastic     another cut of the global batch: where the checkpoint continues
    loading     find (one pass, the fallback), load, commit, load_weights
    script      continue a hand-written script's ``save_state`` folder
    codec       plugin state as data; the per-rank file
    finite      no non-finite state saved or loaded
    collective  every rank fails together
    writer      files written as they are checksummed; the host copy; the background job
    saving      save: write, fsync, publish, ``latest``, rotate
    runs        which checkpoints are the run's, best-k, rotation, the policy, a root's set-up
    lock        the run lock: a live run is never taken over
"""

from __future__ import annotations

from ..rng import Resume, restore_generators
from .codec import stateful_plugins
from .compat import run_settings
from .errors import CheckpointError, NonFiniteCheckpoint
from .finite import first_nonfinite, first_nonfinite_update
from .layout import (
    NAME_PATTERN,
    check_writable,
    checkpoint_name,
    clean,
    default_directory,
    list_checkpoints,
    read_latest,
    sort_key,
)
from .loading import WeightsLoaded, find, load, load_weights, resolve
from .manifest import read_manifest
from .reading import Staged, stage
from .runs import (
    CheckpointPolicy,
    RunIdentity,
    best_checkpoint_path,
    best_checkpoints,
    checkpoint_plugins,
    checkpoint_root,
    checkpoint_roots,
    foreign_checkpoints,
    owns,
    run_identity,
)
from .saving import save
from .script import load_script, script_folder

# Importable from here as in hookloop 0.2, though not in __all__
from ..rng import capture_epoch, capture_rng, data_generators, restore_rng  # noqa: F401
from .codec import from_data, to_data  # noqa: F401
from .collective import agree, every_rank  # noqa: F401
from .layout import FORMAT, LATEST, RANK_FILE, STATE_FILE, TENSORS_FILE  # noqa: F401
from .layout import TMP_PREFIX, TRASH_PREFIX, VERSION  # noqa: F401
from .layout import is_run_dir, next_run_name, run_folders  # noqa: F401
from .runs import describe_run, newest_run  # noqa: F401

__all__ = [
    "CheckpointError", "CheckpointPolicy", "NonFiniteCheckpoint", "Resume", "RunIdentity", "Staged",
    "best_checkpoint_path", "best_checkpoints", "check_writable", "checkpoint_name",
    "checkpoint_plugins", "checkpoint_root", "checkpoint_roots", "clean", "default_directory", "find",
    "first_nonfinite",
    "first_nonfinite_update", "foreign_checkpoints", "list_checkpoints", "load", "load_script",
    "load_weights", "owns", "read_latest", "read_manifest", "resolve", "run_identity", "run_settings",
    "save", "script_folder", "stage", "stateful_plugins", "WeightsLoaded",
]
_sort_key, _NAME, _restore_generators = sort_key, NAME_PATTERN, restore_generators  # 0.2's private names
