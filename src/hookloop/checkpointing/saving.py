"""Writing a checkpoint: refuse what must not be saved, let Accelerate and
every rank write into a temporary directory, add hookloop's files and the
manifest, fsync, rename into place, point ``latest`` at it, rotate.

A save killed at any point leaves the previous checkpoint intact and
``latest`` naming a complete one. The steps that a test or a benchmark
replaces are looked up in their modules at each call
(``codec.write_rank_file``, ``layout.write_latest``, ``manifest.crc32_file``,
``finite.refuse_nonfinite``, and :func:`publish` here).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import weakref
from pathlib import Path

import torch

from .._version import __version__
from . import accelerate as accel
from . import codec, finite, formats, layout, manifest
from .collective import every_rank
from .compat import run_settings
from .errors import CheckpointError
from .layout import FORMAT, RANK_FILE, STATE_FILE, TENSORS_FILE, TMP_PREFIX, TRASH_PREFIX, VERSION
from .runs import describe_run, owns, run_identity


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
    name = name or layout.checkpoint_name(position["global_step"], epoch_end)
    final = root / name
    tmp = root / f"{TMP_PREFIX}{name}-{tmp_tag(loop)}"  # every rank writes into the main's
    networks = formats.describe_networks(loop)
    sharding = formats.describe(loop)  # None: the plain format
    states = {n: p.state_dict() for n, p in codec.stateful_plugins(loop)}  # every rank: may be collective
    main = acc.is_main_process

    def failed(what, refusals=False):  # an error as a write error's message (a full disk named so)
        return lambda exc: (exc if refusals and isinstance(exc, CheckpointError)
                            else write_error(exc, root, what))

    refusal = finite.refuse_nonfinite(loop, root, name, position["global_step"])  # every rank: its own memory
    plugins, tensors = {}, {}
    with every_rank(acc, catch=(CheckpointError, OSError),
                    describe=failed(f"cannot create {tmp}", refusals=True)):
        if refusal is not None:
            raise refusal
        if main:  # refuse state that is not data before anything is written
            plugins = {n: codec.to_data(s, tensors, f"plugins/{n}", f"plugin {n!r}: state_dict()")
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

    with layout.live_save(tmp):  # (layout.clean leaves it alone)
        try:
            with every_rank(acc, catch=Exception,
                            describe=failed(f"process {acc.process_index} could not write into {tmp}")):
                with accel.manual_naming(acc):
                    acc.save_state(str(tmp))
                own = formats.save(loop, tmp, sharding) if sharding is not None else None
                codec.write_rank_file(tmp / RANK_FILE.format(rank=acc.process_index), loop)
            shards = formats.gather(acc, own, sharding) if sharding is not None else None

            finishing = failed(f"cannot finish checkpoint {final}")
            with every_rank(acc, catch=Exception,
                            describe=lambda exc: exc if isinstance(exc, MissingRankFiles) else finishing(exc)):
                if main:
                    check_rank_files(tmp, final, acc.num_processes)  # before anything is published
                    final, replaced = _finish(loop, tmp, final, position, networks, plugins, tensors,
                                              reason, monitor, update_latest, shards)
                    if update_latest:
                        layout.write_latest(root, final.name)
                    if replaced is not None:  # an older save of this position, now that latest moved on
                        _remove(replaced)
                    if keep_last:
                        rotate(loop, root, keep_last, keep)
        except CheckpointError:
            # a failed save leaves nothing behind; the previous checkpoint stays latest. Another
            # rank removes its folder only where it is not the main's (no rank 0 file in it:
            # a root that is not shared), which the main process removes
            if main or (tmp.is_dir() and not (tmp / accel.rng_file(0)).exists()):
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


class MissingRankFiles(CheckpointError):
    """A rank's files are not in the folder the main process publishes: the
    checkpoint root is not the same folder on every process."""


def check_rank_files(tmp: Path, final: Path, num_processes: int) -> None:
    """Main process, after every rank wrote into its ``tmp``: each rank's own
    files (``random_states_<r>.pkl``, ``hookloop-rank<r>.safetensors``) are
    in this process's ``tmp``, one ``stat`` each; else
    :class:`MissingRankFiles` naming the ranks, the files and the folder."""
    missing = {}
    for rank in range(num_processes):
        for rel in (accel.rng_file(rank), RANK_FILE.format(rank=rank)):
            try:
                os.stat(tmp / rel)
            except FileNotFoundError:
                missing.setdefault(rank, []).append(rel)
    if not missing:
        return
    several = len(missing) > 1
    raise MissingRankFiles(
        f"cannot save checkpoint {str(final)!r}: rank{'s' if several else ''} "
        f"{', '.join(map(str, missing))} wrote {'their' if several else 'its'} files, but they are "
        f"not in {str(tmp)!r}, the folder the main process publishes (missing there: "
        + "; ".join(f"rank {r}: {', '.join(rels)}" for r, rels in missing.items())
        + "). A checkpoint folder must be visible to every process: a shared file system, with "
        "the same Checkpoint(dir=...) on every process. Nothing was published; 'latest' still "
        "names the previous checkpoint"
    )


#: loop -> (its run id on this process, the agreed tag of its temporary folders)
_TAGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def tmp_tag(loop) -> str:
    """``<run id prefix>-<pid>`` of the main process: what makes the names of a
    run's temporary save folders (``.tmp-<name>-<tag>``) its own, so that two
    runs (or two processes) saving into one root never share one. The same on
    every rank (each rank writes its files into the main process's folder,
    and a fresh run's id is drawn per process): agreed once per loop and run
    id, with one broadcast when there are several processes."""
    run_id = run_identity(loop).id
    cached = _TAGS.get(loop)
    if cached is not None and cached[0] == run_id:
        return cached[1]
    tag = f"{run_id[:8]}-{os.getpid()}"
    if loop.accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        tag = broadcast_object_list([tag])[0]  # the main process's
    _TAGS[loop] = (run_id, tag)
    return tag


def _finish(loop, tmp: Path, final: Path, position, networks, plugins, tensors, reason,
            monitor=None, update_latest=True, shards=None) -> tuple[Path, Path | None]:
    """Main process: hookloop's files, fsync, rename into place. Returns
    where it landed and the checkpoint it replaces (to delete once
    ``latest`` names the new one), as :func:`publish` does. ``shards``: a
    sharded format's (:func:`~.formats.gather`): the files each rank
    fsynced and checksummed itself, and the manifest's ``sharding``."""
    from safetensors.torch import save_file

    import accelerate

    save_file(tensors, str(tmp / TENSORS_FILE), metadata={"format": FORMAT})
    files, crcs = {}, {}
    known = shards["known"] if shards else {}
    for file in sorted(tmp.rglob("*")):
        if file.is_file() and (rel := file.relative_to(tmp).as_posix()) in known:
            files[rel], crcs[rel] = known[rel]  # fsynced and checksummed by the rank that wrote it
        elif file.is_file():
            layout.fsync_file(file)
            rel = file.relative_to(tmp).as_posix()
            files[rel] = file.stat().st_size
            crcs[rel] = manifest.crc32_file(file)  # read back from the page cache
    classes = {}  # optimizer.bin -> its optimizer's class, for a clear error on resume
    for name, net in loop.networks.items():
        for part in ("optimizer", "scheduler"):
            if networks[name].get(part):
                classes[networks[name][part]] = accel.class_name(getattr(net, part))
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "reason": reason,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": {"hookloop": __version__, "torch": torch.__version__,
                     "accelerate": accelerate.__version__},
        "num_processes": loop.accelerator.num_processes,
        "loop": position,
        "run": loop.state.run_dict(),
        "networks": networks,
        "accelerate": accel.accelerate_counts(loop.accelerator),
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
    if shards:
        doc["sharding"] = shards["manifest"]
    doc[manifest.SELF_CRC] = manifest.manifest_crc(doc)
    with open(tmp / STATE_FILE, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    layout.fsync_dir(tmp)
    return publish(tmp, final, keep_existing=update_latest)


def publish(tmp: Path, final: Path, keep_existing: bool = True) -> tuple[Path, Path | None]:
    """Rename the finished save into place; returns ``(where it is, the
    checkpoint it replaces or None)``.

    A complete checkpoint is never moved away before its replacement is in
    place: when one of the same name exists and ``latest`` names it (and
    ``keep_existing``), the new save takes the next free generation of the
    name (``step-00000040.1``) and the old one is returned, to be deleted
    once ``latest`` names the new one. One that ``latest`` does not name is
    moved aside and replaced (a directory cannot be renamed over a full one);
    killed in between, ``latest`` still names a complete checkpoint."""
    root = final.parent
    if final.exists():
        named = keep_existing and read_latest_quietly(root) == final.name
        if named:
            new = layout.next_generation(final)
            os.rename(tmp, new)
            layout.fsync_dir(root)
            return new, final
        trash = final.with_name(f"{TRASH_PREFIX}{final.name}-{os.getpid()}")
        os.rename(final, trash)
        os.rename(tmp, final)
        layout.fsync_dir(root)
        shutil.rmtree(trash, ignore_errors=True)
        return final, None
    os.rename(tmp, final)
    layout.fsync_dir(root)
    return final, None


def read_latest_quietly(root: Path) -> str | None:
    """``latest``'s checkpoint name, or None if it cannot be read."""
    try:
        return layout.read_latest(root)
    except CheckpointError:
        return None


def _remove(path: Path) -> None:
    """Delete a checkpoint directory: renamed first, so that a kill during
    the deletion never leaves a valid name on a half-deleted directory."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def rotate(loop, root: Path, keep_last: int, protected=()) -> None:
    """Delete this run's oldest checkpoints beyond ``keep_last`` (another
    run's, or ones without a run id, are never deleted); never the one
    ``latest`` names, never the newest one known to be finite, never one
    ``protected`` names (the best ``save_top_k``)."""
    keep = {layout.read_latest(root), *protected}
    mine = [p for p in layout.list_checkpoints(root) if owns(loop, root, p)]
    finite_ones = [p for p in mine if ((manifest.peek(p) or {}).get("checks") or {}).get("finite")]
    if finite_ones:
        keep.add(finite_ones[-1].name)
    for path in mine[: max(0, len(mine) - keep_last)]:
        if path.name in keep:
            continue
        _remove(path)


def write_error(exc: BaseException, root: Path, what: str) -> str:
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
