"""Rotation: deleting a run's oldest checkpoints (never another run's, never
the one ``latest`` names, the newest finite one or a protected best one),
each renamed away before it is deleted.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from . import layout, manifest
from .layout import TRASH_PREFIX
from .runs import owns


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
