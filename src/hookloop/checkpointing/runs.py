"""Whose checkpoints a root holds: a checkpoint is the loop's run's when it
carries the run's id and was written in that root (or the run resumed from
it), and only those are replaced and rotated away; which are best by the
metric their manifests record. A :class:`Scan` reads each manifest of a
root once, for every question a save or a fit's start asks of it."""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..state import RunIdentity
from . import manifest, store
from .errors import CheckpointError
from .store import list_checkpoints, sort_key


def _owned(run: RunIdentity, root, doc: dict) -> bool:
    """A checkpoint with the run's id written in ``root``, or any of the run's
    there once it resumed from ``root``."""
    here = os.path.realpath(root)
    return doc.get("run_id") == run.id and (doc.get("root") == here or run.resumed_root == here)


def manifest_or_warn(path) -> dict | None:
    """The manifest of ``path`` (unchecked), or None with a warning naming it."""
    try:
        return manifest.peek(path)
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

    def best(self, run: RunIdentity, key: str, mode: str, k: int | None = None, mine: bool = True):
        """``(value, path)`` of the checkpoints recording a finite value of
        ``key``, best first (the newer first among equals), at most ``k``,
        this run's only unless ``mine`` is False."""
        found = []
        for path, doc in self.found:
            mon = doc.get("monitor") if isinstance(doc.get("monitor"), dict) else {}
            value = mon.get("value")
            if (mon.get("key") == key and isinstance(value, (int, float)) and not isinstance(value, bool)
                    and math.isfinite(value) and (not mine or _owned(run, self.root, doc))):
                found.append((float(value), path))
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
        for path in sorted(gone):
            store.remove(path)
            self.found = [(p, doc) for p, doc in self.found if p != path]


def owns(loop, root, path) -> bool:
    """Whether checkpoint ``path`` in ``root`` belongs to ``loop``'s run (an
    unreadable one is nobody's, with a warning)."""
    doc = manifest_or_warn(path)
    return doc is not None and _owned(loop.state.run, root, doc)


def describe_run(path) -> str:
    try:
        return f"run {str(manifest.peek(path).get('run_id'))[:8]}"
    except CheckpointError:
        return "unreadable manifest"
