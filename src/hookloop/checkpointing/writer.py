"""Writing checkpoint files at memory speed, and in the background:
:func:`write_file` writes a file as Accelerate does (``save_file``,
``torch.save``), its size and CRC-32 computed as the bytes go to the kernel
(:class:`ChecksumFile`) or read back from the page cache, fsync'ed;
:func:`host_copy` copies the models' and optimizers' states to host memory at
the safe point (each storage once, into buffers kept from the previous save;
pinned and non-blocking from a GPU), for a background :class:`Job` to check
(finiteness) and write while training goes on: at most one per loop, the
collectives on the training thread (:func:`start`, :func:`wait`, :func:`poll`).
"""

from __future__ import annotations

import contextlib
import copy as _copy
import errno
import os
import shutil
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import finite, safe_read
from .collective import every_rank

#: bytes checksummed and written at a time (fits the caches with room to spare)
CHUNK = 4 << 20
#: how much nicer than training the writer thread runs (Linux: per thread)
WRITER_NICENESS = 10
_OPEN = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


class ChecksumFile:
    """A new file written through ``write`` (a file object for
    ``torch.save``), its size and CRC-32 kept as it goes; :meth:`close`
    fsyncs it and returns ``(size, crc32)``."""

    def __init__(self, path: Path):
        self.path, self.fd, self.size, self.crc = Path(path), os.open(path, _OPEN, 0o644), 0, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), CHUNK):
            chunk = view[start:start + CHUNK]
            self.crc = safe_read.crc32(chunk, self.crc)
            while len(chunk):
                chunk = chunk[os.write(self.fd, chunk):]
        self.size += len(view)
        return len(view)

    def flush(self) -> None:  # (torch.save calls it; the bytes are with the kernel already)
        return None

    def close(self, fsync: bool = True) -> tuple[int, int]:
        if self.fd >= 0:
            try:
                if fsync:
                    os.fsync(self.fd)
            finally:
                os.close(self.fd)
                self.fd = -1
        return self.size, self.crc

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        self.close(fsync=kind is None)


def write_file(folder: Path, rel: str, kind: str, payload, metadata=None) -> tuple[int, int]:
    """Write ``folder / rel`` as Accelerate would (``kind``: ``"safetensors"``:
    ``save_file`` with ``metadata``; ``"torch"``: ``torch.save``), fsync it;
    returns ``(size, crc32)``. A safetensors file is ``save_file``'s byte for
    byte, read back from the page cache (``save_file`` writes ~4x faster than
    ``safetensors.torch.save`` builds the bytes); a ``torch.save`` file goes
    through a :class:`ChecksumFile` (the same zip records as ``torch.save(obj,
    path)``; only the zip's top folder is named ``archive``)."""
    path = folder / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "safetensors":
        from safetensors.torch import save_file

        save_file(payload, str(path), metadata=metadata)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            os.fsync(fd)
            size = os.fstat(fd).st_size
            return size, safe_read.crc32_fd(fd, size)
        finally:
            os.close(fd)
    with ChecksumFile(path) as out:
        if kind == "torch":
            torch.save(payload, out)
        else:
            out.write(payload)
        return out.close()


def write_files(tmp: Path, snapshot) -> dict:
    """The files of a :class:`Snapshot` into ``tmp``: ``{rel: (size, crc32)}``."""
    return {rel: write_file(tmp, rel, kind, payload, metadata) for rel, kind, payload, metadata in snapshot.files}


def write_error(exc: BaseException, root: Path, what: str) -> str:
    """The message for a failed write: ``no space left on <dir>`` when the disk
    (or quota) is full, whatever the library said (torch's zip writer reports
    ``unexpected pos``), else the error itself."""
    full, seen, cause = False, set(), exc  # type: bool, set[int], BaseException | None
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        full = full or (isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)))
        cause = cause.__cause__ or cause.__context__
    free = None
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(root if root.exists() else root.parent).free
    detail = f"{type(exc).__name__}: {exc}"
    if full or (free is not None and free < (1 << 20)):  # (a write failed with less than 1 MiB left)
        left = f" ({free} bytes free)" if free is not None else ""
        return (f"no space left on {root}{left}: {what} ({detail}). Free some space or give Checkpoint(dir=...) "
                "another disk; the unfinished checkpoint was removed and 'latest' still names the previous one")
    return f"{what}: {detail}"


# -- the host copy -----------------------------------------------------------------------


@dataclass
class Snapshot:
    """The files left to write, ``[rel, kind, payload, metadata]``; with a host
    copy, its buffers and its floating tensors ``(rel, key, copy)``."""

    files: list = field(default_factory=list)
    copied: int = 0  # bytes copied to host memory
    storages: list = field(default_factory=list)  # the host buffers, back to the pool after the write
    floating: list = field(default_factory=list)

    def find_nonfinite(self) -> tuple | None:
        """``(rel, key, value)`` of the first copied tensor holding a NaN or
        an infinity, or None: one fused reduction, off the training thread."""
        bad = finite.first_nonfinite(t for *_, t in self.floating)
        if bad is None:
            return None
        rel, key, t = self.floating[bad]
        flat = t.detach().reshape(-1)
        return rel, "".join(f"[{k!r}]" for k in key), flat[~flat.isfinite()][0].item()

    def release(self, acc) -> None:
        """The write is done: its host buffers serve the next copy."""
        pool = _POOLS.setdefault(acc, {})
        for storage in self.storages:
            pool.setdefault((storage.nbytes(), storage.is_pinned()), []).append(storage)
        self.storages, self.files, self.floating = [], [], []


#: accelerator -> host buffers by (bytes, pinned), from its last save
_POOLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def host_copy(acc, files: list) -> Snapshot:
    """The files to write with every tensor copied to host memory, each
    storage once (views and shared storages stay views and shared, as
    ``torch.save`` records them), every container new in its own type and
    order (so that it pickles as the original does)."""
    pool, out = _POOLS.setdefault(acc, {}), Snapshot(files)
    storages: dict[tuple[Any, int], Any] = {}  # (device, data_ptr) -> host storage

    def tensor(t: torch.Tensor, rel: str, key: tuple) -> torch.Tensor:
        source = t.untyped_storage()
        host = storages.get((t.device, source.data_ptr()))
        if host is None:
            pinned, free = t.device.type == "cuda", pool.get((source.nbytes(), t.device.type == "cuda"))
            host = free.pop() if free else torch.empty(source.nbytes(), dtype=torch.uint8,
                                                       pin_memory=pinned).untyped_storage()
            host.copy_(source, non_blocking=pinned)
            storages[(t.device, source.data_ptr())] = host
            out.copied += source.nbytes()
        copied = torch.empty((0,), dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())
        if t.requires_grad and t.is_leaf:
            copied.requires_grad_(True)
        if t.is_floating_point() or t.is_complex():
            out.floating.append((rel, key, copied))
        return copied

    def copy(obj, rel: str, key: tuple = ()):  # (key: the path to obj, formatted only for an error)
        if isinstance(obj, torch.Tensor):
            return tensor(obj, rel, key)
        if isinstance(obj, dict):
            new = obj.__class__() if type(obj) in (dict, OrderedDict) else _copy.copy(obj)
            for k, v in obj.items():
                new[k] = copy(v, rel, (*key, k))
            return new
        if isinstance(obj, list) or type(obj) is tuple:
            items = [copy(v, rel, (*key, i)) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
            return obj
        return _copy.deepcopy(obj)  # anything else a state dict may hold: its own copy

    for entry in out.files:
        entry[2] = copy(entry[2], entry[0])
    if any(device.type == "cuda" for device, _ in storages):
        torch.cuda.current_stream().synchronize()  # the non-blocking copies have landed
    out.storages = list(storages.values())
    return out


# -- one background save per loop ------------------------------------------------------


class Job:
    """One save written by a background thread; ``done(result)`` and
    ``explain(error)`` (what to raise instead) run on the training thread
    when it is settled. ``name``: the checkpoint's folder."""

    def __init__(self, name: str, work, done=None, explain=None):
        self.name, self._work, self._done, self._explain = name, work, done, explain
        self.result = None
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self.thread: threading.Thread | None = None

    def run(self) -> None:
        # a lower CPU priority than training (this thread only, on Linux): on busy
        # cores the writer takes the time training leaves
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                           os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + WRITER_NICENESS)
        try:
            self.result = self._work()
        except BaseException as exc:  # noqa: BLE001 - reported where the job is settled
            self.error = exc
        finally:
            self._work = None  # (its closure holds the host copy: free it now)
            self.finished.set()


#: loop -> its save in flight (at most one)
_JOBS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def start(loop, job: Job) -> Job:
    """Run ``job`` for ``loop`` in a thread of its own (not a daemon: an
    interpreter that exits finishes the checkpoint first)."""
    if _JOBS.get(loop) is not None:
        raise RuntimeError("hookloop: a save started while another is in flight (wait() first)")
    _JOBS[loop] = job
    job.thread = threading.Thread(target=job.run, name=f"hookloop-save {Path(job.name).name}", daemon=False)
    job.thread.start()
    return job


def pending(loop) -> Job | None:
    """The save of ``loop`` in flight, or finished and not yet settled."""
    return _JOBS.get(loop)


def settle(loop, block: bool = True):
    """Wait for ``loop``'s save (``block``; else only if it has finished),
    forget it and call its ``done``; a failed job's exception is raised here,
    on the training thread. Returns the job (None: none, or still running)."""
    job = _JOBS.get(loop)
    if job is None or (not block and not job.finished.is_set()):
        return None
    job.finished.wait()
    if job.thread is not None:
        job.thread.join()
    del _JOBS[loop]
    if job.error is not None:
        raise job._explain(job.error) if job._explain is not None else job.error
    if job._done is not None:
        job._done(job.result)
    return job


def wait(loop) -> Path | None:
    """Every process: wait for ``loop``'s save in flight, published on every
    rank; returns its directory (None: none). A failed one raises the
    :class:`CheckpointError` naming it on every process (one agreement)."""
    if pending(loop) is None:
        return None
    settled = None
    with every_rank(loop.accelerator):
        settled = settle(loop)
    return settled.result


def poll(loop) -> Path | None:
    """One process: settle ``loop``'s save if its writer has finished (free),
    raising its error here; with several processes nothing (they agree in
    :func:`wait`, at the next save or the fit's end)."""
    if loop.accelerator.num_processes > 1:
        return None
    settled = settle(loop, block=False)
    return None if settled is None else settled.result
