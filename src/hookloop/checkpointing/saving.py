"""Writing a checkpoint: refuse what must not be saved, let every rank write
its files (its format's, :mod:`.formats`) into a temporary directory, add
hookloop's files and the manifest, fsync, rename into place, point
``latest`` at it, rotate; the heavy files and everything after them in the
background when the save is asynchronous (:mod:`.writer`). A save killed at
any point leaves the previous checkpoint intact and ``latest`` naming a
complete one. Steps a test replaces are looked up at each call
(``codec.write_rank_file``, ``layout.write_latest``, ``writer.write_file``,
``finite.refuse_nonfinite``, ``writer.publish``; in an asynchronous save's
writer process, what ``HOOKLOOP_WRITER_SETUP`` replaces).
"""

from __future__ import annotations

import os
import re
import shutil
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from ..schedules import fit_record
from . import accelerate as accel
from . import codec, finite, formats, layout, manifest, writer
from .collective import every_rank
from .compat import run_settings
from .errors import CheckpointError, NonFiniteCheckpoint
from .layout import FORMAT, RANK_FILE, TENSORS_FILE, TMP_PREFIX, VERSION
from .runs import describe_run, owns
from .writer import poll, wait, write_error  # noqa: F401 - importable from here


def save(loop, root, *, reason: str, epoch_end: bool = False, name: str | None = None,
         update_latest: bool = True, keep_last: int | None = None, monitor: dict | None = None,
         keep=(), asynchronous: bool = False, on_published=None) -> Path:
    """Write a checkpoint of ``loop`` into ``root`` atomically (every process
    calls it: each writes its random states) and return its directory.

    :param epoch_end: the loop is in ``on_epoch_end``: record the position as
        the next epoch's start.
    :param name: default ``step-<global_step>`` (``-epoch-end``).
    :param update_latest: point ``root/latest`` at it (False: an emergency
        checkpoint, which may be mid-step).
    :param keep_last: afterwards, delete all but this run's newest ``keep_last``
        (never what ``latest`` names, the newest finite one, another run's).
    :param monitor: ``{"key", "value", "mode"}`` of the metric it was evaluated
        at, recorded in the manifest (best-k ranks by it).
    :param keep: names rotation never deletes (the best ``save_top_k``).
    :param asynchronous: copy the state to host memory and return; the writer
        publishes it in the background (``latest`` names the previous one
        until then). :func:`wait` (every process) waits for it and raises a
        :class:`CheckpointError` naming it if it failed; the next save waits
        for it first.
    :param on_published: called with the published directory, on the
        training thread, when the save is settled.

    Refused on every process, with nothing published: non-finite weights or
    optimizer state (:class:`NonFiniteCheckpoint`), plugin state that is not
    data, a name held by another run's checkpoint. A full disk is reported
    as ``no space left on <dir>``.
    """
    acc = loop.accelerator
    wait(loop)  # at most one save in flight: this one waits for the previous one
    root, position = Path(root), loop.state.state_dict()
    if epoch_end:
        position.update(epoch=position["epoch"] + 1, step_in_epoch=0)
    name = name or layout.checkpoint_name(position["global_step"], epoch_end)
    final, tmp = root / name, root / f"{TMP_PREFIX}{name}-{tmp_tag(loop)}"  # every rank writes into the main's
    fmt, networks, sharding = formats.of_accelerator(acc), formats.describe_networks(loop), formats.describe(loop)
    background = asynchronous and sharding is None and fmt.writes_itself
    states = {n: p.state_dict() for n, p in codec.stateful_plugins(loop)}  # every rank: may be collective
    main = acc.is_main_process

    def failed(what, refusals=False):  # an error as a write error's message (a full disk named so)
        return lambda exc: (exc if (refusals and isinstance(exc, CheckpointError))
                            or isinstance(exc, NonFiniteCheckpoint) else write_error(exc, root, what))

    # every rank checks its own memory; an asynchronous save's writer checks the copy
    refusal = None if background else finite.refuse_nonfinite(loop, root, name, position["global_step"])
    plugins: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    with every_rank(acc, catch=(CheckpointError, OSError), describe=failed(f"cannot create {tmp}", True)):
        if refusal is not None:
            raise refusal
        if main:  # refuse state that is not data before anything is written
            plugins = {n: codec.to_data(s, tensors, f"plugins/{n}", f"plugin {n!r}: state_dict()")
                       for n, s in states.items()}
            if final.exists() and not owns(loop, root, final):
                raise CheckpointError(f"not saving {final}: a checkpoint of another run ({describe_run(final)}) "
                                      "has that name, and this run replaces only its own. Give "
                                      "Checkpoint(dir=...) another directory, or move that checkpoint away")
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
    layout.mark_live(tmp)  # (layout.clean leaves it alone until the save is over)
    handed_over = False
    try:
        known, own = {}, None
        with every_rank(acc, catch=Exception, describe=failed(f"process {acc.process_index} could not write "
                                                              f"into {tmp}")):
            # as save_state does: a rank that does not see the main's folder writes into its
            # own (check_rank_files then names the ranks whose files are not shared)
            tmp.mkdir(parents=True, exist_ok=True)
            heavy = fmt.save(loop, tmp)
            if background:  # (the writer process writes the plugins' tensors too)
                snapshot = writer.host_copy(acc, heavy + ([[TENSORS_FILE, "safetensors", tensors,
                                                            {"format": FORMAT}]] if main else []))
            else:
                known = writer.write_files(tmp, heavy)  # (checksummed as they are written)
            if sharding is not None:
                own = formats.save_sharded(loop, tmp, sharding)
            codec.write_rank_file(tmp / RANK_FILE.format(rank=acc.process_index), loop)
        shards = formats.gather(acc, own or {}, sharding) if sharding is not None else None
        doc = _manifest(loop, final, position, networks, plugins, reason, monitor, shards)

        job = writer.Job(tmp, final, root, doc, tensors, loop.state.run, known={
            **known, **(shards or {}).get("known", {})},  # (shards: checksummed by the rank that wrote them)
            update_latest=update_latest, keep_last=keep_last, keep=set(keep))
        finishing = failed(f"cannot finish checkpoint {final}")
        with every_rank(acc, catch=Exception,
                        describe=lambda exc: exc if isinstance(exc, MissingRankFiles) else finishing(exc)):
            if main:
                check_rank_files(tmp, final, acc.num_processes)  # before anything is published
                if not background:
                    final = writer.finish(job)
        if not background:
            if on_published is not None:
                on_published(final)
            return final

        def explain(kind, found):  # the writer's failure, raised on the training thread
            if kind == "nonfinite":  # (the refusal a synchronous save makes)
                return _nonfinite(loop, root, name, position["global_step"], networks, found)
            return CheckpointError(f"the asynchronous save of checkpoint {str(final)!r} failed: {found}. Nothing "
                                   "was published; 'latest' still names the previous checkpoint")

        job.files, job.floating = snapshot.files, snapshot.floating
        handed_over = True  # (the writer process: main; the others are done)
        writer.start(loop, writer.Pending(final, tmp, snapshot if main else None, done=on_published,
                                          explain=explain, result=None if main else final),
                     job if main else None)
        return layout.next_generation(final) if (final.exists() and update_latest
                                                 and layout.read_latest_quietly(root) == final.name) else final
    except CheckpointError:
        # a failed save leaves nothing behind; the previous checkpoint stays latest. Another
        # rank removes its folder only where it is not the main's (no rank 0 file in it:
        # a root that is not shared), which the main process removes
        if main or (tmp.is_dir() and not (tmp / accel.rng_file(0)).exists()):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if not handed_over:
            layout.mark_live(tmp, False)


def prepare_asynchronous(loop) -> None:
    """Before the first asynchronous save of ``loop``: the host buffers its
    copy will take, allocated in the background (:func:`writer.prepare_buffers`;
    once per accelerator), when its saves are copied (the plain format, this
    process writing the models and optimizers)."""
    acc = loop.accelerator
    if not (acc.is_main_process and formats.of_accelerator(acc).writes_itself and formats.describe(loop) is None):
        return
    writer.prepare_buffers(acc, [m.state_dict() for m in accel.models(acc)]
                           + [o.state_dict() for o in accel.optimizers(acc)])


def _nonfinite(loop, root, name, step, networks, found) -> NonFiniteCheckpoint:
    """The refusal of an asynchronous save whose host copy is not finite,
    naming the network and tensor as a synchronous save does."""
    rel, key, value = found
    network = next((n for n, e in networks.items() if rel in (e.get("model"), e.get("optimizer"))), "?")
    parts = re.findall(r"\[([^\]]*)\]", key)
    what = (f"tensor {parts[0]} of {rel}" if rel.endswith(".safetensors") and len(parts) == 1
            else f"optimizer state {parts[2]} of parameter #{parts[1]} ({rel})"
            if len(parts) == 3 and parts[0] == "'state'" else f"{rel} {key}")
    return finite.refusal(loop, root, name, step, network, what, value,
                          published="It was found in the host copy before any file was written: nothing was "
                                    "published and nothing rotated away")


class MissingRankFiles(CheckpointError):
    """A rank's files are not in the folder the main process publishes."""


def check_rank_files(tmp: Path, final: Path, num_processes: int) -> None:
    """Main process: each rank's own files are in ``tmp`` (one ``stat`` each);
    else :class:`MissingRankFiles` naming the ranks, the files and the folder."""
    missing: dict[int, list[str]] = {}
    for rank in range(num_processes):
        for rel in (accel.rng_file(rank), RANK_FILE.format(rank=rank)):
            if not os.path.exists(tmp / rel):
                missing.setdefault(rank, []).append(rel)
    if missing:
        several = len(missing) > 1
        raise MissingRankFiles(
            f"cannot save checkpoint {str(final)!r}: rank{'s' if several else ''} {', '.join(map(str, missing))} "
            f"wrote {'their' if several else 'its'} files, but they are not in {str(tmp)!r}, the folder the main "
            "process publishes (missing there: " + "; ".join(f"rank {r}: {', '.join(rels)}" for r, rels in
                                                             missing.items())
            + "). A checkpoint folder must be visible to every process: a shared file system, with the same "
            "Checkpoint(dir=...) on every process. Nothing was published; 'latest' still names the previous "
            "checkpoint")


#: loop -> (its run id on this process, the agreed tag of its temporary folders)
_TAGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def tmp_tag(loop) -> str:
    """``<run id prefix>-<pid>`` of the main process: makes a run's temporary
    save folders (``.tmp-<name>-<tag>``) its own, the same on every rank
    (agreed once per loop and run id: one broadcast)."""
    run_id, cached = loop.state.run.id, _TAGS.get(loop)
    if cached is not None and cached[0] == run_id:
        return cached[1]
    tag = f"{run_id[:8]}-{os.getpid()}"
    if loop.accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        tag = broadcast_object_list([tag])[0]  # the main process's
    _TAGS[loop] = (run_id, tag)
    return tag


def _manifest(loop, final: Path, position, networks, plugins, reason, monitor=None, shards=None) -> dict:
    """The manifest of a save, at its safe point, but the files' sizes and checksums."""
    import accelerate

    classes = {networks[name][part]: accel.class_name(getattr(net, part))  # for a clear error on resume
               for name, net in loop.networks.items() for part in ("optimizer", "scheduler")
               if networks[name].get(part)}
    doc = {"format": FORMAT, "version": VERSION, "reason": reason, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "versions": {"hookloop": __version__, "torch": torch.__version__, "accelerate": accelerate.__version__},
           "num_processes": loop.accelerator.num_processes, "loop": position, "run": loop.state.run_dict(),
           "networks": networks, "accelerate": accel.counts(loop.accelerator), "plugins": plugins, "files": {},
           "crc32": {}, "checksum": manifest.CHECKSUM, "run_id": loop.state.run.id,
           "root": os.path.realpath(final.parent), "settings": run_settings(loop), "classes": classes,
           "checks": {"finite": True}}  # (save() refused non-finite state before writing)
    if (fit := fit_record(loop)) is not None:  # (a resume that extends it warns: schedules.warn_past_plan)
        doc["fit"] = fit
    if monitor is not None:
        doc["monitor"] = monitor
    if shards:
        doc["sharding"] = shards["manifest"]
    return doc
