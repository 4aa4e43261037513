"""Writing and publishing a checkpoint's files, at memory speed, and in a
process of its own.

- :func:`write_file` writes a file as Accelerate does (``save_file``,
  ``torch.save``), its size and CRC-32 computed as the bytes go to the kernel
  (:class:`ChecksumFile`) or read back from the page cache, fsync'ed;
  :func:`write_files` writes several in parallel.
- :func:`finish` does a save's last steps on the main process (the files not
  written yet, hookloop's tensors, every size and CRC-32, the manifest, the
  rename into place, ``latest``, rotation), described by a :class:`Job`.
- :func:`host_copy` copies the models' and optimizers' states at the safe point
  into buffers of shared memory (each storage once, kept from the previous
  save of the same size; pinned and non-blocking from a GPU); a
  :class:`WriterProcess` (on Linux a fork of the training process, made
  when the fit starts and ready within milliseconds; elsewhere a new
  ``python``, ready once it has imported torch; never a re-import of the
  training script) checks their finiteness and runs :func:`finish` while
  training goes on, niced, killed with its parent.
  At most one save per loop is in flight (:func:`start`, :func:`wait`,
  :func:`poll`); a writer that dies is an error at the next safe point.
"""

from __future__ import annotations

import contextlib
import copy as _copy
import errno
import gc
import io
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from ..preemption import DEFAULT_SIGNALS
from ..state import RunIdentity
from . import finite, manifest, store
from .runs import Scan
from .collective import every_rank
from .errors import CheckpointError
from .store import FORMAT, LATEST, TENSORS_FILE, TRASH_PREFIX

#: bytes checksummed and written at a time (fits the caches with room to spare)
CHUNK = 4 << 20
#: how much nicer than training the writer process runs: on busy cores it yields to training,
#: and still finishes a save before the next one is due (10 starved it there: a write of 100 MB
#: took 0.5-1.5 s on 2 cores at load 2-3, and the next save, 10 updates later, waited for it)
WRITER_NICENESS = 5
#: ``module:function`` run in the writer process when it starts (tests: to slow or hold it)
SETUP_ENV = "HOOKLOOP_WRITER_SETUP"
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
            self.crc = store.crc32(chunk, self.crc)
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
        return store.synced_sum(path)
    with ChecksumFile(path) as out:
        if kind == "torch":
            torch.save(payload, out)
        else:
            out.write(payload)
        return out.close()


#: the threads that write one save's big files (1: one after the other, in a fixed order)
WRITE_THREADS = 4


def write_files(tmp: Path, files: list) -> dict:
    """``[rel, kind, payload, metadata]`` into ``tmp``, the big ones in parallel
    (the writes, checksums and fsyncs release the GIL): ``{rel: (size, crc32)}``."""
    if len(files) < 2 or WRITE_THREADS < 2:
        return {rel: write_file(tmp, rel, kind, payload, meta) for rel, kind, payload, meta in files}
    with ThreadPoolExecutor(min(len(files), WRITE_THREADS), thread_name_prefix="hookloop-write") as pool:
        futures = {f[0]: pool.submit(write_file, tmp, *f) for f in files}
        return {rel: future.result() for rel, future in futures.items()}


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


# -- the end of a save ----------------------------------------------------------------------


@dataclass
class Job:
    """The rest of a save, from its safe point: what :func:`finish` does on the
    main process (synchronously, or in the writer process)."""

    tmp: Path
    landing: Path  # where it is published: its name, or (latest names one of it) the next generation
    replaced: Path | None  # the checkpoint of its name that latest names: removed once latest moves on
    root: Path
    doc: dict  # the manifest, but the files' sizes and checksums
    tensors: dict  # the tensors of the plugin states
    run: RunIdentity  # whose checkpoints rotation may delete
    files: list = field(default_factory=list)  # [rel, kind, payload, metadata] not written yet
    known: dict = field(default_factory=dict)  # rel -> (size, crc32) of the files written
    update_latest: bool = True
    keep_last: int | None = None
    best: tuple | None = None  # (key, mode, k): the best k kept by rotation, the best named in the result
    floating: list = field(default_factory=list)  # a host copy's floating tensors: finiteness first


@dataclass
class Saved:
    """A published checkpoint: where it is, the best checkpoint of the run
    after it (``(value, path)``, when a ``best`` was asked for; the scan of
    the root that rotation used), and what failed after the rename, which
    published it (warnings, given on the training thread)."""

    path: Path
    best: tuple | None = None
    problems: list = field(default_factory=list)


def finish(job: Job) -> Saved:
    """Main process: the files not written yet, hookloop's tensors file, every
    file's size and checksum, the manifest, fsync, the rename into place
    (the commit point), ``latest``, rotation (one scan of the root, for the
    best ones and the rotation)."""
    tmp, doc = job.tmp, job.doc
    files = {**job.known, **write_files(tmp, job.files)}
    if TENSORS_FILE not in files:  # (an asynchronous save's is among its host copy's files)
        files[TENSORS_FILE] = write_file(tmp, TENSORS_FILE, "safetensors", job.tensors, {"format": FORMAT})
    for file in sorted(tmp.rglob("*")):
        rel = file.relative_to(tmp).as_posix()
        if file.is_file() and rel not in files:  # Accelerate's small files, each rank's own
            files[rel] = store.synced_sum(file)
    for rel, (size, crc) in sorted(files.items()):
        doc["files"][rel], doc["crc32"][rel] = size, crc
    manifest.write(tmp, doc)
    store.fsync_dir(tmp)
    publish(tmp, job.landing)
    saved, root = Saved(job.landing), job.root
    if job.update_latest:
        try:
            store.write_latest(root, job.landing.name)
        except OSError as exc:  # (the folder is published: the newest checkpoint, once latest is gone)
            saved.problems.append(f"{root / LATEST} could not name {job.landing.name} ({type(exc).__name__}: "
                                  f"{exc}); it was removed, so resume_from='latest' finds the newest checkpoint")
            with contextlib.suppress(OSError):
                os.unlink(root / LATEST)
    try:
        if job.replaced is not None and job.update_latest:  # an older save of this position, now that latest moved on
            store.remove(job.replaced)
        if job.keep_last or job.best:
            scan = Scan(root)
            best = scan.best(job.run, *job.best) if job.best else []
            saved.best = best[0] if best else None
            if job.keep_last:
                latest = job.landing.name if job.update_latest else store.read_latest_quietly(root)
                scan.rotate(job.run, job.keep_last, {p.name for _, p in best}, latest=latest)
    except Exception as exc:  # noqa: BLE001 - after the commit point: said, not raised
        saved.problems.append(f"removing the older checkpoints of {root} failed ({type(exc).__name__}: {exc}); "
                              f"{job.landing.name} is published")
    return saved


def settled(saved: Saved, on_published=None) -> None:
    """On the training thread: what failed after the publish, as warnings; then ``on_published(saved)``."""
    for problem in saved.problems:
        warnings.warn(f"Checkpoint: {problem}", RuntimeWarning, stacklevel=3)
    if on_published is not None:
        on_published(saved)


def publish(tmp: Path, landing: Path) -> None:
    """Rename the finished save into place. A checkpoint at ``landing`` that
    ``latest`` does not name is moved aside first and deleted after (one that
    ``latest`` names is never replaced: the save lands on the next generation)."""
    root, trash = landing.parent, None
    if landing.exists():
        trash = landing.with_name(f"{TRASH_PREFIX}{landing.name}-{os.getpid()}")
        os.rename(landing, trash)
    os.rename(tmp, landing)
    store.fsync_dir(root)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


# -- the host copy, in shared memory ------------------------------------------------------


@dataclass
class Snapshot:
    """A host copy: the files with their tensors copied, the host buffers,
    and the floating copies ``(rel, key, copy)``."""

    files: list = field(default_factory=list)
    copied: int = 0  # bytes copied to host memory
    storages: list = field(default_factory=list)  # (path, host buffer): back to the pool after the write
    floating: list = field(default_factory=list)

    def release(self, acc) -> None:
        """The write is done: its host buffers serve the next copy."""
        pool = _POOLS.setdefault(acc, {})
        for path, buffer in self.storages:
            pool.setdefault(buffer.nbytes(), []).append((path, buffer))
        self.storages, self.files, self.floating = [], [], []


def find_nonfinite(floating) -> tuple | None:
    """``(rel, key, value)`` of the first tensor of ``floating`` holding a NaN
    or an infinity, or None: one fused reduction, off the training thread."""
    found = finite.first_bad(floating)
    return None if found is None else (found[0], "".join(f"[{k!r}]" for k in found[1]), found[2])


#: accelerator -> free host buffers by size: (the file that backs it, its storage)
_POOLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: real path of a buffer's file -> the storage (what the writer's pickle refers to)
_SHARED: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _buffer(nbytes: int, pinned: bool) -> tuple[str, Any]:
    """A host buffer of ``nbytes`` shared with the writer process: a file of
    shared memory mapped by both (pinned for a GPU's non-blocking copies). Its
    space is reserved first: a full ``/dev/shm`` (64 MiB in a default Docker
    container) would kill the copy with SIGBUS; the temporary directory's
    page cache serves then."""
    if not _SHARED:
        _remove_leftovers()
    for where in dict.fromkeys((_DIR, tempfile.gettempdir())):
        fd, path = tempfile.mkstemp(prefix=f"hookloop-{os.getpid()}-", dir=where)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, max(nbytes, 1))
            break
        except OSError:
            _unlink(path)
        finally:
            os.close(fd)
    else:
        raise CheckpointError(f"no memory for the host copy of an asynchronous save ({nbytes} bytes in {_DIR} "
                              f"or {tempfile.gettempdir()}); give the container more shared memory "
                              "(docker run --shm-size), or save synchronously")
    storage = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8).untyped_storage()
    weakref.finalize(storage, _unlink, path)
    if pinned:
        with contextlib.suppress(Exception):  # (unpinned, the copy still lands: it blocks)
            torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), storage.nbytes(), 0)
    _SHARED[path] = storage
    return path, storage


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _remove_leftovers() -> None:
    """The host buffers of processes killed before they could remove them."""
    for where in dict.fromkeys((_DIR, tempfile.gettempdir())):
        for path in Path(where).glob("hookloop-*-*"):
            pid = path.name.split("-")[1]
            if pid.isdigit() and not _alive(int(pid)):
                _unlink(str(path))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return True


#: accelerator -> the thread allocating its first host buffers (:func:`prepare_buffers`)
_PREPARING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_PREPARED: "weakref.WeakSet" = weakref.WeakSet()


def prepare_buffers(acc, states: list) -> None:
    """Allocate, in a thread of their own, the host buffers of ``acc``'s
    first asynchronous save: one per storage of ``states`` (the models' and
    optimizers' state dicts as they are now), their pages touched, into the
    pool the first :func:`host_copy` takes from. What the first save would
    allocate on the training thread (~25 ms per 100 MB on a quiet machine,
    several times that on busy cores), allocated once per accelerator while
    training goes on (the work, but a few Python lines, is outside the GIL).
    A buffer that fails is left to the save (which names the error)."""
    if acc in _PREPARED:
        return
    _PREPARED.add(acc)
    sizes, seen = [], set()
    for state in states:
        for t in _tensors(state):
            source = t.untyped_storage()
            if (t.device, source.data_ptr()) not in seen:
                seen.add((t.device, source.data_ptr()))
                sizes.append((source.nbytes(), t.device.type == "cuda"))
    if not sizes:
        return
    free: list = []

    def allocate() -> None:
        with contextlib.suppress(Exception):
            for nbytes, pinned in sizes:
                path, buffer = _buffer(nbytes, pinned)
                torch.empty((0,), dtype=torch.uint8).set_(buffer, 0, (buffer.nbytes(),), (1,)).zero_()  # (faulted in)
                free.append((path, buffer))

    thread = threading.Thread(target=allocate, name="hookloop-host-buffers", daemon=True)
    _PREPARING[acc] = (thread, free)
    thread.start()


def _take_prepared(acc) -> None:
    """The buffers :func:`prepare_buffers` allocated, into the pool (waiting
    for the thread when it is still at work)."""
    preparing = _PREPARING.pop(acc, None)
    if preparing is not None:
        thread, free = preparing
        thread.join()
        pool = _POOLS.setdefault(acc, {})
        for path, buffer in free:
            pool.setdefault(buffer.nbytes(), []).append((path, buffer))


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def host_copy(acc, files: list) -> Snapshot:
    """The files to write with every tensor copied to shared host memory, each
    storage once (views and shared storages stay views and shared, as
    ``torch.save`` records them), every container new in its own type and
    order (so that it pickles as the original does)."""
    _take_prepared(acc)
    pool, out = _POOLS.setdefault(acc, {}), Snapshot(files)
    storages: dict[tuple[Any, int], Any] = {}  # (device, data_ptr) -> host storage

    def tensor(t: torch.Tensor, rel: str, key: tuple) -> torch.Tensor:
        source = t.untyped_storage()
        host = storages.get((t.device, source.data_ptr()))
        if host is None:
            pinned, free = t.device.type == "cuda", pool.get(source.nbytes())
            path, host = free.pop() if free else _buffer(source.nbytes(), pinned)
            host.copy_(source, non_blocking=pinned)
            storages[(t.device, source.data_ptr())] = host
            out.storages.append((path, host))
            out.copied += source.nbytes()
        copied = torch.empty((0,), dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())
        if t.requires_grad and t.is_leaf:
            copied.requires_grad_(True)
        if (t.is_floating_point() or t.is_complex()) and rel != TENSORS_FILE:  # (plugins' may be NaN)
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
    return out


class _Pickler(pickle.Pickler):
    """A job for the writer: a tensor of a host buffer goes as a reference to
    the buffer's file (the writer maps the same memory), not as its bytes."""

    def __init__(self, file, buffers: dict):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.buffers = buffers  # data_ptr of a host buffer -> its file

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            path = self.buffers.get(obj.untyped_storage().data_ptr())
            if path is not None:
                return ("host", path, obj.untyped_storage().nbytes(), obj.dtype, tuple(obj.size()),
                        obj.stride(), obj.storage_offset(), obj.requires_grad)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file):
        super().__init__(file)
        self.mapped: dict[str, Any] = {}

    def persistent_load(self, pid):
        _, path, nbytes, dtype, size, stride, offset, grad = pid
        if path not in self.mapped:
            self.mapped[path] = torch.from_file(path, shared=True, size=max(nbytes, 1),
                                                dtype=torch.uint8).untyped_storage()
        out = torch.empty((0,), dtype=dtype).set_(self.mapped[path], offset, size, stride)
        return out.requires_grad_(True) if grad else out


def dumps(job: Job, snapshot: Snapshot) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, {storage.data_ptr(): path for path, storage in snapshot.storages}).dump(job)
    return buffer.getvalue()


def loads(data: bytes) -> Job:
    return _Unpickler(io.BytesIO(data)).load()


# -- the writer process ---------------------------------------------------------------------

#: how a writer process starts: ``"fork"`` (Linux): a fork of the training process, torch
#: imported already, ready within milliseconds of the fit's start; ``"interpreter"``: a new
#: ``python`` (macOS, where a fork of a process using Apple's frameworks is unsafe), ready
#: once it has imported torch, 1.5-4 s later: the saves before then wait for it
START = "fork" if sys.platform.startswith("linux") else "interpreter"
#: seconds a forked writer may take to say it is ready (its setup hook included)
READY_TIMEOUT = 60.0


class WriterProcess:
    """The writer process (:func:`_serve`): jobs in, results out, over a
    pipe pair; it exits when its pipe closes or its parent dies. Its first
    message says it is ready (:meth:`wait_ready`)."""

    def __init__(self, start: str | None = None):
        jobs_read, jobs_write = os.pipe()
        results_read, results_write = os.pipe()
        self.ready = False
        try:
            if (start or START) == "fork":
                self.process: Any = _fork(jobs_read, results_write)
            else:
                package = str(Path(__file__).resolve().parents[2])  # (found even if a script put it on sys.path)
                env = {**os.environ, "OMP_NUM_THREADS": "1",
                       "PYTHONPATH": os.pathsep.join(filter(None, (package, os.environ.get("PYTHONPATH"))))}
                self.process = subprocess.Popen(
                    [sys.executable, "-c", "from hookloop.checkpointing.writer import main; main()",
                     str(jobs_read), str(results_write), str(os.getpid())], pass_fds=(jobs_read, results_write),
                    env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            for fd in (jobs_write, results_read):
                os.close(fd)
            raise
        finally:
            os.close(jobs_read)
            os.close(results_write)
        self.jobs, self.results = Connection(jobs_write, readable=False), Connection(results_read, writable=False)

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def dead(self) -> int | None:
        """Its exit status once it has ended, else None."""
        return self.process.poll()

    def receive(self, timeout: float) -> tuple | None:
        """The next answer to a job, waiting up to ``timeout`` seconds (None:
        none yet); the ready message is taken on the way."""
        while self.results.poll(timeout):
            message = self.results.recv()
            if message[0] != "ready":
                return message
            self.ready = True
        return None

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Wait for its ready message; a :class:`CheckpointError` naming it
        if it ended, or was not ready within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.ready:
            with contextlib.suppress(EOFError, OSError):
                if self.results.poll(min(0.2, max(deadline - time.monotonic(), 0))):
                    message = self.results.recv()
                    if message[0] != "ready":
                        raise CheckpointError(f"the checkpoint writer process (pid {self.pid}) answered "
                                              f"{message!r} before it was ready")
                    self.ready = True
                    return
            status = self.dead()
            if status is not None:
                raise CheckpointError(f"the checkpoint writer process (pid {self.pid}) exited with status "
                                      f"{status} before it was ready (its error is on stderr)")
            if time.monotonic() >= deadline:
                raise CheckpointError(f"the checkpoint writer process (pid {self.pid}) was not ready within "
                                      f"{timeout:.0f} s of its start")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.jobs.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        if self.process.poll() is None:
            self.process.kill()


class _Child:
    """A forked writer, as much of ``subprocess.Popen`` as
    :class:`WriterProcess` uses (``pid``, ``poll``, ``wait``, ``kill``)."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None  # type: int, int | None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # (reaped by someone else: SIGCHLD ignored)
                self.returncode = 0
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"writer process {self.pid}", timeout)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(timeout=5)


def _fork(jobs_read: int, results_write: int) -> _Child:
    """Fork the writer process off the training process. The child keeps
    of the parent only what :func:`_serve` uses: torch and this module,
    already imported (no start-up to wait for). It closes every other
    inherited file descriptor (a root's ``flock``, sockets, other writers'
    pipes: none stays open because a writer lives), never collects or
    touches the parent's objects (``gc.freeze``: no copy-on-write of their
    pages, no finalizer of theirs runs: the host buffers stay the parent's to
    remove), runs no ``atexit`` handler of the parent's (``os._exit``), and
    uses no CUDA, no thread of the parent's and no lock another thread may
    hold (torch single-threaded, as in a DataLoader worker, which is forked the
    same way); so a fork of a multi-threaded process is safe here, and
    Python's warning about it (3.12+) is silenced."""
    import ctypes  # noqa: F401 - what the child imports, imported here: a module that another thread
    import safetensors.torch  # noqa: F401 - is importing at the fork would stay locked in the child

    for stream in (sys.stdout, sys.stderr):  # (else the child would write the parent's buffered text again)
        with contextlib.suppress(Exception):
            stream.flush()
    parent = os.getpid()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid:
        return _Child(pid)
    status = 1
    try:  # the writer: it never returns into the training process's code
        gc.freeze()
        for number in _python_handled():  # the training process's to handle (the preemption plugin's)
            signal.signal(number, signal.SIG_DFL if number == signal.SIGCHLD else signal.SIG_IGN)
        keep = {0, 1, 2, jobs_read, results_write}
        for fd in sorted(map(int, os.listdir("/proc/self/fd"))):
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        with contextlib.suppress(OSError):  # the process's own stdout and stderr, as a new python's (not an
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # object of the parent's: a notebook's)
            sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
        _serve(Connection(jobs_read, writable=False), Connection(results_write, readable=False), parent)
        status = 0
    except BaseException:  # noqa: BLE001 - the child's last words, then out
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(status)


def _python_handled() -> list:
    """The signals with a Python handler in this process (the preemption
    plugin's, a test runner's): a forked writer runs none of them."""
    out = []
    for number in signal.valid_signals():
        with contextlib.suppress(ValueError, OSError, TypeError):
            if callable(signal.getsignal(number)):
                out.append(number)
    return out


def _serve(jobs: Connection, results: Connection, parent: int) -> None:
    """The writer process's loop: each job's finiteness, then :func:`finish`.
    Ctrl-C and the preemption signals (sent to the whole process group, or
    to every process of a job by a cluster that preempts it) are the
    training process's to handle: the writer ignores them and finishes the
    save in flight, which the training process waits for before its own
    checkpoint; it ends with its pipe, or with its parent."""
    with contextlib.suppress(OSError, AttributeError):
        os.nice(WRITER_NICENESS)  # on busy cores it takes the time training leaves
    with contextlib.suppress(Exception):  # Linux: killed with its parent, never left writing alone
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        return  # (orphaned before the line above: the run that started it is gone)
    for name in DEFAULT_SIGNALS:  # (SIGINT, SIGTERM, SIGUSR1)
        with contextlib.suppress(ValueError, OSError):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    torch.set_num_threads(1)
    if os.environ.get(SETUP_ENV):
        import importlib
        import runpy

        module, _, function = os.environ[SETUP_ENV].rpartition(":")  # (a module, or a file: a.py)
        names = runpy.run_path(module) if module.endswith(".py") else vars(importlib.import_module(module))
        names[function]()
    results.send(("ready", os.getpid()))
    while True:
        try:
            data = jobs.recv_bytes()
        except (EOFError, OSError):
            return  # the loop was closed
        job = loads(data)
        try:
            found = find_nonfinite(job.floating)  # on the copy, before any file is written
            if found is not None:
                shutil.rmtree(job.tmp, ignore_errors=True)
                results.send(("nonfinite", found))
                continue
            if os.getppid() != parent:
                return  # (orphaned: the run that asked for it is gone)
            results.send(("done", finish(job)))
        except BaseException as exc:  # noqa: BLE001 - reported to the training process
            shutil.rmtree(job.tmp, ignore_errors=True)
            detail = str(exc) if isinstance(exc, CheckpointError) else write_error(exc, job.root, "writing it")
            results.send(("error", detail))
        finally:
            del job


# -- one background save per loop ------------------------------------------------------


@dataclass
class Pending:
    """A save in flight, the one place that knows it is in flight and where
    it lands; handed to ``writer`` (None: nothing to write on this process,
    it lands where the main process publishes it)."""

    landing: Path
    tmp: Path
    snapshot: Snapshot | None = None
    writer: WriterProcess | None = None
    done: Any = None  # called on the training thread with the Saved
    explain: Any = None  # the writer's (kind, detail) -> the exception to raise
    result: Saved | None = None


#: loop -> its save in flight (at most one); loop -> its writer process
_PENDING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_WRITERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def writer_of(loop, ready: bool = False) -> WriterProcess:
    """The writer process of ``loop`` (started the first time; again if it
    died since), closed with the loop. ``ready``: a forked writer has said it
    is ready before this returns (milliseconds: no save waits for it later);
    a new interpreter's start-up is never waited for here (it overlaps
    training; the first job waits in its pipe)."""
    process = _WRITERS.get(loop)
    if process is None or process.dead() is not None:
        process = _WRITERS[loop] = WriterProcess()
        weakref.finalize(loop, process.close)
    if ready and not process.ready and isinstance(process.process, _Child):
        try:
            process.wait_ready()
        except CheckpointError:
            _WRITERS.pop(loop, None)
            process.close()
            raise
    return process


def start_early(loop) -> None:
    """When a loop with asynchronous saves is built: a writer that is a new
    interpreter starts now, its imports overlapping the loop's own; a forked
    one waits for the fit (it is ready at once)."""
    if START != "fork":
        writer_of(loop)


def close(loop) -> None:
    process = _WRITERS.pop(loop, None)
    if process is not None:
        process.close()


def start(loop, pending: Pending, job: Job | None = None) -> None:
    """Hand ``job`` to the writer process of ``loop`` (None: nothing to write
    on this process, the save is done)."""
    if _PENDING.get(loop) is not None:
        raise RuntimeError("hookloop: a save started while another is in flight (wait() first)")
    if job is not None:
        assert pending.snapshot is not None
        data, pending.writer = dumps(job, pending.snapshot), writer_of(loop)
        with contextlib.suppress(OSError):  # (a writer that just died: settle() reports it)
            pending.writer.jobs.send_bytes(data)
    _PENDING[loop] = pending


def pending(loop) -> Pending | None:
    """The save of ``loop`` in flight, or finished and not yet settled."""
    return _PENDING.get(loop)


def settle(loop, block: bool = True) -> Pending | None:
    """Wait for ``loop``'s save (``block``; else only if it has finished),
    forget it and call its ``done``; its failure is raised here, on the
    training thread (a writer that died: a :class:`CheckpointError`).
    Returns it (None: none, or still being written)."""
    job = _PENDING.get(loop)
    if job is None:
        return None
    if job.writer is not None:
        message = None
        while message is None:
            try:
                message = job.writer.receive(0.2 if block else 0)
                if message is not None:
                    continue
            except (EOFError, OSError):
                pass
            status = job.writer.dead()
            if status is not None:  # (died before it answered: killed, or out of memory)
                _WRITERS.pop(loop, None)
                shutil.rmtree(job.tmp, ignore_errors=True)
                message = ("error", f"the checkpoint writer process (pid {job.writer.pid}) died with exit "
                                    f"status {status} while writing it")
            elif not block:
                return None
        kind, value = message
        if job.snapshot is not None:
            job.snapshot.release(loop.accelerator)
        if kind != "done":
            del _PENDING[loop]
            store.mark_live(job.tmp, False)
            raise job.explain(kind, value)
        job.result = value
    del _PENDING[loop]
    store.mark_live(job.tmp, False)
    settled(job.result or Saved(job.landing), job.done)
    return job


def wait(loop) -> Path | None:
    """Every process: wait for ``loop``'s save in flight, published on every
    rank; returns its directory (None: none). A failed one raises the
    :class:`CheckpointError` naming it on every process (one agreement)."""
    if pending(loop) is None:
        return None
    done = None
    with every_rank(loop.accelerator):
        done = settle(loop)
    return done.landing if done is not None else None


def poll(loop) -> Path | None:
    """One process: settle ``loop``'s save if its writer has finished (free),
    raising its error here; with several processes nothing (they agree in
    :func:`wait`, at the next save or the fit's end)."""
    if loop.accelerator.num_processes > 1:
        return None
    done = settle(loop, block=False)
    return None if done is None else done.landing


def main() -> None:
    """The writer process (``python -c``: ``-m`` would run a second copy of
    this module, which a setup hook could not reach)."""
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False),
           int(sys.argv[3]))
