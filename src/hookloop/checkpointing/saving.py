"""Saving, and the runs a root holds.

:func:`save`: refuse what must not be saved, let every rank write its files
into a temporary directory (the local part, then the collective part of a
sharded format: the processes agree after each, never around a collective),
then the main process writes the manifest, renames the directory into place
(the commit point), points ``latest`` at it and rotates; all of that after
the safe point in the writer process when the save is asynchronous
(:mod:`.writer`). A save killed at any point leaves the previous checkpoint
intact and ``latest`` naming a complete one; what fails after the rename is
a warning (:class:`~.writer.Saved`), the checkpoint published.

Runs: which checkpoints of a root are the loop's run (it may replace and
rotate only those), which are best by the metric their manifests record, the
run folders, what the I/O layer asks of a checkpoint plugin
(:class:`CheckpointPolicy`) and a root's set-up when a fit starts
(:func:`open_root`). A :class:`Scan` reads each manifest of a root once.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from ..schedules import fit_record
from ..state import RunIdentity
from . import accelerate as accel
from . import codec, finite, formats, lock, manifest, store, writer
from .runs import Scan, describe_run, owns
from .collective import every_rank
from .errors import CheckpointError, NonFiniteCheckpoint
from .stage import run_settings
from .store import FORMAT, LATEST, RANK_FILE, TENSORS_FILE, TMP_PREFIX, VERSION, list_checkpoints, sort_key
from .writer import poll, wait  # noqa: F401 - importable from here


class CheckpointPolicy:
    """Decides when, where, how many and which is best (the ``Checkpoint``
    plugin subclasses it); the checkpoint package finds its instances by type
    and asks them only what this class declares."""

    #: names of ``custom_checkpoint_<i>.pkl`` files that loading may unpickle
    trust_pickles: tuple = ()
    #: the metric the best checkpoints are ranked by (None: none)
    monitor: str | None = None
    #: the signals on which the run saves and stops (the ``preemption`` plugin acts on
    #: them), and every how many updates the processes agree on one
    signals: tuple = ()
    signal_check_every: int = 10
    #: the last checkpoint this policy published (None: none yet)
    last_saved: Path | None = None

    def directory(self, loop) -> Path:
        """The checkpoint root for ``loop``: where saves go."""
        raise NotImplementedError(f"{type(self).__name__}.directory(loop)")

    def roots(self, loop) -> list[Path]:
        """Where ``resume_from="latest"`` looks, in order; default: :meth:`directory`."""
        return [self.directory(loop)]

    def best_checkpoint(self, loop, mine: bool = True):
        """``(value, path)`` of the best checkpoint by :attr:`monitor`, or None."""
        return None

    def request(self, reason: str = "requested") -> None:
        """Save at the next safe point; ``"preempted"``: synchronously."""


def checkpoint_plugins(loop) -> list:
    """The :class:`CheckpointPolicy` plugins of ``loop``, in call order."""
    found = [p for _, p in loop.plugins.pm.list_name_plugin() if isinstance(p, CheckpointPolicy)]
    return found[::-1]  # pluggy calls the last registered first; user plugins are registered reversed


def checkpoint_roots(loop) -> list[Path]:
    """Where ``resume_from="latest"`` looks: the first checkpoint plugin's
    roots, else the default run folders."""
    plugins = checkpoint_plugins(loop)
    return plugins[0].roots(loop) if plugins else run_roots(store.default_directory(loop.accelerator))


def checkpoint_root(loop) -> Path:
    return checkpoint_roots(loop)[0]


def trusted_pickles(loop) -> set:
    return {name for plugin in checkpoint_plugins(loop) for name in plugin.trust_pickles}


def best_checkpoint_path(loop) -> Path:
    """``load_checkpoint("best")``: the best checkpoint by the ``monitor`` of
    the loop's first Checkpoint plugin that has one, whichever run wrote it."""
    plugin = next((p for p in checkpoint_plugins(loop) if p.monitor), None)
    if plugin is None:
        raise CheckpointError("load_checkpoint('best') needs a Checkpoint(monitor=...) plugin: it ranks the "
                              "checkpoints by the metric they were saved with")
    found = plugin.best_checkpoint(loop, mine=False)
    if found is None:
        raise CheckpointError(f"load_checkpoint('best'): no checkpoint in {plugin.directory(loop)} records "
                              f"{plugin.monitor!r} yet")
    return found[1]


def run_roots(base) -> list[Path]:
    """Where ``resume_from="latest"`` looks under ``base``: every
    ``version_<N>`` holding a checkpoint or a ``latest``, newest first, then
    ``base`` itself; ``[base / "version_0"]`` if none."""
    base = Path(base)
    found = [f for f in [*reversed(store.run_folders(base)), base] if (f / LATEST).exists() or list_checkpoints(f)]
    return found or [base / "version_0"]


def take_run_folder(base, owner, run_id: str):
    """``(folder, lock)`` of a fresh run under ``base``: the newest
    ``version_<N>`` if all it holds is what a dead run left (a stale lock,
    unfinished saves: taken over, as the same command continues), else a new
    one, created atomically."""
    folders = store.run_folders(base)
    if folders and not list_checkpoints(folders[-1]) and not (folders[-1] / LATEST).exists():
        info = lock.read_lock(folders[-1])
        if info is not None and not info.live:  # (a folder just claimed has no lock yet: not taken)
            try:
                return folders[-1], lock.acquire(folders[-1], run_id, owner=owner)
            except CheckpointError:
                pass  # taken over by another process meanwhile: a new folder
    folder = store.claim_run_folder(base)
    return folder, lock.acquire(folder, run_id, owner=owner)


# -- which checkpoints are this run's --------------------------------------------------


def adopt_run(loop, path: Path, doc: dict) -> None:
    """The loop continues the run of checkpoint ``path`` (manifest ``doc``)."""
    loop.state.run = RunIdentity(doc["run_id"], resumed_root=os.path.realpath(path.parent))


def open_root(loop, root: Path, owner, resumed=None, keep_last: int | None = None, best=None):
    """Main process, when a fit starts in ``root``: check it is writable, hold
    it (a live run's is refused), remove what dead saves left, refuse (or warn
    about) checkpoints not this run's and, for a resumed run, rotate what a
    run killed after its last save did not. ``resumed``: ``(path, manifest)``
    of the checkpoint the run resumed from, not read again; it and every
    checkpoint after it are kept, with the ``best`` (``(key, mode, k)``) ones.
    Returns ``(lock, scan)``."""
    store.check_writable(root)
    held = lock.acquire(root, loop.state.run.id, owner=owner)
    try:
        store.clean(root)  # with the lock: every other temporary is a dead run's
        scan = Scan(root, known=dict([resumed]) if resumed else {})
        if foreign := scan.foreign(loop.state.run):
            _refuse_foreign(loop, root, foreign)
        if resumed is not None and Path(resumed[0]).parent.resolve() == Path(root).resolve():
            path = Path(resumed[0])
            mine = sort_key(path) if store.NAME_PATTERN.match(path.name) else None
            newer = [p.name for p, _ in scan.found if mine is not None and sort_key(p) > mine]
            if newer:
                warnings.warn(f"Checkpoint: resumed from {path.name}, but {root} also holds newer checkpoints "
                              f"({', '.join(newer)}) of the run that went on from there: this run's checkpoints "
                              "will replace them, and rotation may delete them", RuntimeWarning, stacklevel=3)
            if keep_last:
                best_ones = {p.name for _, p in scan.best(loop.state.run, *best)} if best else set()
                scan.rotate(loop.state.run, keep_last, {*newer, *best_ones}, latest=path.name)
        return held, scan
    except BaseException:
        held.release(owner=owner)
        raise


def _refuse_foreign(loop, root, foreign) -> None:
    """Checkpoints in ``root`` that are not this run's: a run from scratch,
    or resumed from another directory, would replace and rotate them away:
    refused. A run resumed from this directory leaves them alone, with a warning."""
    names, runs = ", ".join(p.name for p in foreign[-3:]), ", ".join(sorted({describe_run(p) for p in foreign}))
    run = loop.state.run
    if run.resumed_root is None:
        raise CheckpointError(f"{str(root)!r} already holds checkpoints of a run ({names}) and this run starts "
                              "from scratch: its checkpoints would replace them. Continue that run with "
                              "resume_from='latest', or give Checkpoint(dir=...) another directory.")
    if run.resumed_root != os.path.realpath(root):
        raise CheckpointError(
            f"{str(root)!r} holds checkpoints that are not this run's ({names}; {runs}), and this run resumed "
            f"from {str(loop.resumed_from)!r}, in another directory: its checkpoints would be mixed with them, "
            "replace them and rotate them away. Resume from that directory's own checkpoints "
            "(resume_from='latest' with this dir), or give Checkpoint(dir=...) an empty directory.")
    warnings.warn(f"Checkpoint: {root} also holds {len(foreign)} checkpoint(s) that are not this run's ({names}; "
                  f"{runs}): they are left alone, never replaced or rotated away", RuntimeWarning, stacklevel=4)


# -- a save --------------------------------------------------------------------------------


def save(loop, root, *, reason: str, epoch_end: bool = False, name: str | None = None,
         update_latest: bool = True, keep_last: int | None = None, monitor: dict | None = None,
         best=None, asynchronous: bool = False, on_published=None) -> Path:
    """Write a checkpoint of ``loop`` into ``root`` atomically (every process
    calls it: each writes its random states) and return where it lands.

    :param epoch_end: the loop is in ``on_epoch_end``: record the position as
        the next epoch's start.
    :param name: default ``step-<global_step>`` (``-epoch-end``).
    :param update_latest: point ``root/latest`` at it (False: an emergency
        checkpoint, which may be mid-step).
    :param keep_last: afterwards, delete all but this run's newest ``keep_last``
        (never what ``latest`` names, the newest finite one, another run's,
        the ``best`` ones).
    :param monitor: ``{"key", "value", "mode"}`` of the metric it was evaluated
        at, recorded in the manifest; ``best``: ``(key, mode, k)``, the best
        k by it kept by rotation and named in the result.
    :param asynchronous: copy the state to host memory and return; the writer
        process publishes it in the background (:func:`~.writer.wait` waits
        for it and raises a :class:`CheckpointError` naming it if it failed;
        the next save waits for it first).
    :param on_published: called with the :class:`~.writer.Saved`, on the
        training thread, when the save is settled.

    Refused on every process, with nothing published: non-finite weights or
    optimizer state (:class:`NonFiniteCheckpoint`), plugin state that is not
    data, a name held by another run's checkpoint. A full disk is reported
    as ``no space left on <dir>``.
    """
    acc = loop.accelerator
    writer.wait(loop)  # at most one save in flight: this one waits for the previous one
    root, position = Path(root), loop.state.state_dict()
    if epoch_end:
        position.update(epoch=position["epoch"] + 1, step_in_epoch=0)
    final = root / (name or store.checkpoint_name(position["global_step"], epoch_end))
    tmp = root / f"{TMP_PREFIX}{final.name}-{tmp_tag(loop)}"  # every rank writes into the main's
    fmt, networks, sharding = formats.of_accelerator(acc), formats.describe_networks(loop), formats.describe(loop)
    background = asynchronous and sharding is None and fmt.writes_itself
    states = {n: p.state_dict() for n, p in codec.stateful_plugins(loop)}  # every rank: may be collective
    main = acc.is_main_process

    def failed(what, refusals=False):  # an error as a write error's message (a full disk named so)
        return lambda exc: (exc if (refusals and isinstance(exc, CheckpointError))
                            or isinstance(exc, NonFiniteCheckpoint) else writer.write_error(exc, root, what))

    # every rank checks its own memory; an asynchronous save's writer checks the copy
    refusal = None if background else finite.refuse_nonfinite(loop, root, final.name, position["global_step"])
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
    # the landing: the next generation of the name when latest names a checkpoint of it (never renamed over)
    landing = store.next_generation(final) if (update_latest and final.exists()
                                               and store.read_latest_quietly(root) == final.name) else final
    store.mark_live(tmp)  # (store.clean leaves it alone until the save is over)
    handed_over, known, own, snapshot = False, {}, None, None
    try:
        # each rank's own files, then the agreement: no rank is inside a collective yet
        with every_rank(acc, catch=Exception,
                        describe=failed(f"process {acc.process_index} could not write into {tmp}")):
            # as save_state does: a rank that does not see the main's folder writes into its
            # own (check_rank_files then names the ranks whose files are not shared)
            tmp.mkdir(parents=True, exist_ok=True)
            if fmt.writes_itself:
                heavy = accel.heavy_states(acc, tmp)
                accel.save_small_files(acc, tmp)
                if background:  # (the writer process writes the plugins' tensors too)
                    snapshot = writer.host_copy(acc, heavy + ([[TENSORS_FILE, "safetensors", tensors,
                                                                {"format": FORMAT}]] if main else []))
                else:
                    known = writer.write_files(tmp, heavy)  # (checksummed as they are written)
            codec.write_rank_file(tmp / RANK_FILE.format(rank=acc.process_index), loop)
        # the collectives (Accelerate's sharded save_state, DCP), then the agreement: a rank
        # failing inside DCP fails on every rank (DCP gathers the errors itself)
        if not fmt.writes_itself or sharding is not None:
            with every_rank(acc, catch=(Exception, _collective_failure()),
                            describe=failed(f"process {acc.process_index} could not write its shards into {tmp}")):
                if not fmt.writes_itself:
                    accel.save_state(acc, tmp)
                if sharding is not None:
                    own = formats.save_sharded(loop, tmp, sharding)
        shards = formats.gather(acc, own or {}, sharding) if sharding is not None else None
        doc = _manifest(loop, final, position, networks, plugins, reason, monitor, shards)
        job = writer.Job(tmp, landing, final if landing != final else None, root, doc, tensors, loop.state.run,
                         known={**known, **(shards or {}).get("known", {})},  # (shards: checksummed by their ranks)
                         update_latest=update_latest, keep_last=keep_last, best=best)
        finishing = failed(f"cannot finish checkpoint {final}")
        saved = None
        with every_rank(acc, catch=Exception,
                        describe=lambda exc: exc if isinstance(exc, MissingRankFiles) else finishing(exc)):
            if main:
                check_rank_files(tmp, final, acc.num_processes)  # before anything is published
                if not background:
                    saved = writer.finish(job)
        if not background:
            if saved is None:  # (another process: the main published it)
                saved = writer.Saved(landing)
            writer.settled(saved, on_published)
            return saved.path

        def explain(kind, found):  # the writer's failure, raised on the training thread
            if kind == "nonfinite":  # (the refusal a synchronous save makes)
                return _nonfinite(loop, root, final.name, position["global_step"], networks, found)
            return CheckpointError(f"the asynchronous save of checkpoint {str(final)!r} failed: {found}. Nothing "
                                   "was published; 'latest' still names the previous checkpoint")

        if snapshot is not None:
            job.files, job.floating = snapshot.files, snapshot.floating
        handed_over = True
        writer.start(loop, writer.Pending(landing, tmp, snapshot, done=on_published, explain=explain),
                     job if main else None)
        return landing
    except CheckpointError:
        # a failed save leaves nothing behind; the previous checkpoint stays latest. Another
        # rank removes its folder only where it is not the main's (no rank 0 file in it:
        # a root that is not shared), which the main process removes
        if main or (tmp.is_dir() and not (tmp / accel.rng_file(0)).exists()):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if not handed_over:
            store.mark_live(tmp, False)


def _collective_failure() -> type:
    """What ``torch.distributed.checkpoint`` raises on every rank when one
    failed (a ``BaseException``, not an ``Exception``)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def prepare_asynchronous(loop) -> None:
    """Before the first asynchronous save of ``loop``: the host buffers its
    copy will take, allocated in the background (once per accelerator), when
    its saves are copied (the plain format, this process writing the models
    and optimizers)."""
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
