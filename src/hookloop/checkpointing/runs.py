"""Runs and their roots: which checkpoints of a root belong to the loop's
run (so that it may replace and rotate them away), which are best by the
metric their manifests record, rotation, the run folders, what the I/O
layer needs from the policy (:class:`CheckpointPolicy`), and setting a
root up when a fit starts (:func:`open_root`, one call).

A scan of a root (:class:`Scan`) reads each checkpoint's manifest once; the
checkpoint the run resumed from is not read again (its manifest is passed on).
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..state import RunIdentity
from . import layout
from .errors import CheckpointError
from .layout import TRASH_PREFIX, list_checkpoints, sort_key
from .manifest import peek_checked


class CheckpointPolicy:
    """Decides when, where, how many and which is best (the ``Checkpoint``
    plugin subclasses it); the checkpoint package asks it only what this
    class declares, and finds its instances by type."""

    #: names of ``custom_checkpoint_<i>.pkl`` files that loading may unpickle
    trust_pickles: tuple = ()
    #: the metric the best checkpoints are ranked by (None: none)
    monitor: str | None = None
    #: the signals on which the run saves and stops (the ``preemption`` plugin acts on them)
    signals: tuple = ()
    #: the last checkpoint this policy published (None: none yet)
    last_saved: Path | None = None

    def directory(self, loop) -> Path:
        """The checkpoint root for ``loop``: where saves go."""
        raise NotImplementedError(f"{type(self).__name__}.directory(loop)")

    def roots(self, loop) -> list[Path]:
        """Where ``resume_from="latest"`` looks, in order (the first holding
        a readable checkpoint is resumed); default: :meth:`directory`."""
        return [self.directory(loop)]

    def best_checkpoint(self, loop, mine: bool = True):
        """``(value, path)`` of the best checkpoint by :attr:`monitor`, or None."""
        return None

    def request(self, reason: str = "requested") -> None:
        """Save at the next safe point, synchronously when ``reason`` is ``"preempted"``."""


def checkpoint_plugins(loop) -> list:
    """The :class:`CheckpointPolicy` plugins of ``loop``, in call order: the
    first one given in ``plugins=[...]`` first."""
    found = [p for _, p in loop.plugins.pm.list_name_plugin() if isinstance(p, CheckpointPolicy)]
    return found[::-1]  # pluggy calls the last registered first; user plugins are registered reversed


def checkpoint_roots(loop) -> list[Path]:
    """Where ``resume_from="latest"`` looks: the first ``Checkpoint``
    plugin's roots, else the newest default run folders."""
    plugins = checkpoint_plugins(loop)
    if plugins:
        return plugins[0].roots(loop)
    return run_roots(layout.default_directory(loop.accelerator))


def checkpoint_root(loop) -> Path:
    """Where ``resume_from="latest"`` looks first."""
    return checkpoint_roots(loop)[0]


def trusted_pickles(loop) -> set:
    return {name for plugin in checkpoint_plugins(loop) for name in plugin.trust_pickles}


def best_checkpoint_path(loop) -> Path:
    """``load_checkpoint("best")``: the best checkpoint by the ``monitor`` of
    the loop's first Checkpoint plugin that has one, whichever run wrote it."""
    plugin = next((p for p in checkpoint_plugins(loop) if p.monitor), None)
    if plugin is None:
        raise CheckpointError("load_checkpoint('best') needs a Checkpoint(monitor=...) plugin: it ranks "
                              "the checkpoints by the metric they were saved with")
    found = plugin.best_checkpoint(loop, mine=False)
    if found is None:
        raise CheckpointError(f"load_checkpoint('best'): no checkpoint in {plugin.directory(loop)} "
                              f"records {plugin.monitor!r} yet")
    return found[1]


# -- the run folders --------------------------------------------------------------------


def run_roots(base) -> list[Path]:
    """Where ``resume_from="latest"`` looks under ``base`` with the default
    run folders: every ``version_<N>`` that holds a checkpoint or a
    ``latest``, newest first, then ``base`` itself (hookloop 0.1's layout);
    ``[base / "version_0"]`` when there is none."""
    base = Path(base)
    found = [f for f in reversed(layout.run_folders(base)) if (f / layout.LATEST).exists() or list_checkpoints(f)]
    if base.is_dir() and ((base / layout.LATEST).exists() or list_checkpoints(base)):
        found.append(base)
    return found or [base / "version_0"]


def newest_run(base) -> Path | None:
    """The newest run folder under ``base`` that holds a checkpoint (0.2's name)."""
    roots = run_roots(base)
    return roots[0] if roots[0].exists() else None


def take_run_folder(base, owner, run_id: str):
    """A fresh run's folder under ``base``, held (``(folder, lock)``): the
    newest ``version_<N>`` if all it holds is what a dead run left (a stale
    lock, unfinished saves: taken over and cleaned, as the same command
    continues), else a new one, created atomically (:func:`~.layout.claim_run_folder`)."""
    from . import lock

    folders = layout.run_folders(base)
    if folders and not list_checkpoints(folders[-1]) and not (folders[-1] / layout.LATEST).exists():
        info = lock.read_lock(folders[-1])
        if info is not None and not info.live:  # (a folder just claimed has no lock yet: not taken)
            try:
                return folders[-1], lock.acquire(folders[-1], run_id, owner=owner)
            except CheckpointError:
                pass  # taken over by another process meanwhile: a new folder
    folder = layout.claim_run_folder(base)
    return folder, lock.acquire(folder, run_id, owner=owner)


# -- which checkpoints are this run's --------------------------------------------------


def adopt_run(loop, path: Path, doc: dict) -> None:
    """The loop continues the run of checkpoint ``path`` (manifest ``doc``)."""
    rid, root = doc.get("run_id"), os.path.realpath(path.parent)
    loop.state.run = RunIdentity(rid, resumed_root=root) if rid else RunIdentity(resumed_root=root, legacy=True)


def run_identity(loop) -> RunIdentity:
    """The loop's :class:`~hookloop.state.RunIdentity` (``loop.state.run``)."""
    return loop.state.run


def _owned(loop, root, doc: dict) -> bool:
    run, here, rid = loop.state.run, os.path.realpath(root), doc.get("run_id")
    if rid is None:
        return run.legacy and run.resumed_root == here
    return rid == run.id and (doc.get("root") == here or run.resumed_root == here)


@dataclass
class Scan:
    """The checkpoints of a root and their manifests, each read once
    (unreadable ones skipped with a warning naming them: never replaced,
    never rotated away). ``known``: manifests already read, by path."""

    root: Path
    known: dict = field(default_factory=dict)
    found: list = field(default_factory=list)  # (path, doc), oldest first

    def __post_init__(self):
        self.root = Path(self.root)
        known = {os.path.realpath(p): doc for p, doc in self.known.items()}
        for path in list_checkpoints(self.root):
            doc = known.get(os.path.realpath(path)) or manifest_or_warn(path)
            if doc is not None:
                self.found.append((path, doc))

    def mine(self, loop) -> list[Path]:
        return [p for p, doc in self.found if _owned(loop, self.root, doc)]

    def foreign(self, loop) -> list[Path]:
        return [p for p, doc in self.found if not _owned(loop, self.root, doc)]

    def best(self, loop, key: str, mode: str, k: int | None = None, extra=None, mine: bool = True):
        """The checkpoints whose manifest records a finite value of metric
        ``key``, best first (the newer first among equal values), at most
        ``k``; only this run's unless ``mine`` is False. ``extra``: a
        ``(value, path)`` not written yet, ranked with them."""
        found = []
        for path, doc in self.found:
            mon = doc.get("monitor") if isinstance(doc.get("monitor"), dict) else {}
            value = mon.get("value")
            if (mon.get("key") == key and isinstance(value, (int, float)) and not isinstance(value, bool)
                    and math.isfinite(value) and (not mine or _owned(loop, self.root, doc))):
                found.append((float(value), path))
        if extra is not None:
            found = [f for f in found if f[1].name != extra[1].name] + [extra]
        order = {p.name: i for i, p in enumerate(sorted((p for _, p in found), key=sort_key))}
        sign = 1.0 if mode == "min" else -1.0
        found.sort(key=lambda vp: (sign * vp[0], -order[vp[1].name]))
        return found[:k] if k is not None else found

    def rotate(self, loop, keep_last: int, protected=(), latest: str | None = None) -> None:
        """Delete this run's oldest checkpoints beyond ``keep_last`` (another
        run's are never deleted); never ``latest`` (what ``latest`` names),
        never the newest one known to be finite, never one ``protected`` names."""
        keep = {latest, *protected}
        mine = [(p, doc) for p, doc in self.found if _owned(loop, self.root, doc)]
        finite_ones = [p for p, doc in mine if (doc.get("checks") or {}).get("finite")]
        if finite_ones:
            keep.add(finite_ones[-1].name)
        gone = {p for p, _ in mine[: max(0, len(mine) - keep_last)] if p.name not in keep}
        for path in gone:
            remove(path)
        self.found = [(p, doc) for p, doc in self.found if p not in gone]


def manifest_or_warn(path) -> dict | None:
    """The manifest of checkpoint folder ``path`` (unchecked), or None with
    a warning naming the folder and what is wrong with it."""
    try:
        return peek_checked(path)
    except CheckpointError as exc:
        warnings.warn(f"hookloop: skipping {path}, which is not a usable checkpoint folder "
                      f"({exc}): it is left alone", RuntimeWarning, stacklevel=3)
        return None


def owns(loop, root, path) -> bool:
    """Whether checkpoint ``path`` in ``root`` belongs to ``loop``'s run: it
    carries the run's id and was written in ``root``, or the run resumed from
    a checkpoint of ``root`` (a checkpoint without a run id, hookloop 0.1's:
    a run that resumed one such there). A folder whose manifest cannot be
    read is nobody's (with a warning naming it)."""
    doc = manifest_or_warn(path)
    return doc is not None and _owned(loop, root, doc)


def foreign_checkpoints(loop, root) -> list[Path]:
    """The checkpoints in ``root`` that do not belong to ``loop``'s run."""
    return Scan(root).foreign(loop)


def best_checkpoints(loop, root, key: str, mode: str, k: int | None = None, extra=None,
                     mine: bool = True) -> list[tuple[float, Path]]:
    """:meth:`Scan.best` of ``root``."""
    return Scan(root).best(loop, key, mode, k, extra, mine)


def rotate(loop, root: Path, keep_last: int, protected=(), latest: str | None = None) -> None:
    """:meth:`Scan.rotate` of ``root`` (``latest``: what it names, if known)."""
    Scan(root).rotate(loop, keep_last, protected,
                      latest if latest is not None else layout.read_latest_quietly(root))


def remove(path: Path) -> None:
    """Delete a checkpoint directory: renamed first, so that a kill during
    the deletion never leaves a valid name on a half-deleted directory."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def describe_run(path) -> str:
    try:
        rid = peek_checked(path).get("run_id")
    except CheckpointError:
        return "unreadable manifest"
    return f"run {str(rid)[:8]}" if rid else "no run id: hookloop 0.1"


# -- a root as a fit starts ----------------------------------------------------------------


def open_root(loop, root: Path, owner, resumed=None, keep_last: int | None = None, best=None):
    """Main process, when a fit starts in ``root``: check it is writable,
    hold it (:func:`~.lock.acquire`), remove what dead saves left, refuse (or
    warn about) checkpoints not this run's, and, for a resumed run, rotate
    what a run killed after its last save did not. ``resumed``: ``(path,
    manifest)`` of the checkpoint the run resumed from, not read again; it
    and every checkpoint after it are kept at this rotation, with the
    ``best`` (``(key, mode, k)``) ones. Returns ``(lock, scan of the root)``."""
    from . import lock as run_lock

    layout.check_writable(root)
    held = run_lock.acquire(root, loop.state.run.id, owner=owner)  # a live run's root is refused
    try:
        return held, _set_up(loop, root, resumed, keep_last, best)
    except BaseException:
        held.release(owner=owner)
        raise


def _set_up(loop, root, resumed, keep_last, best) -> Scan:
    layout.clean(root)  # with the lock: every other temporary is a dead run's
    known = dict([resumed]) if resumed else {}
    scan = Scan(root, known=known)
    foreign = scan.foreign(loop)
    if foreign:
        _refuse_foreign(loop, root, foreign)
    if resumed is not None and Path(resumed[0]).parent.resolve() == Path(root).resolve():
        path = Path(resumed[0])
        mine = sort_key(path) if layout.NAME_PATTERN.match(path.name) else None
        newer = [p.name for p, _ in scan.found if mine is not None and sort_key(p) > mine]
        if newer:
            warnings.warn(f"Checkpoint: resumed from {path.name}, but {root} also holds newer "
                          f"checkpoints ({', '.join(newer)}) of the run that went on from there: this "
                          "run's checkpoints will replace them, and rotation may delete them",
                          RuntimeWarning, stacklevel=3)
        if keep_last:
            keep = {*newer, *(p.name for _, p in scan.best(loop, *best))} if best else set(newer)
            scan.rotate(loop, keep_last, keep, latest=path.name)
    return scan


def _refuse_foreign(loop, root, foreign) -> None:
    """Checkpoints in ``root`` that are not this run's: a run from scratch,
    or resumed from another directory, would replace and rotate them away:
    refused. A run resumed from this directory leaves them alone, with a warning."""
    names = ", ".join(p.name for p in foreign[-3:])
    runs = ", ".join(sorted({describe_run(p) for p in foreign}))
    run = loop.state.run
    if run.resumed_root is None:
        raise CheckpointError(
            f"{str(root)!r} already holds checkpoints of a run ({names}) "
            "and this run starts from scratch: its checkpoints would replace them. Continue that "
            "run with resume_from='latest', or give Checkpoint(dir=...) another directory.")
    if run.resumed_root != os.path.realpath(root):
        raise CheckpointError(
            f"{str(root)!r} holds checkpoints that are not this run's ({names}; {runs}), and this "
            f"run resumed from {str(loop.resumed_from)!r}, in another directory: its checkpoints "
            "would be mixed with them, replace them and rotate them away. Resume from that "
            "directory's own checkpoints (resume_from='latest' with this dir), or give "
            "Checkpoint(dir=...) an empty directory.")
    warnings.warn(f"Checkpoint: {root} also holds {len(foreign)} checkpoint(s) that are not this run's "
                  f"({names}; {runs}): they are left alone, never replaced or rotated away",
                  RuntimeWarning, stacklevel=4)
