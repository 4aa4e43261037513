"""Writing checkpoint files at memory speed, and in the background.

- :class:`ChecksumFile` and :func:`write_file`: a file written as Accelerate
  writes it (``safetensors.torch.save_file``, ``torch.save``), its size and
  CRC-32 computed on the bytes as they are handed to the kernel (or read
  back from the page cache), fsync'ed.
- :class:`Snapshot` and :func:`host_copy`: the models' and optimizers' states
  copied to host memory at the safe point (each storage once, into buffers
  kept from the previous save of the same sizes; pinned and non-blocking
  from a GPU), so that training goes on while they are written. Their
  finiteness is checked by the writer, off the training thread.
- :class:`Job` and :func:`start` / :func:`settle` / :func:`wait` /
  :func:`poll`: at most one save of a loop written by a background thread
  at a time. The thread only writes files; every collective stays on the
  training thread, in the same order on every rank.
- :func:`write_error`: the message of a failed write (a full disk named so).
"""

from __future__ import annotations

import contextlib
import copy as _copy
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
_OPEN = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


class ChecksumFile:
    """A new file written through ``write`` (a file object for
    ``torch.save``), its CRC-32 (:func:`~.manifest.crc32`) and size kept as
    it goes. :meth:`close` fsyncs it and returns ``(size, crc32)``."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd = os.open(self.path, _OPEN, 0o644)
        self.size = 0
        self.crc = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        for start in range(0, total, CHUNK):
            chunk = view[start:start + CHUNK]
            self.crc = safe_read.crc32(chunk, self.crc)
            while len(chunk):
                chunk = chunk[os.write(self.fd, chunk):]
        self.size += total
        return total

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
    """Write ``folder / rel`` as Accelerate would (``kind``:
    ``"safetensors"``: ``safetensors.torch.save_file`` of a state dict, with
    ``metadata``; ``"torch"``: ``torch.save``); fsync it; returns ``(size,
    crc32)``.

    A safetensors file is ``save_file``'s, byte for byte, checksummed by
    reading it back from the page cache: ``save_file`` writes ~4x faster
    than ``safetensors.torch.save`` builds the bytes in memory (10 against
    40 ms for 25 MB), and the read-back costs ~6 ms. A ``torch.save`` file
    goes through a :class:`ChecksumFile` (as fast as ``torch.save`` to a
    path, and no read-back); it holds the same zip records, byte for byte,
    as ``torch.save(obj, path)`` writes; only the name of the zip's top
    folder differs (torch names it after the file only when it opens the
    file itself; ``archive`` for a stream), which ``torch.load`` ignores."""
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


@dataclass
class Snapshot:
    """The files left to write: ``files`` as ``[rel, kind, payload,
    metadata]`` for :func:`write_file` (on the main process);
    ``copied``: bytes copied to host memory; ``floating``: ``(rel, key,
    copy)`` of every floating tensor copied (for :meth:`find_nonfinite`)."""

    files: list = field(default_factory=list)
    copied: int = 0
    storages: list = field(default_factory=list)  # the host buffers, back to the pool after the write
    floating: list = field(default_factory=list)

    def find_nonfinite(self) -> tuple | None:
        """``(rel, key, value)`` of the first copied tensor holding a NaN or an
        infinity, or None: one fused reduction over the host copy
        (:func:`~.finite.first_nonfinite`), off the training thread."""
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


class _Copier:
    """Copies tensors to host memory, each storage once, listing the
    floating copies (``check``) for :meth:`Snapshot.find_nonfinite`."""

    def __init__(self, pool: dict, check: bool):
        self.pool = pool
        self.checking = check
        self.storages: dict[tuple[Any, int], Any] = {}  # (device, data_ptr) -> host storage
        self.copied = 0
        self.floating: list[tuple[str, tuple[Any, ...], Any]] = []  # (rel, key, host copy)

    def _host_storage(self, source, device):
        nbytes = source.nbytes()
        pinned = device.type == "cuda"
        free = self.pool.get((nbytes, pinned))
        host = free.pop() if free else torch.empty(nbytes, dtype=torch.uint8,
                                                   pin_memory=pinned).untyped_storage()
        host.copy_(source, non_blocking=pinned)
        self.copied += nbytes
        return host

    def tensor(self, t: torch.Tensor, rel: str, key: tuple) -> torch.Tensor:
        source = t.untyped_storage()
        where = (t.device, source.data_ptr())
        host = self.storages.get(where)
        if host is None:
            host = self.storages[where] = self._host_storage(source, t.device)
        copied = torch.empty((0,), dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())
        if t.requires_grad and t.is_leaf:
            copied.requires_grad_(True)
        if self.checking and (t.is_floating_point() or t.is_complex()):
            self.floating.append((rel, key, copied))
        return copied

    def copy(self, obj, rel: str, key: tuple = ()):
        """``obj`` with every tensor copied and every container new (in its
        own type and order, so that it pickles as ``obj`` does); ``key``:
        the path to ``obj`` (formatted only for an error)."""
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, rel, key)
        if isinstance(obj, dict):
            new = obj.__class__() if type(obj) in (dict, OrderedDict) else _copy.copy(obj)
            for k, v in obj.items():
                new[k] = self.copy(v, rel, (*key, k))
            return new
        if isinstance(obj, list):
            return [self.copy(v, rel, (*key, i)) for i, v in enumerate(obj)]
        if type(obj) is tuple:
            return tuple(self.copy(v, rel, (*key, i)) for i, v in enumerate(obj))
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
            return obj
        return _copy.deepcopy(obj)  # anything else a state dict may hold: its own copy


def host_copy(acc, files: list, check: bool = True) -> Snapshot:
    """The files to write (``[rel, kind, state, metadata]``) with every
    tensor copied to host memory; their floating tensors listed for
    :meth:`Snapshot.find_nonfinite` (``check``)."""
    out = Snapshot(files)
    copier = _Copier(_POOLS.setdefault(acc, {}), check)
    for entry in out.files:
        entry[2] = copier.copy(entry[2], entry[0])
    if any(device.type == "cuda" for device, _ in copier.storages):
        torch.cuda.current_stream().synchronize()  # the non-blocking copies have landed
    out.floating = copier.floating
    out.copied = copier.copied
    out.storages = list(copier.storages.values())
    return out


# -- one background save per loop ------------------------------------------------------


class Job:
    """One save being written by a background thread (or, ``background``
    False, run at once by :func:`start`). ``done(result)`` and
    ``explain(error)`` (what to raise instead) run on the training thread,
    when it is settled.

    :ivar name: the checkpoint's folder, as the error names it.
    :ivar result: what ``work()`` returned (the published checkpoint).
    :ivar error: the exception it raised, or None.
    """

    def __init__(self, name: str, work, done=None, explain=None):
        self.name = name
        self._work = work
        self._done = done  # called on the training thread when the job is settled
        self._explain = explain  # its error -> the error to raise, on the training thread
        self.result = None
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self.thread: threading.Thread | None = None

    def run(self) -> None:
        try:
            self.result = self._work()
        except BaseException as exc:  # noqa: BLE001 - reported where the job is settled
            self.error = exc
        finally:
            self._work = None  # (its closure holds the host copy: free it now)
            self.finished.set()


#: loop -> its save in flight (at most one)
_JOBS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def start(loop, job: Job, background: bool = True) -> Job:
    """Run ``job`` for ``loop``: in a thread of its own (not a daemon: an
    interpreter that exits finishes the checkpoint first), or at once."""
    if pending(loop) is not None:
        raise RuntimeError("hookloop: a save started while another is in flight (wait() first)")
    _JOBS[loop] = job
    if not background:
        job.run()
        return job
    job.thread = threading.Thread(target=_behind_training, args=(job,),
                                  name=f"hookloop-save {Path(job.name).name}", daemon=False)
    job.thread.start()
    return job


#: how much nicer than training the writer thread runs (Linux: per thread)
WRITER_NICENESS = 10


def _behind_training(job: Job) -> None:
    """Run ``job`` with a lower CPU priority than the training thread: where
    the cores are busy, the writer takes the time training leaves (where one
    is free, it runs as fast). Only this thread's priority changes (Linux
    gives each thread its own); elsewhere it runs as it is."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + WRITER_NICENESS)
    job.run()


def pending(loop) -> Job | None:
    """The save of ``loop`` in flight or finished and not yet settled."""
    return _JOBS.get(loop)


def settle(loop, block: bool = True):
    """Settle ``loop``'s save: wait for it (``block``; else only if it has
    finished), then forget it and call its ``done``. Returns the job (None:
    none, or still running). A failed job's exception is re-raised here,
    on the training thread."""
    job = _JOBS.get(loop)
    if job is None:
        return None
    if not block and not job.finished.is_set():
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
    """Every process: wait for ``loop``'s save in flight (an asynchronous
    :func:`save`), published on every rank. Returns its directory (None:
    none was in flight); a failed one raises, on every process, the
    :class:`CheckpointError` naming it (``latest`` still names the previous
    checkpoint). One agreement with several processes."""
    if pending(loop) is None:
        return None
    settled = None
    with every_rank(loop.accelerator):
        settled = settle(loop)
    return settled.result


def poll(loop) -> Path | None:
    """One process: settle ``loop``'s save if its writer has finished (free:
    a flag), raising its error here. With several processes nothing (they
    agree in :func:`wait`, at the next save or at the fit's end)."""
    if loop.accelerator.num_processes > 1:
        return None
    settled = settle(loop, block=False)
    return None if settled is None else settled.result


def write_files(tmp: Path, snapshot) -> dict:
    """The files of a :class:`~.host_copy.Snapshot` into ``tmp``, each fsync'ed,
    checksummed as it is written: ``{rel: (size, crc32)}``."""
    return {rel: write_file(tmp, rel, kind, payload, metadata)
            for rel, kind, payload, metadata in snapshot.files}


def write_error(exc: BaseException, root: Path, what: str) -> str:
    """The message for a failed write: ``no space left on <dir>`` when the
    disk (or quota) is full, whatever the library that hit it said (torch's
    zip writer reports ``unexpected pos``), else the error itself."""
    import errno

    full = False
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
            full = True
        cause = cause.__cause__ or cause.__context__
    free = None
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(root if root.exists() else root.parent).free
    if not full and free is not None and free < (1 << 20):
        full = True  # a write failed on a disk with less than 1 MiB left
    detail = f"{type(exc).__name__}: {exc}"
    if full:
        left = f" ({free} bytes free)" if free is not None else ""
        return (f"no space left on {root}{left}: {what} ({detail}). Free some space or give "
                "Checkpoint(dir=...) another disk; the unfinished checkpoint was removed and "
                "'latest' still names the previous one")
    return f"{what}: {detail}"
