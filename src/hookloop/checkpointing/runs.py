"""Runs and their roots: which checkpoints of a root belong to the loop's run
(so that it may replace and rotate them away), which are best by the metric
their manifests record, rotation, the run folders, what the I/O layer asks
of a checkpoint plugin (:class:`CheckpointPolicy`), and a root's set-up when
a fit starts (:func:`open_root`, one call). A :class:`Scan` of a root reads
each checkpoint's manifest once (the resumed checkpoint's is passed on).
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..state import RunIdentity
from . import layout, lock
from .errors import CheckpointError
from .layout import list_checkpoints, sort_key
from .manifest import peek_checked


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
    return plugins[0].roots(loop) if plugins else run_roots(layout.default_directory(loop.accelerator))


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
    ``base`` itself (hookloop 0.1's layout); ``[base / "version_0"]`` if none."""
    base = Path(base)
    found = [f for f in [*reversed(layout.run_folders(base)), base]
             if (f / layout.LATEST).exists() or list_checkpoints(f)]
    return found or [base / "version_0"]


def newest_run(base) -> Path | None:
    roots = run_roots(base)
    return roots[0] if roots[0].exists() else None


def take_run_folder(base, owner, run_id: str):
    """``(folder, lock)`` of a fresh run under ``base``: the newest
    ``version_<N>`` if all it holds is what a dead run left (a stale lock,
    unfinished saves: taken over, as the same command continues), else a new
    one, created atomically."""
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
    return loop.state.run


def _owned(run: RunIdentity, root, doc: dict) -> bool:
    """A checkpoint with the run's id written in ``root``, or any of the run's
    there once it resumed from ``root``; one without a run id (0.1's) belongs
    to a run that resumed one such in ``root``."""
    here, rid = os.path.realpath(root), doc.get("run_id")
    if rid is None:
        return run.legacy and run.resumed_root == here
    return rid == run.id and (doc.get("root") == here or run.resumed_root == here)


def manifest_or_warn(path) -> dict | None:
    """The manifest of ``path`` (unchecked), or None with a warning naming it."""
    try:
        return peek_checked(path)
    except CheckpointError as exc:
        warnings.warn(f"hookloop: skipping {path}, which is not a usable checkpoint folder ({exc}): it is left "
                      "alone", RuntimeWarning, stacklevel=3)
        return None


@dataclass
class Scan:
    """The checkpoints of a root and their manifests, each read once
    (unreadable ones skipped with a warning: nobody's, never replaced or
    rotated away). ``known``: manifests already read, by path. The methods
    take the run (``loop.state.run``) whose checkpoints are "mine"."""

    root: Path
    known: dict = field(default_factory=dict)
    found: list = field(default_factory=list)  # (path, manifest), oldest first

    def __post_init__(self):
        self.root = Path(self.root)
        known = {os.path.realpath(p): doc for p, doc in self.known.items()}
        self.found = [(p, doc) for p in list_checkpoints(self.root)
                      if (doc := known.get(os.path.realpath(p)) or manifest_or_warn(p)) is not None]

    def foreign(self, run: RunIdentity) -> list[Path]:
        return [p for p, doc in self.found if not _owned(run, self.root, doc)]

    def best(self, run: RunIdentity, key: str, mode: str, k: int | None = None, extra=None, mine: bool = True):
        """``(value, path)`` of the checkpoints recording a finite value of
        ``key``, best first (the newer first among equals), at most ``k``,
        this run's only unless ``mine`` is False; ``extra``: one not written yet."""
        found = []
        for path, doc in self.found:
            mon = doc.get("monitor") if isinstance(doc.get("monitor"), dict) else {}
            value = mon.get("value")
            if (mon.get("key") == key and isinstance(value, (int, float)) and not isinstance(value, bool)
                    and math.isfinite(value) and (not mine or _owned(run, self.root, doc))):
                found.append((float(value), path))
        if extra is not None:
            found = [f for f in found if f[1].name != extra[1].name] + [extra]
        order = {p.name: i for i, p in enumerate(sorted((p for _, p in found), key=sort_key))}
        found.sort(key=lambda vp: ((1.0 if mode == "min" else -1.0) * vp[0], -order[vp[1].name]))
        return found[:k] if k is not None else found

    def rotate(self, run: RunIdentity, keep_last: int, protected=(), latest: str | None = None) -> None:
        """Delete this run's oldest checkpoints beyond ``keep_last``; never
        ``latest`` (what ``latest`` names), the newest finite one, or one
        ``protected`` names; never another run's."""
        keep = {latest, *protected}
        mine = [(p, doc) for p, doc in self.found if _owned(run, self.root, doc)]
        keep.update([p.name for p, doc in mine if (doc.get("checks") or {}).get("finite")][-1:])
        gone = {p for p, _ in mine[: max(0, len(mine) - keep_last)] if p.name not in keep}
        for path in gone:
            remove(path)
        self.found = [(p, doc) for p, doc in self.found if p not in gone]


def owns(loop, root, path) -> bool:
    """Whether checkpoint ``path`` in ``root`` belongs to ``loop``'s run (an
    unreadable one is nobody's, with a warning)."""
    doc = manifest_or_warn(path)
    return doc is not None and _owned(loop.state.run, root, doc)


def foreign_checkpoints(loop, root) -> list[Path]:
    """The checkpoints in ``root`` that do not belong to ``loop``'s run."""
    return Scan(root).foreign(loop.state.run)


def best_checkpoints(loop, root, key: str, mode: str, k: int | None = None, extra=None,
                     mine: bool = True) -> list[tuple[float, Path]]:
    return Scan(root).best(loop.state.run, key, mode, k, extra, mine)


def remove(path: Path) -> None:
    """Delete a checkpoint directory, renamed first: a kill during the
    deletion never leaves a valid name on a half-deleted directory."""
    trash = path.with_name(f"{layout.TRASH_PREFIX}{path.name}-{os.getpid()}")
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
    """Main process, when a fit starts in ``root``: check it is writable, hold
    it (a live run's is refused), remove what dead saves left, refuse (or warn
    about) checkpoints not this run's and, for a resumed run, rotate what a
    run killed after its last save did not. ``resumed``: ``(path, manifest)``
    of the checkpoint the run resumed from, not read again; it and every
    checkpoint after it are kept, with the ``best`` (``(key, mode, k)``) ones.
    Returns ``(lock, scan)``."""
    layout.check_writable(root)
    held = lock.acquire(root, loop.state.run.id, owner=owner)
    try:
        layout.clean(root)  # with the lock: every other temporary is a dead run's
        scan = Scan(root, known=dict([resumed]) if resumed else {})
        if foreign := scan.foreign(loop.state.run):
            _refuse_foreign(loop, root, foreign)
        if resumed is not None and Path(resumed[0]).parent.resolve() == Path(root).resolve():
            path = Path(resumed[0])
            mine = sort_key(path) if layout.NAME_PATTERN.match(path.name) else None
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
    names = ", ".join(p.name for p in foreign[-3:])
    runs = ", ".join(sorted({describe_run(p) for p in foreign}))
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
