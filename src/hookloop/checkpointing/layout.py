"""Names and places: the files and directories of a checkpoint root, the
``latest`` pointer, the run folders, cleaning a root. Nothing here reads a
checkpoint's content (:mod:`.manifest` does)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path

from . import safe_read
from .errors import CheckpointError, NotACheckpointName

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
#: ``step-<update>[-epoch-end][.<generation>]``: a save of a position whose
#: checkpoint ``latest`` names takes the next generation (never renamed over it)
NAME_PATTERN = re.compile(r"^step-(\d+)(-epoch-end)?(?:\.(\d+))?$")
_RUN = re.compile(r"^version_(\d+)$")


# -- checkpoints in a root ---------------------------------------------------------


def checkpoint_name(global_step: int, epoch_end: bool = False) -> str:
    return f"step-{global_step:08d}" + ("-epoch-end" if epoch_end else "")


def sort_key(path: Path):
    """The order of checkpoints: by step, epoch-end after mid-epoch, then by generation."""
    match = NAME_PATTERN.match(path.name)
    if match is None:
        raise ValueError(f"{path}: not a checkpoint's name (step-<N>[-epoch-end][.<n>])")
    return (int(match.group(1)), bool(match.group(2)), int(match.group(3) or 0))


def next_generation(path: Path) -> Path:
    """The first free ``<name>.<n>`` next to checkpoint ``path``."""
    match = NAME_PATTERN.match(path.name)
    base = path.name if match is None or match.group(3) is None else path.name.rsplit(".", 1)[0]
    n = 1
    while (path.parent / f"{base}.{n}").exists():
        n += 1
    return path.parent / f"{base}.{n}"


def list_checkpoints(root) -> list[Path]:
    """The checkpoint directories in ``root``, oldest first (not validated)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if NAME_PATTERN.match(p.name) and p.is_dir()), key=sort_key)


def read_latest(root) -> str | None:
    """The checkpoint name ``root/latest`` holds (None: none), read bounded and
    confined; never followed out of its root (:class:`CheckpointError`), nor
    to a ``.tmp-`` or ``.trash-`` folder (:class:`NotACheckpointName`)."""
    file = Path(root) / LATEST
    try:
        raw = safe_read.read_checked(file, root, limit=safe_read.LATEST_LIMIT,
                                     what="the name of the latest checkpoint",
                                     why="the most a checkpoint's name takes")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except safe_read.RefusedFile as exc:
        raise CheckpointError(f"{str(file)!r} {exc.problem}. Delete it (resume_from='latest' "
                              "then resumes from the newest usable checkpoint)") from None
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
    if not NAME_PATTERN.match(name):
        kind = ("a temporary folder (a save in progress, or killed)" if name.startswith(TMP_PREFIX)
                else "a folder being deleted" if name.startswith(TRASH_PREFIX)
                else "not a checkpoint's name (step-<N>[-epoch-end][.<generation>])")
        raise NotACheckpointName(
            f"{str(file)!r} names {name[:200]!r}, {kind}: it never names anything but a "
            "complete checkpoint, so it is not followed"
        )
    return name


def read_latest_quietly(root) -> str | None:
    """``latest``'s checkpoint name, or None if it names none."""
    try:
        return read_latest(root)
    except CheckpointError:
        return None


def write_latest(root: Path, name: str) -> None:
    """Point ``root/latest`` at ``name``: write, fsync, ``os.replace``."""
    tmp = root / f"{LATEST}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


# -- run folders ---------------------------------------------------------------------


def default_directory(accelerator) -> Path:
    """``<accelerator.project_dir or .>/checkpoints``: where the run folders go."""
    return Path(accelerator.project_dir or os.getcwd()) / "checkpoints"


def run_folders(base) -> list[Path]:
    """The ``version_<N>`` run folders in ``base``, by N."""
    base = Path(base)
    if not base.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in base.iterdir() if (m := _RUN.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def is_run_dir(base, path) -> bool:
    """Whether ``path`` is a run folder of ``base``, or ``base`` (0.1's layout)."""
    path, base = Path(path), Path(base)
    try:
        same_base = os.path.realpath(path.parent) == os.path.realpath(base)
        is_base = os.path.realpath(path) == os.path.realpath(base)
    except OSError:
        return False
    return (same_base and bool(_RUN.match(path.name))) or is_base


def next_run_name(base) -> str:
    """``version_<N>``: one more than the highest existing (0 for the first)."""
    folders = run_folders(base)
    return f"version_{int(folders[-1].name[len('version_'):]) + 1 if folders else 0}"


def claim_run_folder(base, attempts: int = 1000) -> Path:
    """Create the next run folder ``base/version_<N>``: ``mkdir`` without
    ``exist_ok``, so that two processes starting together get two folders."""
    base = Path(base)
    tried = -1
    try:
        base.mkdir(parents=True, exist_ok=True)
        for _ in range(attempts):
            # past the last name tried, if that one was taken (by a folder, or a file)
            tried = max(int(next_run_name(base)[len("version_"):]), tried + 1)
            try:
                os.mkdir(base / f"version_{tried}")
            except FileExistsError:
                continue
            return base / f"version_{tried}"
    except OSError as exc:
        raise CheckpointError(
            f"cannot create a run folder in {str(base)!r}: {type(exc).__name__}: {exc}. Pass "
            "Checkpoint(dir=...) a directory this process can write."
        ) from exc
    raise CheckpointError(f"cannot create a run folder in {str(base)!r}: other processes took "
                          f"{attempts} names in a row")


# -- the root on disk ----------------------------------------------------------------

#: the temporary directories of this process's saves in progress (real paths):
#: never removed by :func:`clean`
_live_saves: set[str] = set()


def mark_live(tmp: Path, live: bool = True) -> None:
    """``tmp`` is (or, ``live=False``, no longer is) a save of this process in progress."""
    (_live_saves.add if live else _live_saves.discard)(os.path.realpath(tmp))


def clean(root) -> None:
    """Remove what killed saves and rotations left in ``root`` (``.tmp-*``,
    ``.trash-*``, a half-written ``latest``), but this process's saves in
    progress. Main process only, holding the root's run lock (:mod:`.lock`):
    then every other temporary is a dead run's."""
    root = Path(root)
    found = [p for p in root.iterdir() if p.name.startswith((TMP_PREFIX, TRASH_PREFIX, LATEST + ".tmp"))
             and os.path.realpath(p) not in _live_saves] if root.is_dir() else []
    for path in found:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:  # a probe file, a half-written latest
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


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems refuse fsync on a directory
        fsync_file(path)
