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
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
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

from .batches import length_of, loader_batch_size

FORMAT = "hookloop-checkpoint"
#: 2: run id, checksums, run settings, finiteness, optimizer classes, and a
#: checksum of the manifest itself. Version 1 checkpoints (hookloop 0.1) still
#: load: what they lack is not verified.
VERSION = 2
STATE_FILE = "hookloop.json"
TENSORS_FILE = "hookloop.safetensors"
RANK_FILE = "hookloop-rank{rank}.safetensors"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
_NAME = re.compile(r"^step-(\d+)(-epoch-end)?$")
_CUSTOM = re.compile(r"^custom_checkpoint_(\d+)\.pkl$")
#: the key of the manifest's own checksum (over the rest of it)
_SELF_CRC = "manifest_crc32"


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read back: the message names the
    directory and the culprit (a file, a network's tensor, a plugin)."""


class NonFiniteCheckpoint(CheckpointError):
    """A save was refused: a network's parameter or optimizer state holds a
    NaN or an infinity. Nothing was written; ``latest`` still names the last
    finite checkpoint.

    :ivar network: the network whose tensor is not finite.
    :ivar tensor: which tensor (``"parameter '0.weight'"``, ``"optimizer state
        'exp_avg' of parameter '0.weight'"``).
    :ivar step: the ``global_step`` of the refused save.
    :ivar first_bad: ``(update, network, what)`` of the first update seen with a
        non-finite gradient norm (from ``GradClip``), or None if unknown.
    """

    def __init__(self, message, *, network=None, tensor=None, step=None, first_bad=None):
        super().__init__(message)
        self.network = network
        self.tensor = tensor
        self.step = step
        self.first_bad = first_bad


# ---------------------------------------------------------------------------
# names and places
# ---------------------------------------------------------------------------


def default_directory(accelerator) -> Path:
    """``<accelerator.project_dir>/checkpoints``, or ``./checkpoints``: where
    the default run folders (``version_<N>``) go."""
    return Path(accelerator.project_dir or os.getcwd()) / "checkpoints"


_RUN = re.compile(r"^version_(\d+)$")


def run_folders(base) -> list[Path]:
    """The ``version_<N>`` run folders in ``base``, by N."""
    base = Path(base)
    if not base.is_dir():
        return []
    found = [p for p in base.iterdir() if _RUN.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(_RUN.match(p.name).group(1)))


def is_run_dir(base, path) -> bool:
    """Whether ``path`` is a run folder of ``base`` (``version_<N>``), or
    ``base`` itself holding checkpoints directly (hookloop 0.1's layout)."""
    path, base = Path(path), Path(base)
    try:
        same_base = os.path.realpath(path.parent) == os.path.realpath(base)
        is_base = os.path.realpath(path) == os.path.realpath(base)
    except OSError:
        return False
    return (same_base and bool(_RUN.match(path.name))) or is_base


def newest_run(base) -> Path | None:
    """The run folder ``resume_from="latest"`` continues: the highest
    ``version_<N>`` holding a checkpoint, else ``base`` itself if it holds
    checkpoints directly (0.1's layout), else None."""
    for folder in reversed(run_folders(base)):
        if read_latest(folder) is not None or list_checkpoints(folder):
            return folder
    base = Path(base)
    if base.is_dir() and ((base / LATEST).exists() or list_checkpoints(base)):
        return base
    return None


def next_run_name(base) -> str:
    """``version_<N>``: one more than the highest existing (0 for the first)."""
    folders = run_folders(base)
    n = int(_RUN.match(folders[-1].name).group(1)) + 1 if folders else 0
    return f"version_{n}"


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
    """The checkpoint name ``root/latest`` holds (None: no such file, or
    empty). A name that is not one directory entry of ``root`` (an absolute
    path, ``..``, a path with separators) or text that is not UTF-8 is a
    :class:`CheckpointError`: ``latest`` is never followed outside its root."""
    file = Path(root) / LATEST
    try:
        raw = file.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read {str(file)!r}: {type(exc).__name__}: {exc}") from exc
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(
            f"{str(file)!r} is not UTF-8 text ({len(raw)} bytes starting {raw[:16]!r}): it is "
            "corrupt. Delete it, or write the name of a checkpoint in that directory into it "
            "(resume_from='latest' then uses it)"
        ) from None
    if not name:
        return None
    if (name in (".", "..") or "/" in name or "\\" in name or "\0" in name
            or os.path.isabs(name) or "\n" in name):
        raise CheckpointError(
            f"{str(file)!r} holds {name[:200]!r}, which is not the name of a checkpoint in "
            f"{str(root)!r} (an absolute path, '..' or a path with separators): refusing to "
            "follow it out of the checkpoint root. Write the name of one of its checkpoints "
            "into it, or delete it"
        )
    return name


def resolve(resume_from, root) -> Path | None:
    """The checkpoint directory ``resume_from`` names.

    ``"latest"``: the checkpoint ``root/latest`` names; if it cannot be
    loaded (missing, truncated, a checksum mismatch, a file that does not
    deserialise, non-finite values), the newest loadable one in ``root``,
    with a warning naming the file that failed; ``None`` if nothing was ever
    saved there (a first run). A checkpoint root given as a path resolves the
    same way, except that finding nothing is an error. Any other path is
    returned as it is (:func:`load` checks it, and raises naming the file).

    Finding the newest *loadable* checkpoint reads it: every file is read
    once, its checksum verified and its content deserialised into memory,
    and kept for the :func:`load` that follows (so it is not read twice).
    With several processes every one calls this, and they skip the same
    checkpoints (one that fails on any process is skipped by all).
    """
    _STAGED.clear()
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
    candidates = list_checkpoints(root)
    order = [root / name] if name is not None else []
    order += [c for c in reversed(candidates) if c.name != name]
    problems = []
    for candidate in order:
        error, staged = None, None
        try:
            staged = stage(candidate)
        except CheckpointError as exc:
            error = str(exc)
        error = _agreed_error(error)  # every process skips the same checkpoints
        if error is None:
            _STAGED[os.path.realpath(candidate)] = staged
            if len(problems) > 1 or (problems and name is None):
                warnings.warn(
                    f"hookloop: resuming from {candidate}; newer checkpoints are not usable: "
                    + "; ".join(problems[1 if name is not None else 0:]),
                    RuntimeWarning,
                    stacklevel=3,
                )
            return candidate
        if name is not None and not problems and len(order) > 1:
            warnings.warn(
                f"hookloop: {root / LATEST} names {name!r}, which is not usable ({error}); "
                "resuming from the newest usable checkpoint instead",
                RuntimeWarning,
                stacklevel=3,
            )
        problems.append(error)
    if lenient and name is None and not candidates:
        return None
    raise CheckpointError(
        f"resume_from={str(resume_from)!r}: no usable checkpoint in {root} "
        f"(found {', '.join(p.name for p in candidates) or 'none'})"
        + "".join(f"; {p}" for p in problems)
    )


#: what :func:`resolve` staged for the :func:`load` that follows: realpath -> Staged
_STAGED: dict = {}


def checkpoint_plugins(loop) -> list:
    """The :class:`~hookloop.plugins.Checkpoint` plugins of ``loop`` (found
    by type, whatever their names), in call order: the first one given in
    ``plugins=[...]`` first."""
    from .plugins.checkpoint import Checkpoint

    found = [p for _, p in loop.plugins.pm.list_name_plugin() if isinstance(p, Checkpoint)]
    return found[::-1]  # pluggy calls the last registered first; user plugins are registered reversed


def best_checkpoints(loop, root, key: str, mode: str, k: int | None = None,
                     extra: tuple | None = None, mine: bool = True) -> list[tuple[float, Path]]:
    """The checkpoints in ``root`` whose manifest records a value of metric
    ``key`` (``save(monitor=...)``), best first (``mode`` ``"min"`` or
    ``"max"``; the newer first among equal values), at most ``k``; only
    this run's (:func:`owns`) unless ``mine`` is False. ``extra``: a
    ``(value, path)`` not written yet, ranked with them."""
    found = []
    for path in list_checkpoints(root):
        doc = _peek(path) or {}
        mon = doc.get("monitor") or {}
        value = mon.get("value")
        if (mon.get("key") == key and isinstance(value, (int, float)) and math.isfinite(value)
                and (not mine or owns(loop, root, path))):
            found.append((float(mon["value"]), path))
    if extra is not None:
        found = [f for f in found if f[1].name != extra[1].name] + [extra]
    order = {p.name: i for i, p in enumerate(sorted((p for _, p in found), key=_sort_key))}
    sign = 1.0 if mode == "min" else -1.0
    found.sort(key=lambda vp: (sign * vp[0], -order[vp[1].name]))
    return found[:k] if k is not None else found


def checkpoint_root(loop) -> Path:
    """Where ``resume_from="latest"`` looks: the directory of the first
    ``Checkpoint`` plugin (by type), else :func:`default_directory`."""
    plugins = checkpoint_plugins(loop)
    if plugins:
        return plugins[0].directory(loop)
    legacy = loop.plugins.get("checkpoint")  # a plugin of another class named "checkpoint"
    if legacy is not None and callable(getattr(legacy, "directory", None)):
        return legacy.directory(loop)
    base = default_directory(loop.accelerator)
    return newest_run(base) or base


# ---------------------------------------------------------------------------
# runs: which checkpoints in a directory a run may replace and rotate away
# ---------------------------------------------------------------------------


@dataclass
class RunIdentity:
    """Which run a loop continues: ``id`` is recorded in every checkpoint's
    manifest (``run_id``); a resumed run inherits the id of the checkpoint it
    resumed. ``resumed_root`` is the real path of that checkpoint's root
    (None: the run started from scratch); ``legacy``: it had no run id (a
    hookloop 0.1 checkpoint)."""

    id: str
    resumed_root: str | None = None
    legacy: bool = False


def run_identity(loop) -> RunIdentity:
    """The loop's :class:`RunIdentity` (a new id for a run from scratch)."""
    run = loop.__dict__.get("_checkpoint_run")
    if run is None:
        import uuid

        run = loop.__dict__["_checkpoint_run"] = RunIdentity(uuid.uuid4().hex)
    return run


def _peek(path: Path) -> dict | None:
    """``hookloop.json`` as JSON, unchecked; None if unreadable."""
    try:
        doc = json.loads((Path(path) / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def owns(loop, root, path) -> bool:
    """Whether checkpoint ``path`` in ``root`` belongs to ``loop``'s run: it
    carries the run's id and was written in ``root`` (a copy carried from
    elsewhere is not), or the run resumed from a checkpoint of ``root``
    (then every checkpoint of that run there is its own). A checkpoint
    without a run id (hookloop 0.1) belongs to a run that resumed one such
    in ``root``."""
    run = run_identity(loop)
    doc = _peek(path)
    if doc is None:
        return False
    here = os.path.realpath(root)
    rid = doc.get("run_id")
    if rid is None:
        return run.legacy and run.resumed_root == here
    return rid == run.id and (doc.get("root") == here or run.resumed_root == here)


def foreign_checkpoints(loop, root) -> list[Path]:
    """The checkpoints in ``root`` that do not belong to ``loop``'s run
    (:func:`owns`): never replaced, never rotated away."""
    return [p for p in list_checkpoints(root) if not owns(loop, root, p)]


def describe_run(path) -> str:
    doc = _peek(path)
    if doc is None:
        return "unreadable manifest"
    rid = doc.get("run_id")
    return f"run {rid[:8]}" if rid else "no run id: hookloop 0.1"


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
    required = ("loop", "networks", "accelerate", "plugins", "files", "num_processes")
    if doc["version"] >= 2:
        required += ("crc32", "run_id", _SELF_CRC)
    for key in required:
        if key not in doc:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: {STATE_FILE} lacks {key!r}: the checkpoint is corrupt"
            )
    if doc["version"] >= 2 and doc[_SELF_CRC] != _manifest_crc(doc):
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {STATE_FILE} does not match its own checksum "
            f"({_SELF_CRC}): it changed after it was written (bit rot, or an edit)"
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


def _manifest_crc(doc: dict) -> int:
    """The CRC-32 of the manifest without its own checksum, canonically dumped."""
    import zlib

    body = {k: v for k, v in doc.items() if k != _SELF_CRC}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8"))


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
    classes = doc.get("classes") or {}
    for name, net in loop.networks.items():
        for part in ("optimizer", "scheduler"):
            file = now[name][part]
            if file is None or file not in classes:
                continue
            current = _class_name(getattr(net, part))
            if classes[file] != current:
                raise CheckpointError(
                    f"{where}: network {name!r}: {file} holds the state of a "
                    f"{_short(classes[file])} {part} ({classes[file]}), but this network's {part} is "
                    f"a {_short(current)} ({current}): the state of one does not fit the other. "
                    f"Resume with the {part} the checkpoint was written with"
                )
    owner = {entry["model"]: name for name, entry in now.items()}
    for index, model in enumerate(acc._models):
        file = _model_file(index)
        _check_shapes(path / file, model, owner.get(file, f"accelerator model #{index}"), where)

    messages = []
    saved_settings = doc.get("settings") or {}
    current_settings = run_settings(loop)
    differ = []
    for key, was in saved_settings.items():
        now_value = current_settings.get(key)
        if key == "num_processes" or was is None or now_value is None or was == now_value:
            continue
        differ.append(f"{key}={was!r} (this run has {key}={now_value!r}: "
                      f"{_SETTINGS.get(key, 'the data order or the step count would differ')})")
    if differ:
        msg = (f"{where} was written with other settings than this run's, which decide the data "
               f"order and the step count: {'; '.join(differ)}")
        if strict:
            raise CheckpointError(msg + ". The resumed run would not continue the saved one; pass "
                                  "strict=False to resume anyway (with a warning)")
        messages.append(msg + ". Resuming anyway (strict=False)")
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


#: what each recorded run setting decides (shown when a resume differs)
_SETTINGS = {
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
    if data is None:
        return None
    obj = getattr(data, "batch_sampler", None) or getattr(data, "sampler", None)
    for _ in range(6):
        inner = getattr(obj, "batch_sampler", None) or getattr(obj, "sampler", None)
        if inner is None:
            break
        obj = inner
    return type(obj).__name__ if obj is not None else None


def _class_name(obj) -> str:
    """The class of an optimizer or scheduler, unwrapped from Accelerate's."""
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler

    inner = None
    if isinstance(obj, AcceleratedOptimizer):
        inner = obj.optimizer
    elif isinstance(obj, AcceleratedScheduler):
        inner = obj.scheduler
    cls = type(inner if inner is not None else obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _short(qualified: str) -> str:
    return qualified.rsplit(".", 1)[-1]


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


def _parse_rank_file(data: bytes):
    """``(epoch_start, generators_now)`` from a rank file's bytes, every
    random state checked by loading it into a scratch generator (a garbled
    one fails here, not inside ``random.setstate`` during ``fit``)."""
    from safetensors.torch import load as load_bytes

    tensors = load_bytes(data)
    size = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:8 + size]).get("__metadata__") or {}
    epoch = None
    if "epoch.torch" in tensors:
        epoch = {
            "rng": _rng_from_tensors("epoch", tensors, meta),
            "generators": {k[len("epoch.gen."):]: v for k, v in tensors.items()
                           if k.startswith("epoch.gen.")},
        }
        _check_rng(epoch["rng"]["python"], epoch["rng"]["numpy"], epoch["rng"]["torch"])
        for state in epoch["generators"].values():
            torch.Generator().set_state(state)
    now = {k[len("now.gen."):]: v for k, v in tensors.items() if k.startswith("now.gen.")}
    for state in now.values():
        torch.Generator().set_state(state)
    return epoch, now


def _check_rng(python, numpy, torch_state) -> None:
    """Load random states into scratch generators: raises if any is not valid."""
    random.Random().setstate(python)
    np.random.RandomState().set_state(numpy)
    torch.Generator().set_state(torch_state)


# ---------------------------------------------------------------------------
# finiteness: no checkpoint of NaN or infinite weights
# ---------------------------------------------------------------------------


def first_nonfinite(tensors) -> int | None:
    """The index of the first tensor in ``tensors`` holding a NaN or an
    infinity, or None.

    One fused reduction (``torch._foreach_norm``: multi-tensor kernels on a
    GPU) and one device sync per device and dtype; a norm that overflowed on
    finite values is confirmed element-wise before it counts. ~25 ms for the
    68 M floats of MiniLM-L6 with Adam (one CPU thread); ``isfinite().all()``
    per tensor took ~670 ms.
    """
    tensors = list(tensors)
    if not tensors:
        return None
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    suspects = []
    for index in groups.values():
        group = [tensors[i] for i in index]
        try:
            norms = torch._foreach_norm(group)
        except (RuntimeError, TypeError, AttributeError, NotImplementedError):  # an exotic dtype
            norms = [t.float().sum() for t in group]
        ok = torch.stack([n.reshape(()) for n in norms]).isfinite()
        if not bool(ok.all()):
            suspects += [index[j] for j in (~ok).nonzero().flatten().tolist()]
    for i in sorted(suspects):
        if not bool(tensors[i].isfinite().all()):
            return i
    return None


def _state_tensors(loop):
    """``(network, what, tensor)`` for every floating tensor of every
    network's parameters, buffers and optimizer state."""
    seen = set()
    for name, net in loop.networks.items():
        model = net.unwrapped if net.unwrapped is not None else net.model
        names = {}
        for label, items in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
            for key, t in items:
                names[id(t)] = key
                if id(t) in seen or not (t.is_floating_point() or t.is_complex()):
                    continue
                seen.add(id(t))
                yield name, f"{label} {key!r}", t.detach()
        optimizer = getattr(net.optimizer, "optimizer", net.optimizer)
        for param, state in (getattr(optimizer, "state", None) or {}).items():
            for key, value in state.items():
                if (isinstance(value, torch.Tensor) and id(value) not in seen
                        and (value.is_floating_point() or value.is_complex())):
                    seen.add(id(value))
                    yield (name, f"optimizer state {key!r} of parameter "
                                 f"{names.get(id(param), '?')!r}", value.detach())


def first_nonfinite_update(loop, after: int = 0):
    """``(update, network, what)``: the first update after ``after`` that a
    plugin saw go non-finite (``GradClip`` records each update whose gradient
    norm was NaN or infinite, keeping the norm as a tensor: no sync), or None."""
    found = []
    for _, plugin in loop.plugins.pm.list_name_plugin():
        ask = getattr(plugin, "first_nonfinite_update", None)
        if callable(ask):
            record = ask(after=after)
            if record is not None:
                found.append(tuple(record))
    return min(found, default=None)


def _refuse_nonfinite(loop, root: Path, name: str, step: int):
    """A :class:`NonFiniteCheckpoint` to raise instead of saving ``name``,
    or None if every parameter and optimizer state is finite."""
    items = list(_state_tensors(loop))
    bad = first_nonfinite(t for *_, t in items)
    if bad is None:
        return None
    network, what, tensor = items[bad]
    flat = tensor.detach().reshape(-1)
    value = flat[~flat.isfinite()][0].item()
    latest = None
    with contextlib.suppress(CheckpointError):
        latest = read_latest(root)
    last_ok = ((_peek(root / latest) or {}).get("loop") or {}).get("global_step", 0) if latest else 0
    first = first_nonfinite_update(loop, after=last_ok)
    if first is not None:
        when = f"The values first went bad at update {first[0]} ({first[2]}). "
    else:
        when = ("Where they first went bad is not known: GradClip(max_norm=...) records the first "
                "update whose gradient norm was not finite, at no cost. ")
    kept = (f"{root / LATEST} still names {latest}, the last finite checkpoint. " if latest
            else "No finite checkpoint exists in that directory. ")
    return NonFiniteCheckpoint(
        f"refusing to save checkpoint {name} after step {step}: network {network!r} {what} is "
        f"not finite ({value}). {when}Nothing was written and nothing rotated away; {kept}"
        "Lower the learning rate, clip gradients or check the data, then resume with "
        "resume_from='latest'.",
        network=network, tensor=what, step=step, first_bad=first,
    )


# ---------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------


def save(loop, root, *, reason: str, epoch_end: bool = False, name: str | None = None,
         update_latest: bool = True, keep_last: int | None = None, monitor: dict | None = None,
         keep=()) -> Path:
    """Write a checkpoint of ``loop`` into ``root`` atomically; every process
    must call this (each writes its random states). Returns its directory.

    :param epoch_end: the loop is in ``on_epoch_end``, after the epoch's
        evaluation: record the position as the start of the next epoch, so
        that a resumed run does not evaluate this epoch again.
    :param name: default ``step-<global_step>`` (``-epoch-end``).
    :param update_latest: point ``root/latest`` at it (False for emergency
        checkpoints, which may be taken in the middle of a step).
    :param keep_last: afterwards, delete all but the newest ``keep_last``
        regular checkpoints of this run (:func:`owns`; never the one
        ``latest`` names, never the newest finite one, never another run's).
    :param monitor: recorded in the manifest (``monitor``): the value of a
        metric this checkpoint was evaluated at, ``{"key", "value", "mode"}``;
        :func:`best_checkpoints` ranks checkpoints by it.
    :param keep: names rotation never deletes (the best ``save_top_k``).

    Refused before anything is written, on every process: a non-finite
    parameter or optimizer state (:class:`NonFiniteCheckpoint`, naming the
    network, the tensor and, when a plugin recorded it, the first update
    whose gradient norm was not finite); plugin state that is not data; a
    name held by another run's checkpoint. A full disk is reported as
    ``no space left on <dir>``.
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

    error = _refuse_nonfinite(loop, root, name, position["global_step"])  # every rank: its own memory
    plugins, tensors = {}, {}
    if main and error is None:
        try:  # refuse state that is not data before anything is written
            plugins = {n: to_data(s, tensors, f"plugins/{n}", f"plugin {n!r}: state_dict()")
                       for n, s in states.items()}
            if final.exists() and not owns(loop, root, final):
                raise CheckpointError(
                    f"not saving {final}: a checkpoint of another run ({describe_run(final)}) has "
                    "that name, and this run replaces only its own. Give Checkpoint(dir=...) "
                    "another directory, or move that checkpoint away"
                )
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except CheckpointError as exc:
            error = str(exc)
        except OSError as exc:
            error = _write_error(exc, root, f"cannot create {tmp}")
    _all_ok(acc, error)

    try:
        error = None
        try:
            with _manual_naming(acc):
                acc.save_state(str(tmp))
            _write_rank_file(tmp / RANK_FILE.format(rank=acc.process_index), loop)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = _write_error(exc, root, f"process {acc.process_index} could not write into {tmp}")
        _all_ok(acc, error)

        if main:
            try:
                _finish(loop, tmp, final, position, networks, plugins, tensors, reason, monitor)
                if update_latest:
                    _point_latest(root, name)
                if keep_last:
                    _rotate(loop, root, keep_last, keep)
            except Exception as exc:  # noqa: BLE001
                error = _write_error(exc, root, f"cannot finish checkpoint {final}")
        _all_ok(acc, error)
    except CheckpointError:
        if main:  # a failed save leaves nothing behind; the previous checkpoint stays latest
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _finish(loop, tmp: Path, final: Path, position, networks, plugins, tensors, reason,
            monitor=None) -> None:
    """Main process: hookloop's files, fsync, rename into place."""
    from safetensors.torch import save_file

    import accelerate

    from . import __version__

    save_file(tensors, str(tmp / TENSORS_FILE), metadata={"format": FORMAT})
    files, crcs = {}, {}
    for file in sorted(tmp.rglob("*")):
        if file.is_file():
            _fsync_file(file)
            rel = file.relative_to(tmp).as_posix()
            files[rel] = file.stat().st_size
            crcs[rel] = _crc32_file(file)  # read back from the page cache
    classes = {}  # optimizer.bin -> its optimizer's class, for a clear error on resume
    for name, net in loop.networks.items():
        for part in ("optimizer", "scheduler"):
            if networks[name].get(part):
                classes[networks[name][part]] = _class_name(getattr(net, part))
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
        "crc32": crcs,
        "run_id": run_identity(loop).id,
        "root": os.path.realpath(final.parent),
        "settings": run_settings(loop),
        "classes": classes,
        "checks": {"finite": True},  # save() refused non-finite state before writing
    }
    if monitor is not None:
        doc["monitor"] = monitor
    doc[_SELF_CRC] = _manifest_crc(doc)
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


def _rotate(loop, root: Path, keep_last: int, protected=()) -> None:
    """Delete this run's oldest checkpoints beyond ``keep_last`` (another
    run's, or ones without a run id, are never deleted); never the one
    ``latest`` names, never the newest one known to be finite, never one
    ``protected`` names (the best ``save_top_k``)."""
    keep = {read_latest(root), *protected}
    mine = [p for p in list_checkpoints(root) if owns(loop, root, p)]
    finite = [p for p in mine if ((_peek(p) or {}).get("checks") or {}).get("finite")]
    if finite:
        keep.add(finite[-1].name)
    for path in mine[: max(0, len(mine) - keep_last)]:
        if path.name in keep:
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


def _all_ok(acc, error) -> None:
    """A barrier that also tells every rank whether any failed, so that all
    raise together instead of some waiting forever. ``error``: None, a
    message, or an exception (raised as it is on the rank that had it)."""
    local = error if isinstance(error, BaseException) else None
    if acc.num_processes > 1:
        from accelerate.utils import gather_object

        errors = [e for e in gather_object([None if error is None else str(error)]) if e]
        error = errors[0] if errors else None
    if local is not None:
        raise local
    if error:
        raise CheckpointError(error)


def _agreed_error(error: str | None) -> str | None:
    """:func:`_all_ok` without an accelerator at hand (from the process
    state): the first error of any process, or None."""
    from accelerate.state import PartialState

    if PartialState._shared_state.get("num_processes", 1) > 1:
        from accelerate.utils import gather_object

        errors = [e for e in gather_object([error]) if e]
        return errors[0] if errors else None
    return error


def _process_index() -> int:
    from accelerate.state import PartialState

    return PartialState._shared_state.get("process_index", 0)


def _crc32_file(path: Path) -> int:
    """CRC-32 of a file, read through a memory map (no copy)."""
    import mmap
    import zlib

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return zlib.crc32(mapped)


def _write_error(exc: BaseException, root: Path, what: str) -> str:
    """The message for a failed write: ``no space left on <dir>`` when the
    disk (or quota) is full, whatever the library that hit it said (torch's
    zip writer reports ``unexpected pos``), else the error itself."""
    import errno

    full = False
    seen, cause = set(), exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
            full = True
        cause = cause.__cause__ or cause.__context__
    free = None
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(root if root.exists() else root.parent).free
    if not full and free is not None and free < (1 << 20):
        full = True  # a write failed on a disk with less than 1 MiB left
    detail = f"{type(exc).__name__}: {exc}"
    if full:
        left = f" ({free} bytes free)" if free is not None else ""
        return (f"no space left on {root}{left}: {what} ({detail}). Free some space or give "
                "Checkpoint(dir=...) another disk; the unfinished checkpoint was removed and "
                "'latest' still names the previous one")
    return f"{what}: {detail}"


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


#: torch optimizer state entries that have their parameter's shape
_PER_PARAMETER = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                  "grad_avg", "acc_delta", "exp_inf", "prev", "sum", "ax", "mu_product_buffer"}
#: param-group entries newer torch versions added (absent from older checkpoints: fine)
_OPTIONAL_GROUP_KEYS = {"params", "foreach", "maximize", "capturable", "differentiable", "fused",
                        "decoupled_weight_decay", "initial_lr", "param_names"}


@dataclass
class Staged:
    """One process's view of a checkpoint, read, verified and deserialised
    into memory (:func:`stage`): nothing in the loop changed yet."""

    path: Path
    doc: dict
    process_index: int
    models: list
    optimizers: list
    schedulers: list
    rng: dict
    scaler: dict | None
    extra: dict  # other Accelerate files (sampler, stateful loader): verified bytes
    custom: dict  # custom_checkpoint_<i>.pkl -> ("data", state) | ("pickle", bytes)
    epoch_start: dict | None
    generators: dict
    plugin_states: dict


def stage(path, doc: dict | None = None, process_index: int | None = None) -> Staged:
    """Read every file of checkpoint ``path`` that process ``process_index``
    needs into memory: each one's size and CRC-32 checked against the
    manifest (the CRC through a memory map), then deserialised (safetensors,
    or ``torch.load`` with ``weights_only=True``), its random states tried on
    scratch generators and its weights and optimizer state checked to be
    finite. Raises :class:`CheckpointError` naming the file. Changes nothing.

    The state of objects given to ``accelerator.register_for_checkpointing``
    (``custom_checkpoint_<i>.pkl``) is deserialised the safe way too; one
    that is a real pickle is kept as bytes, for :func:`load` to refuse (or,
    if trusted by name, to unpickle)."""
    path = Path(path)
    doc = read_manifest(path) if doc is None else doc
    rank = _process_index() if process_index is None else process_index
    where = f"checkpoint {str(path)!r}"
    counts = doc["accelerate"]
    owner = {}
    for name, entry in doc["networks"].items():
        for part in ("model", "optimizer", "scheduler"):
            if entry.get(part):
                owner[entry[part]] = f"the {'weights' if part == 'model' else part + ' state'} of network {name!r}"

    def read(rel, what):  # the file, once its size and checksum are verified
        return _verified(path, rel, doc, where, what)

    models = []
    for i in range(counts["models"]):
        rel = _model_file(i)
        what = owner.get(rel, f"the weights of accelerator model #{i}")
        if rel not in doc["files"] and (f"pytorch_model{'_' + str(i) if i else ''}.bin") in doc["files"]:
            rel = f"pytorch_model{'_' + str(i) if i else ''}.bin"
            models.append(_torch_load(read(rel, what), rel, where, what))
        else:
            models.append(_safetensors_load(read(rel, what), rel, where, what))
    optimizers = []
    for i in range(counts["optimizers"]):
        rel = f"{OPTIMIZER_NAME}.bin" if i == 0 else f"{OPTIMIZER_NAME}_{i}.bin"
        what = owner.get(rel, f"the state of accelerator optimizer #{i}")
        state = _torch_load(read(rel, what), rel, where, what)
        if not (isinstance(state, dict) and isinstance(state.get("state"), dict)
                and isinstance(state.get("param_groups"), list)):
            raise CheckpointError(f"{where}: cannot read {what} from {rel}: it is not an optimizer "
                                  "state_dict (no 'state' and 'param_groups')")
        optimizers.append(state)
    schedulers = []
    for i in range(counts["schedulers"]):
        rel = f"{SCHEDULER_NAME}.bin" if i == 0 else f"{SCHEDULER_NAME}_{i}.bin"
        what = owner.get(rel, f"the state of accelerator scheduler #{i}")
        schedulers.append(_torch_load(read(rel, what), rel, where, what))

    rel = f"{RNG_STATE_NAME}_{rank}.pkl"
    what = f"the random states of process {rank}"
    rng = _torch_load(read(rel, what), rel, where, what)
    try:
        _check_rng(rng["random_state"], rng["numpy_random_seed"], rng["torch_manual_seed"])
    except Exception as exc:  # noqa: BLE001 - any invalid content
        raise CheckpointError(f"{where}: cannot read {what} from {rel}: they are not valid random "
                              f"states ({type(exc).__name__}: {exc})") from exc
    scaler = None
    if "scaler.pt" in doc["files"]:
        scaler = _torch_load(read("scaler.pt", "the gradient scaler state"), "scaler.pt", where,
                             "the gradient scaler state")
    extra = {rel: read(rel, "a data loader state").read_bytes() for rel in doc["files"]
             if re.match(r"^(sampler|dl_state_dict)(_\d+)?\.bin$", rel)}
    custom = {}
    for i in range(counts.get("custom_objects", 0)):
        rel = f"custom_checkpoint_{i}.pkl"
        what = f"the state of object #{i} registered with accelerator.register_for_checkpointing"
        data = read(rel, what).read_bytes()
        try:
            custom[rel] = ("data", _torch_load(data, rel, where, what))
        except CheckpointError:
            custom[rel] = ("pickle", data)

    rel = RANK_FILE.format(rank=rank)
    what = f"the data position of process {rank}"
    data = read(rel, what).read_bytes()
    try:
        epoch_start, generators = _parse_rank_file(data)
    except Exception as exc:  # noqa: BLE001 - garbled in any way
        raise CheckpointError(f"{where}: cannot read {what} from {rel}: {type(exc).__name__}: "
                              f"{_first_line(exc)}") from exc
    tensors = {}
    if TENSORS_FILE in doc["files"]:
        tensors = _safetensors_load(read(TENSORS_FILE, "the plugin states"), TENSORS_FILE, where,
                                    "the plugin states")
    plugin_states = {}
    for name, state in doc["plugins"].items():
        try:
            plugin_states[name] = from_data(state, tensors)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise CheckpointError(f"{where}: the state of plugin {name!r} refers to tensors that "
                                  f"{TENSORS_FILE} does not hold ({type(exc).__name__}: {exc})") from exc

    _check_staged_finite(models, optimizers, doc, where)
    return Staged(path, doc, rank, models, optimizers, schedulers, rng, scaler, extra, custom,
                  epoch_start, generators, plugin_states)


def _verified(path: Path, rel: str, doc: dict, where: str, what: str) -> Path:
    """``path / rel`` once its size and CRC-32 match the manifest."""
    problem = None
    size = doc["files"].get(rel)
    file = path / rel
    if size is None:
        problem = "the manifest does not list it"
    else:
        try:
            actual = file.stat().st_size
            crc = (doc.get("crc32") or {}).get(rel)
            if actual != size:
                problem = f"it is {actual} bytes but {size} were written: truncated or corrupt"
            elif crc is None and doc["version"] >= 2:
                problem = "the manifest has no checksum for it"
            elif crc is not None and (now := _crc32_file(file)) != crc:
                problem = (f"it does not match its checksum (CRC-32 {now:08x}, {crc:08x} when "
                           "written): the file changed after it was saved (bit rot, a bad copy, "
                           "or an edit)")
            else:
                return file
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc}"
    raise CheckpointError(f"{where}: cannot read {what} from {rel}: {problem}")


def _first_line(exc) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__


def _torch_load(source, rel: str, where: str, what: str):
    """``torch.load(weights_only=True)`` of a verified file (or its bytes), as
    Accelerate reads its files (numpy's RNG types allowed). The error never
    suggests ``weights_only=False``."""
    import io

    from accelerate.utils import load as accelerate_load

    try:
        return accelerate_load(io.BytesIO(source) if isinstance(source, bytes) else str(source),
                               map_location="cpu")
    except Exception as exc:  # noqa: BLE001
        text = str(exc)
        if "weights_only" in text or "Unpickl" in type(exc).__name__ or "Weights only" in text:
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
            detail = f": it refers to {found.group(1)}" if found else ""
            problem = ("it is corrupt, or it holds objects other than tensors and plain data, "
                       f"which hookloop never unpickles{detail}")
            raise CheckpointError(f"{where}: cannot read {what} from {rel}: {problem}") from None
        raise CheckpointError(f"{where}: cannot read {what} from {rel}: it is corrupt "
                              f"({type(exc).__name__}: {_first_line(exc)})") from None


def _safetensors_load(source, rel: str, where: str, what: str) -> dict:
    from safetensors.torch import load as load_bytes
    from safetensors.torch import load_file

    try:
        return load_bytes(source) if isinstance(source, bytes) else load_file(str(source))
    except Exception as exc:  # noqa: BLE001 - SafetensorError and friends
        raise CheckpointError(f"{where}: cannot read {what} from {rel}: it is corrupt "
                              f"({type(exc).__name__}: {_first_line(exc)})") from None


def _check_staged_finite(models, optimizers, doc, where) -> None:
    items = []
    for i, state in enumerate(models):
        items += [(_model_file(i), f"tensor {k!r}", t) for k, t in state.items()
                  if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]
    for i, state in enumerate(optimizers):
        rel = f"{OPTIMIZER_NAME}.bin" if i == 0 else f"{OPTIMIZER_NAME}_{i}.bin"
        for index, entry in state["state"].items():
            if isinstance(entry, dict):
                items += [(rel, f"state {k!r} of parameter #{index}", t) for k, t in entry.items()
                          if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]
    bad = first_nonfinite(t for *_, t in items)
    if bad is not None:
        rel, what, t = items[bad]
        flat = t.reshape(-1)
        raise CheckpointError(
            f"{where}: {rel} holds non-finite values ({what}: {flat[~flat.isfinite()][0].item()}): "
            "the weights of that run had gone NaN or infinite when it was saved"
        )


def load(loop, path, *, strict: bool = True, trust_pickles=None) -> Resume:
    """Restore ``loop`` from the checkpoint at ``path`` (every process).

    All or nothing: first the manifest is checked against the loop (number
    of processes, networks, tensor shapes, optimizer and scheduler classes,
    the run settings that decide the data order and step count, stateful
    plugins), then every file is read into memory and verified
    (:func:`stage`: sizes, checksums, deserialisation with
    ``weights_only=True``, random states, finiteness), and optimizer states
    are checked to fit their optimizers; only then are models, optimizers,
    schedulers, random states, the loop position and plugin states
    replaced. Every failure is a :class:`CheckpointError` naming the file
    (or setting, or plugin), with the loop untouched. ``strict=False``:
    plugin and run-setting mismatches only warn.

    Plugins restore after the networks (``load_state_dict``); a plugin with
    a ``load_state_dict_early(state, loop)`` method also gets its state
    before any network, optimizer or scheduler state is loaded, e.g. to add
    back the param group it added during training (if the optimizer state
    still does not fit, the param groups it added are taken out again and
    the error names the network and the checkpoint).

    :param trust_pickles: names of ``custom_checkpoint_<i>.pkl`` files
        (objects given to ``accelerator.register_for_checkpointing``) that
        may be unpickled although they are not plain data; default: the
        ``trust_pickles`` of the loop's ``Checkpoint`` plugins. Unpickling
        runs whatever code the file names: trust only files you wrote.
    """
    acc = loop.accelerator
    path = Path(path)
    staged = _STAGED.pop(os.path.realpath(path), None)  # what resolve() read already, if anything
    _STAGED.clear()
    doc = read_manifest(path)
    where = f"checkpoint {str(path)!r}"
    messages = _check_compatible(loop, path, doc, strict)
    try:
        type(loop.state)().load_state_dict(doc["loop"])  # on a scratch state: fails before any change
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{where}: the loop position in {STATE_FILE} is not valid: "
                              f"{type(exc).__name__}: {exc}") from exc
    if doc["loop"].get("step_in_epoch") and getattr(loop.train_data, "use_stateful_dataloader", False):
        raise CheckpointError(
            f"{where} stops in the middle of an epoch, and train_data is a stateful data loader "
            "(use_stateful_dataloader=True), which hookloop does not resume mid-epoch: use a "
            "plain DataLoader (hookloop redraws its order and skips the seen batches)"
        )
    if trust_pickles is None:
        trust_pickles = {name for plugin in checkpoint_plugins(loop)
                         for name in getattr(plugin, "trust_pickles", ())}
    trusted = set(trust_pickles)
    error, custom = None, []
    try:
        if staged is None or staged.process_index != acc.process_index:
            staged = stage(path, doc, acc.process_index)
        custom = _custom_states(staged, trusted, where)
        _check_optimizers(loop, staged, where, groups=False)
    except CheckpointError as exc:
        error = exc
    _all_ok(acc, error)  # every process fails together, none waits

    # plugins that must act before the optimizer state (add a param group)
    optimizers = [getattr(o, "optimizer", o) for o in acc._optimizers]
    before = [list(o.param_groups) for o in optimizers]
    error = None
    try:
        current = dict(stateful_plugins(loop))
        for name, state in staged.plugin_states.items():
            early = getattr(current.get(name), "load_state_dict_early", None)
            if callable(early):
                try:
                    early(state, loop)
                except Exception as exc:  # noqa: BLE001
                    raise CheckpointError(f"{where}: plugin {name!r} could not restore early "
                                          f"(load_state_dict_early): {type(exc).__name__}: {exc}") from exc
        _check_optimizers(loop, staged, where, groups=True)
    except CheckpointError as exc:
        error = exc
        for optimizer, groups in zip(optimizers, before):
            optimizer.param_groups[:] = groups  # undo added param groups
    _all_ok(acc, error)

    _commit(loop, staged, custom, where)
    rng = capture_rng()
    loop.state.load_state_dict(doc["loop"])
    import uuid

    loop.__dict__["_checkpoint_run"] = RunIdentity(
        doc.get("run_id") or uuid.uuid4().hex, resumed_root=os.path.realpath(path.parent),
        legacy=doc.get("run_id") is None,
    )
    current = dict(stateful_plugins(loop))
    for name, state in staged.plugin_states.items():
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
    return Resume(epoch_start=staged.epoch_start, rng=rng, generators=staged.generators, path=path)


def _custom_states(staged: Staged, trusted: set, where: str) -> list:
    import io

    out = []
    for rel, (kind, payload) in staged.custom.items():
        if kind == "data":
            out.append(payload)
        elif rel in trusted:
            try:
                out.append(torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False))
            except Exception as exc:  # noqa: BLE001
                raise CheckpointError(f"{where}: cannot unpickle {rel} (trusted by name): "
                                      f"{type(exc).__name__}: {_first_line(exc)}") from exc
        else:
            raise CheckpointError(
                f"{where}: {rel}, the state of an object registered with "
                "accelerator.register_for_checkpointing, is a pickle that does not load as plain "
                "data (tensors, numbers, strings, lists, dicts): unpickling it could run any code, "
                "so it is not loaded. If you wrote this checkpoint yourself, trust the file by "
                f"name: Checkpoint(trust_pickles=[{rel!r}]) (or checkpointing.load(..., "
                f"trust_pickles=[{rel!r}])). Better: make the object a plugin with "
                "state_dict/load_state_dict, which hookloop stores as data"
            )
    return out


def _check_optimizers(loop, staged: Staged, where: str, groups: bool) -> None:
    """Does each saved optimizer state fit its optimizer? ``groups``: the
    param groups (after early plugin restores); else the rest."""
    acc = loop.accelerator
    names = {}
    for name, entry in _describe_networks(loop).items():
        if entry.get("optimizer"):
            names[entry["optimizer"]] = name
    known_classes = bool(staged.doc.get("classes"))
    for i, opt in enumerate(acc._optimizers):
        rel = f"{OPTIMIZER_NAME}.bin" if i == 0 else f"{OPTIMIZER_NAME}_{i}.bin"
        network = names.get(rel, f"#{i}")
        inner = getattr(opt, "optimizer", opt)
        cls = type(inner).__name__
        state = staged.optimizers[i]
        saved_groups, now_groups = state["param_groups"], inner.param_groups
        if groups:
            saved_sizes = [len(g.get("params", ())) for g in saved_groups]
            now_sizes = [len(g["params"]) for g in now_groups]
            if saved_sizes != now_sizes:
                raise CheckpointError(
                    f"{where}: network {network!r}: {rel} holds {len(saved_sizes)} param group(s) of "
                    f"{saved_sizes} parameters; this network's {cls} has {len(now_sizes)} of "
                    f"{now_sizes}. A plugin that adds a param group during training (unfreezing a "
                    "backbone) must add it again before the optimizer state is restored: give it a "
                    "load_state_dict_early(state, loop) method (docs/checkpoints.md, Plugin state)"
                )
            params = [p for g in now_groups for p in g["params"]]
            ids = [k for g in saved_groups for k in g["params"]]
            for n, (key, param) in enumerate(zip(ids, params)):
                entry = state["state"].get(key)
                for name, value in (entry.items() if isinstance(entry, dict) else ()):
                    if (name in _PER_PARAMETER and isinstance(value, torch.Tensor)
                            and tuple(value.shape) != tuple(param.shape)):
                        raise CheckpointError(
                            f"{where}: network {network!r}: {rel} has optimizer state {name!r} of "
                            f"shape {list(value.shape)} for parameter #{n}, which has shape "
                            f"{list(param.shape)}: the parameters are in another order or of "
                            "another model"
                        )
        elif not known_classes:  # a 0.1 checkpoint: tell other optimizers apart by their groups
            for saved, now in zip(saved_groups, now_groups):
                missing = set(now) - set(saved) - _OPTIONAL_GROUP_KEYS
                if missing:
                    raise CheckpointError(
                        f"{where}: network {network!r}: {rel} was written by another optimizer "
                        f"than this network's {cls}: its param groups lack "
                        f"{', '.join(map(repr, sorted(missing)))}"
                    )


def _commit(loop, staged: Staged, custom: list, where: str) -> None:
    """Put the staged states into the loop's objects, as
    ``accelerator.load_state`` does (same objects, same order, same values)."""
    from accelerate.utils import DistributedType

    acc = loop.accelerator
    path = staged.path

    def apply(what, rel, fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - checked before; name the file if it still fails
            raise CheckpointError(f"{where}: restoring {what} from {rel} failed after it was "
                                  f"checked: {type(exc).__name__}: {exc}") from exc

    if acc.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED,
                                DistributedType.MEGATRON_LM):
        # sharded formats: verified above, loaded by Accelerate itself
        apply("Accelerate's state", str(path), lambda: acc.load_state(str(path)))
        return
    for hook in acc._load_model_state_pre_hook.values():
        hook(list(acc._models), str(path))
    for i, model in enumerate(acc._models):
        apply(f"the weights of accelerator model #{i}", _model_file(i),
              lambda m=model, s=staged.models[i]: _load_model_state(m, s))
    for i, opt in enumerate(acc._optimizers):
        rel = f"{OPTIMIZER_NAME}.bin" if i == 0 else f"{OPTIMIZER_NAME}_{i}.bin"
        apply("an optimizer state", rel, lambda o=opt, s=staged.optimizers[i]: o.load_state_dict(s))
    for i, scheduler in enumerate(acc._schedulers):
        rel = f"{SCHEDULER_NAME}.bin" if i == 0 else f"{SCHEDULER_NAME}_{i}.bin"
        apply("a scheduler state", rel, lambda o=scheduler, s=staged.schedulers[i]: o.load_state_dict(s))
    _commit_dataloaders(acc, staged, where)
    if acc.scaler is not None and staged.scaler is not None:
        apply("the gradient scaler state", "scaler.pt", lambda: acc.scaler.load_state_dict(staged.scaler))
    for i, (obj, state) in enumerate(zip(acc._custom_objects, custom)):
        apply(f"registered object #{i}", f"custom_checkpoint_{i}.pkl",
              lambda o=obj, s=state: o.load_state_dict(s))
    apply(f"the random states of process {staged.process_index}",
          f"{RNG_STATE_NAME}_{staged.process_index}.pkl", lambda: _restore_accelerate_rng(acc, staged.rng))


def _load_model_state(model, state: dict) -> None:
    """``safetensors.torch.load_model`` from a state dict in memory (tied
    weights are stored once)."""
    from safetensors.torch import _remove_duplicate_names

    to_removes = _remove_duplicate_names(model.state_dict(), preferred_names=state.keys())
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = set(missing)
    for group in to_removes.values():
        for name in group:
            if name in missing:
                missing.remove(name)
            else:
                unexpected.append(name)
    if missing or unexpected:
        raise RuntimeError(f"missing keys {sorted(missing)}, unexpected keys {sorted(unexpected)}")


def _commit_dataloaders(acc, staged: Staged, where: str) -> None:
    """Accelerate's sampler / stateful-loader files, where Accelerate would load them."""
    from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

    for i, dataloader in enumerate(acc._dataloaders):
        sampler_rel = "sampler.bin" if i == 0 else f"sampler_{i}.bin"
        if isinstance(getattr(dataloader, "dataset", None), IterableDatasetShard) and sampler_rel in staged.extra:
            if isinstance(dataloader.get_sampler(), SeedableRandomSampler):
                what = "a data loader's sampler"
                dataloader.set_sampler(_torch_load(staged.extra[sampler_rel], sampler_rel, where, what))
        state_rel = "dl_state_dict.bin" if i == 0 else f"dl_state_dict_{i}.bin"
        if getattr(dataloader, "use_stateful_dataloader", False) and state_rel in staged.extra:
            state = _torch_load(staged.extra[state_rel], state_rel, where, "a data loader's state")
            dataloader.load_state_dict(state)


def _restore_accelerate_rng(acc, states: dict) -> None:
    """What ``load_accelerator_state`` does with ``random_states_<rank>.pkl``."""
    if "step" in states:
        acc.step = states["step"]
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    for key, value in states.items():
        match = re.fullmatch(r"torch_(\w+)_manual_seed", key)
        backend = getattr(torch, match.group(1), None) if match else None
        if backend is not None and callable(getattr(backend, "is_available", None)) and backend.is_available():
            backend.set_rng_state_all(value)
    if "xm_seed" in states:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(states["xm_seed"])


__all__ = [
    "CheckpointError",
    "NonFiniteCheckpoint",
    "Resume",
    "RunIdentity",
    "Staged",
    "check_writable",
    "checkpoint_name",
    "checkpoint_plugins",
    "checkpoint_root",
    "clean",
    "default_directory",
    "first_nonfinite",
    "first_nonfinite_update",
    "foreign_checkpoints",
    "list_checkpoints",
    "load",
    "owns",
    "read_latest",
    "read_manifest",
    "resolve",
    "best_checkpoints",
    "run_identity",
    "run_settings",
    "save",
    "stage",
    "stateful_plugins",
]
