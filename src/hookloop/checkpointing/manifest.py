"""The manifest, ``hookloop.json``: written last into a checkpoint
(:func:`write`), read once when it is loaded (:func:`read_manifest`: its own
CRC-32, format, version and the size of every file it lists; :func:`peek`:
the JSON alone), then used to open each file (:func:`verified`)."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

from . import store
from .errors import CheckpointError
from .store import FORMAT, STATE_FILE, TMP_PREFIX, VERSION

#: the key of the manifest's own checksum (over the rest of it), and the files' algorithm
SELF_CRC, CHECKSUM = "manifest_crc32", "crc32"
_REQUIRED = ("loop", "networks", "accelerate", "plugins", "files", "num_processes", "crc32", "run_id", SELF_CRC)


def peek(path) -> dict:
    """``hookloop.json`` of ``path`` as a JSON object (read bounded and
    confined), its content unchecked, or a :class:`CheckpointError` naming it."""
    path = Path(path)
    store.check_folder(path)
    file = path / STATE_FILE
    try:
        data = store.read_checked(file, path, limit=store.MANIFEST_LIMIT, what=f"a checkpoint's {STATE_FILE}",
                                  why="the most hookloop reads of a manifest")
        doc = store.loads_json(data, file)
    except FileNotFoundError:
        raise CheckpointError(f"{str(path)!r} has no {STATE_FILE}") from None
    except NotADirectoryError:
        raise CheckpointError(f"{str(path)!r} is not a directory") from None
    except store.RefusedFile as exc:
        if exc.file != file or "JSON" not in exc.problem:
            raise
        raise CheckpointError(f"checkpoint {str(path)!r}: {STATE_FILE} {exc.problem}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: {STATE_FILE} is not a JSON object")
    return doc


def read_manifest(path) -> dict:
    """``hookloop.json`` of a complete checkpoint, read once and verified:
    format, version, required keys, its own checksum, and every file it lists
    there with the size it was written with. A :class:`CheckpointError` for a
    missing, foreign, truncated, unfinished or too old directory."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    store.check_folder(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} is a file, not a checkpoint directory")
    if not os.path.lexists(path / STATE_FILE):  # (a FIFO or a link out is refused below, by name)
        from .accelerate import written_by_save_state

        listed = sorted(p.name for p in path.iterdir())
        why = ("it is a save that never finished (a temporary directory)" if path.name.startswith(TMP_PREFIX)
               else "it looks written by accelerator.save_state without hookloop; load it with "
                    "accelerator.load_state" if written_by_save_state(path)
               else f"it contains: {', '.join(listed[:6]) + (' ...' if len(listed) > 6 else '') or 'nothing'}")
        raise CheckpointError(f"{str(path)!r} is not a hookloop checkpoint: it has no {STATE_FILE} ({why})")
    doc, where = peek(path), f"checkpoint {str(path)!r}"
    if doc.get("format") != FORMAT:
        raise CheckpointError(f"{str(path)!r} is not a hookloop checkpoint: {STATE_FILE} has no "
                              f"'format': {FORMAT!r}")
    version = doc.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise CheckpointError(f"{where} has format version {version!r}; this hookloop reads version "
                              f"{VERSION}: upgrade hookloop")
    if version < VERSION:
        written = (doc.get("versions") or {}).get("hookloop") or "0.1"
        raise CheckpointError(f"{where} was written by hookloop {written} (format version {version}), which "
                              "this hookloop does not read: checkpoints of hookloop 0.3 and later load. Its "
                              "weights are safetensors files (model.safetensors ...) that "
                              "safetensors.torch.load_file reads")
    for key in _REQUIRED:
        if key not in doc:
            raise CheckpointError(f"{where}: {STATE_FILE} lacks {key!r}: the checkpoint is corrupt")
    if doc[SELF_CRC] != manifest_crc(doc):
        raise CheckpointError(f"{where}: {STATE_FILE} does not match its own checksum ({SELF_CRC}): it "
                              "changed after it was written (bit rot, or an edit)")
    if doc.get("checksum", CHECKSUM) != CHECKSUM:
        raise CheckpointError(f"{where}: its files are checksummed with {str(doc['checksum'])[:50]!r}; this "
                              f"hookloop verifies {CHECKSUM!r} only: upgrade hookloop")
    for key in ("files", "crc32"):  # entries inside the checkpoint, whole numbers
        entries: Any = doc[key]
        if not isinstance(entries, dict):
            raise CheckpointError(f"{where}: {STATE_FILE}: {key!r} is not a JSON object: the checkpoint is corrupt")
        for rel, value in entries.items():
            if (problem := store.relative_entry(rel)) is not None:
                raise CheckpointError(f"{where}: {STATE_FILE} lists {rel[:200]!r} in {key!r}, which is not a "
                                      f"file of the checkpoint ({problem}): refusing to read it")
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CheckpointError(f"{where}: {STATE_FILE}: {key!r} gives {rel!r} {str(value)[:50]!r}, not a "
                                      "whole number: the checkpoint is corrupt")
    for rel, size in doc["files"].items():
        try:
            actual = store.file_size(path / rel, path, f"{rel} of a checkpoint")
        except FileNotFoundError:
            raise CheckpointError(f"{where}: {rel} is missing: the checkpoint is incomplete") from None
        except store.RefusedFile as exc:
            raise CheckpointError(f"{where}: {rel} {exc.problem}") from None
        if actual != size:
            raise CheckpointError(f"{where}: {rel} is {actual} bytes but {size} were written: the checkpoint "
                                  "is truncated or corrupt")
    return doc


def manifest_crc(doc: dict) -> int:
    """The CRC-32 of the manifest without its own checksum, canonically dumped."""
    body = {k: v for k, v in doc.items() if k != SELF_CRC}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def write(folder: Path, doc: dict) -> None:
    """Write ``doc`` as ``folder/hookloop.json`` with its own checksum, fsync'ed."""
    doc[SELF_CRC] = manifest_crc(doc)
    with open(folder / STATE_FILE, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def verified(path: Path, rel: str, doc: dict, where: str, what: str) -> store.Opened:
    """``path / rel`` opened once (a regular file inside the checkpoint, no
    bigger than the manifest records), its size and then its CRC-32 (over a
    memory map of the same descriptor) checked, before anything parses it;
    a :class:`CheckpointError` naming ``what`` it holds otherwise."""
    size, crc = doc["files"].get(rel), doc["crc32"].get(rel)
    if size is None:
        problem = "the manifest does not list it"
    elif (why := store.relative_entry(rel)) is not None:
        problem = f"it is not a file of the checkpoint ({why})"
    elif crc is None:
        problem = "the manifest has no checksum for it"
    else:
        try:
            opened = store.open_checked(path / rel, path, limit=size, what=what,
                                        why="the size the manifest records")
        except store.RefusedFile as exc:
            problem = exc.problem
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc}"
        else:
            if opened.size != size:
                opened.close()
                problem = f"it is {opened.size} bytes but {size} were written: truncated or corrupt"
            elif (now := opened.crc32()) != crc:
                opened.close()
                problem = (f"it does not match its checksum (CRC-32 {now:08x}, {crc:08x} when written): the file "
                           "changed after it was saved (bit rot, a bad copy, or an edit)")
            else:
                return opened
    raise CheckpointError(f"{where}: cannot read {what} from {rel}: {problem}")
