"""Runs: which checkpoints in a root belong to the loop's run (so that it
may replace and rotate them away), and which of them is best by the metric
value their manifests record.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

from ..state import RunIdentity
from .errors import CheckpointError
from .layout import LATEST, list_checkpoints, read_latest, run_folders, sort_key
from .manifest import peek, peek_checked


def run_identity(loop) -> RunIdentity:
    """The loop's :class:`~hookloop.state.RunIdentity` (``loop.state.run``)."""
    return loop.state.run


def adopt_run(loop, path: Path, doc: dict) -> None:
    """The loop continues the run of checkpoint ``path`` (manifest ``doc``)."""
    rid = doc.get("run_id")
    loop.state.run = RunIdentity(rid, resumed_root=os.path.realpath(path.parent), legacy=False) if rid else \
        RunIdentity(resumed_root=os.path.realpath(path.parent), legacy=True)


def owns(loop, root, path) -> bool:
    """Whether checkpoint ``path`` in ``root`` belongs to ``loop``'s run: it
    carries the run's id and was written in ``root`` (a copy carried from
    elsewhere is not), or the run resumed from a checkpoint of ``root``
    (then every checkpoint of that run there is its own). A checkpoint
    without a run id (hookloop 0.1) belongs to a run that resumed one such
    in ``root``. A folder whose manifest cannot be read (a foreign one,
    hostile JSON, a link elsewhere) is nobody's: never replaced, never
    rotated away (with a warning naming it)."""
    doc = manifest_or_warn(path)
    return doc is not None and _owned(loop, root, doc)


def _owned(loop, root, doc: dict) -> bool:
    run = run_identity(loop)
    here = os.path.realpath(root)
    rid = doc.get("run_id")
    if rid is None:
        return run.legacy and run.resumed_root == here
    return rid == run.id and (doc.get("root") == here or run.resumed_root == here)


def manifest_or_warn(path) -> dict | None:
    """The manifest of checkpoint folder ``path`` (unchecked, as
    :func:`~.manifest.peek_checked` reads it), or None with a warning naming
    the folder and what is wrong with it: a scan of a checkpoint root skips
    what it cannot read, and goes on."""
    try:
        return peek_checked(path)
    except CheckpointError as exc:
        warnings.warn(f"hookloop: skipping {path}, which is not a usable checkpoint folder "
                      f"({exc}): it is left alone", RuntimeWarning, stacklevel=3)
        return None


def foreign_checkpoints(loop, root) -> list[Path]:
    """The checkpoints in ``root`` that do not belong to ``loop``'s run
    (:func:`owns`): never replaced, never rotated away. Folders whose
    manifest cannot be read are not among them: they are skipped, with a
    warning naming them (they are not checkpoints of any run)."""
    found = []
    for path in list_checkpoints(root):
        doc = manifest_or_warn(path)
        if doc is not None and not _owned(loop, root, doc):
            found.append(path)
    return found


def describe_run(path) -> str:
    doc = peek(path)
    if doc is None:
        return "unreadable manifest"
    rid = doc.get("run_id")
    return f"run {str(rid)[:8]}" if rid else "no run id: hookloop 0.1"


def best_checkpoints(loop, root, key: str, mode: str, k: int | None = None,
                     extra: tuple | None = None, mine: bool = True) -> list[tuple[float, Path]]:
    """The checkpoints in ``root`` whose manifest records a value of metric
    ``key`` (``save(monitor=...)``), best first (``mode`` ``"min"`` or
    ``"max"``; the newer first among equal values), at most ``k``; only
    this run's (:func:`owns`) unless ``mine`` is False. ``extra``: a
    ``(value, path)`` not written yet, ranked with them."""
    found = []
    for path in list_checkpoints(root):
        doc = manifest_or_warn(path)  # unreadable ones are skipped, with a warning
        if doc is None:
            continue
        monitor = doc.get("monitor")
        mon = monitor if isinstance(monitor, dict) else {}
        value = mon.get("value")
        if (mon.get("key") == key and isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value) and (not mine or _owned(loop, root, doc))):
            found.append((float(mon["value"]), path))
    if extra is not None:
        found = [f for f in found if f[1].name != extra[1].name] + [extra]
    order = {p.name: i for i, p in enumerate(sorted((p for _, p in found), key=sort_key))}
    sign = 1.0 if mode == "min" else -1.0
    found.sort(key=lambda vp: (sign * vp[0], -order[vp[1].name]))
    return found[:k] if k is not None else found


def newest_run(base) -> Path | None:
    """The run folder ``resume_from="latest"`` continues: the highest
    ``version_<N>`` holding a checkpoint, else ``base`` itself if it holds
    checkpoints directly (0.1's layout), else None. A run folder whose
    ``latest`` cannot be read counts by its checkpoint folders (with a
    warning naming the file); one whose checkpoint folders are all unreadable
    (a foreign manifest, hostile JSON, a link elsewhere) and whose ``latest``
    names none is skipped, with a warning naming them."""
    for folder in reversed(run_folders(base)):
        if _holds_checkpoints(folder):
            return folder
    base = Path(base)
    if base.is_dir() and ((base / LATEST).exists() or list_checkpoints(base)):
        return base
    return None


def _holds_checkpoints(folder: Path) -> bool:
    try:
        if read_latest(folder) is not None:
            return True
    except CheckpointError as exc:
        warnings.warn(f"hookloop: run folder {folder}: {exc}", RuntimeWarning, stacklevel=4)
    found = list_checkpoints(folder)
    problems = []
    for path in found:
        try:
            peek_checked(path)
            return True
        except CheckpointError as exc:
            problems.append(str(exc))
    if problems:
        warnings.warn(f"hookloop: skipping run folder {folder}: none of its checkpoint folders "
                      f"is readable ({'; '.join(problems[-3:])})", RuntimeWarning, stacklevel=4)
    return False
