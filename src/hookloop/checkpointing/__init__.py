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
                                                 network is which file (and its optimizer's
                                                 and scheduler's class), each stateful
                                                 plugin's state, the size and CRC-32 of
                                                 every other file, the run id and root,
                                                 the run settings, and its own CRC-32

Nothing is written that is not finite (:class:`NonFiniteCheckpoint`), and
rotation deletes only the run's own checkpoints (:func:`owns`).

Loading (:func:`load`) is all or nothing: every file is read and verified
first (:func:`stage`: sizes, checksums, ``torch.load(weights_only=True)`` or
safetensors, random states, finiteness), then committed, as
``accelerator.load_state`` would, by hookloop itself. hookloop does not hand
its own state to ``accelerator.register_for_checkpointing``: Accelerate
would write it with ``torch.save`` and read it back with
``weights_only=False`` (a pickle: code execution from a tampered
checkpoint); such objects of the user's load only as plain data, or when
trusted by name (``trust_pickles``).

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
``on_fit_start``; an optional ``load_state_dict_early(state, loop)`` is
called before any network, optimizer or scheduler state is restored (to add
back a param group the plugin added during training).

The package, one role per module (none imports a plugin; random states and
the epoch replay are :mod:`hookloop.rng`'s):

    errors      CheckpointError, NonFiniteCheckpoint
    layout      names and places: file names, checkpoint names, ``latest``,
                run folders, cleaning a root
    manifest    hookloop.json: read, verify (its own CRC-32, each file's
                size and CRC-32)
    runs        run identity: which checkpoints are this run's; the best ones
    compat      may this checkpoint be loaded into this loop
    codec       plugin state as data; the per-rank file
    finite      no non-finite state saved or loaded
    accelerate  Accelerate's file names, privates, and committing into its objects
    collective  every rank fails together (:func:`every_rank`)
    saving      save: write, fsync, publish, ``latest``, rotate
    staging     stage: read and verify into memory
    loading     find / resolve, load (all or nothing)
    elastic     another cut of the global batch: the data position in examples,
                what maps and what is re-derived on another number of processes
    weights     load_weights: a new run from a checkpoint's weights alone
    script_state  load_script: continue a hand-written script's ``save_state`` folder
    policy      CheckpointPolicy: what the I/O needs from the Checkpoint plugin
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
from .loading import find, load, resolve
from .manifest import read_manifest
from .policy import CheckpointPolicy, best_checkpoint_path, checkpoint_plugins, checkpoint_root
from .runs import RunIdentity, best_checkpoints, foreign_checkpoints, owns, run_identity
from .saving import save
from .script_state import load as load_script
from .script_state import script_folder
from .staging import Staged, stage
from .weights import load_weights

# Importable from here as in hookloop 0.2, though not in __all__: the random
# states (hookloop.rng's since 0.3), the file names, the run folders, the codec,
# and the collective helpers.
from ..rng import capture_epoch, capture_rng, data_generators, restore_rng  # noqa: F401
from .codec import from_data, to_data  # noqa: F401
from .collective import _all_ok, agree, every_rank  # noqa: F401
from .layout import FORMAT, LATEST, RANK_FILE, STATE_FILE, TENSORS_FILE  # noqa: F401
from .layout import TMP_PREFIX, TRASH_PREFIX, VERSION  # noqa: F401
from .layout import is_run_dir, next_run_name, run_folders  # noqa: F401
from .runs import newest_run  # noqa: F401
from .runs import describe_run  # noqa: F401

# hookloop 0.2's private names that code outside the package used
_NAME = NAME_PATTERN
_sort_key = sort_key
_restore_generators = restore_generators

__all__ = [
    "CheckpointError",
    "CheckpointPolicy",
    "NonFiniteCheckpoint",
    "Resume",
    "RunIdentity",
    "Staged",
    "best_checkpoint_path",
    "best_checkpoints",
    "check_writable",
    "checkpoint_name",
    "checkpoint_plugins",
    "checkpoint_root",
    "clean",
    "default_directory",
    "find",
    "first_nonfinite",
    "first_nonfinite_update",
    "foreign_checkpoints",
    "list_checkpoints",
    "load",
    "load_script",
    "load_weights",
    "owns",
    "read_latest",
    "read_manifest",
    "resolve",
    "run_identity",
    "run_settings",
    "save",
    "script_folder",
    "stage",
    "stateful_plugins",
]
