"""Runs: which checkpoints in a root belong to the loop's run (so that it
may replace and rotate them away), and which of them is best by the metric
value their manifests record.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ..state import RunIdentity
from .layout import list_checkpoints, sort_key
from .manifest import peek


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
    in ``root``."""
    run = run_identity(loop)
    doc = peek(path)
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
    doc = peek(path)
    if doc is None:
        return "unreadable manifest"
    rid = doc.get("run_id")
    return f"run {rid[:8]}" if rid else "no run id: hookloop 0.1"


def best_checkpoints(loop, root, key: str, mode: str, k: int | None = None,
                     extra: tuple | None = None, mine: bool = True) -> list[tuple[float, Path]]:
    """The checkpoints in ``root`` whose manifest records a value of metric
    ``key`` (``save(monitor=...)``), best first (``mode`` ``"min"`` or
    ``"max"``; the newer first among equal values), at most ``k``; only
    this run's (:func:`owns`) unless ``mine`` is False. ``extra``: a
    ``(value, path)`` not written yet, ranked with them."""
    found = []
    for path in list_checkpoints(root):
        doc = peek(path) or {}
        mon = doc.get("monitor") or {}
        value = mon.get("value")
        if (mon.get("key") == key and isinstance(value, (int, float)) and math.isfinite(value)
                and (not mine or owns(loop, root, path))):
            found.append((float(mon["value"]), path))
    if extra is not None:
        found = [f for f in found if f[1].name != extra[1].name] + [extra]
    order = {p.name: i for i, p in enumerate(sorted((p for _, p in found), key=sort_key))}
    sign = 1.0 if mode == "min" else -1.0
    found.sort(key=lambda vp: (sign * vp[0], -order[vp[1].name]))
    return found[:k] if k is not None else found
