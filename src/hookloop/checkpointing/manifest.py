"""The manifest, ``hookloop.json``: reading it, verifying it (its own
CRC-32, the format and version, the size of every file it lists), and
verifying one file against it (size and CRC-32) before it is read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import accelerate as accel
from .errors import CheckpointError
from .layout import FORMAT, STATE_FILE, TMP_PREFIX, VERSION

#: the key of the manifest's own checksum (over the rest of it)
SELF_CRC = "manifest_crc32"


def peek(path: Path) -> dict | None:
    """``hookloop.json`` as JSON, unchecked; None if unreadable."""
    try:
        doc = json.loads((Path(path) / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def read_manifest(path) -> dict:
    """``hookloop.json`` of a complete checkpoint, after checking that every
    file it lists exists with the size it was written with. Raises
    :class:`CheckpointError` for a missing, foreign, truncated or unfinished
    directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} is a file, not a checkpoint directory")
    state_file = path / STATE_FILE
    if not state_file.is_file():
        if path.name.startswith(TMP_PREFIX):
            why = "it is a save that never finished (a temporary directory)"
        elif accel.written_by_save_state(path):
            why = ("it looks written by accelerator.save_state without hookloop; "
                   "load it with accelerator.load_state")
        else:
            entries = sorted(p.name for p in path.iterdir())
            shown = ", ".join(entries[:6]) + (" ..." if len(entries) > 6 else "")
            why = f"it contains: {shown or 'nothing'}"
        raise CheckpointError(
            f"{str(path)!r} is not a hookloop checkpoint: it has no {STATE_FILE} ({why})"
        )
    try:
        doc = json.loads(state_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {STATE_FILE} is not valid JSON ({exc}): "
            "the checkpoint is truncated or corrupt"
        ) from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(
            f"{str(path)!r} is not a hookloop checkpoint: {STATE_FILE} has no "
            f"'format': {FORMAT!r}"
        )
    if not isinstance(doc.get("version"), int) or doc["version"] > VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format version {doc.get('version')!r}; this "
            f"hookloop reads version {VERSION} and older: upgrade hookloop"
        )
    required = ("loop", "networks", "accelerate", "plugins", "files", "num_processes")
    if doc["version"] >= 2:
        required += ("crc32", "run_id", SELF_CRC)
    for key in required:
        if key not in doc:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: {STATE_FILE} lacks {key!r}: the checkpoint is corrupt"
            )
    if doc["version"] >= 2 and doc[SELF_CRC] != manifest_crc(doc):
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {STATE_FILE} does not match its own checksum "
            f"({SELF_CRC}): it changed after it was written (bit rot, or an edit)"
        )
    for rel, size in doc["files"].items():
        file = path / rel
        if not file.is_file():
            raise CheckpointError(
                f"checkpoint {str(path)!r}: {rel} is missing: the checkpoint is incomplete"
            )
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: {rel} is {actual} bytes but {size} were "
                "written: the checkpoint is truncated or corrupt"
            )
    return doc


def manifest_crc(doc: dict) -> int:
    """The CRC-32 of the manifest without its own checksum, canonically dumped."""
    import zlib

    body = {k: v for k, v in doc.items() if k != SELF_CRC}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def crc32_file(path: Path) -> int:
    """CRC-32 of a file, read through a memory map (no copy)."""
    import mmap
    import zlib

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return zlib.crc32(mapped)


def verified(path: Path, rel: str, doc: dict, where: str, what: str) -> Path:
    """``path / rel`` once its size and CRC-32 match the manifest ``doc``, or
    a :class:`CheckpointError` naming ``what`` it holds."""
    problem = None
    size = doc["files"].get(rel)
    file = path / rel
    if size is None:
        problem = "the manifest does not list it"
    else:
        try:
            actual = file.stat().st_size
            crc = (doc.get("crc32") or {}).get(rel)
            if actual != size:
                problem = f"it is {actual} bytes but {size} were written: truncated or corrupt"
            elif crc is None and doc["version"] >= 2:
                problem = "the manifest has no checksum for it"
            elif crc is not None and (now := crc32_file(file)) != crc:
                problem = (f"it does not match its checksum (CRC-32 {now:08x}, {crc:08x} when "
                           "written): the file changed after it was saved (bit rot, a bad copy, "
                           "or an edit)")
            else:
                return file
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc}"
    raise CheckpointError(f"{where}: cannot read {what} from {rel}: {problem}")
