"""The run lock: a run holds the checkpoint root it writes to, so that no
other process resumes it or writes into it while it trains.

``<root>/hookloop.lock`` is JSON: ``host``, ``pid``, ``start_time`` (field 22
of ``/proc/<pid>/stat``), ``boot_id``, ``pid_namespace``, ``run_id``,
``root``, ``since`` / ``since_unix``, ``heartbeat`` / ``heartbeat_unix``,
``heartbeat_every``, ``stale_after`` and a ``token`` naming this hold. It is
taken by the main process when a fit starts (written whole under a temporary
name, then hard-linked to ``hookloop.lock``, which fails if one exists;
``O_EXCL`` without hard links), its heartbeat refreshed at safe points (at
most every :data:`HEARTBEAT_EVERY_S` s), released when the fit ends or raises
and at interpreter exit. It is stale when its process is gone: on this
machine (same host, boot id and pid namespace) when the pid is not alive, is
a zombie or runs with another start time; elsewhere, when its heartbeat is
older than its ``stale_after`` (``HOOKLOOP_LOCK_STALE_AFTER``, default 600 s).
A stale lock is taken over. Changes happen under an ``flock`` of the root
where the file system has one. docs/checkpoints.md, "The lock".
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import stat
import sys
import time
import uuid
import warnings
from pathlib import Path

from . import accelerate as accel
from .collective import every_rank
from .errors import CheckpointError
from .store import LATEST, STATE_FILE, TMP_PREFIX, fsync_dir, list_checkpoints

LOCK_FILE = "hookloop.lock"
FORMAT = "hookloop-lock"
#: the heartbeat is written at safe points at most this often (seconds)
HEARTBEAT_EVERY_S = 30.0
#: a lock of another machine is stale once its heartbeat is this old (seconds)
STALE_AFTER_S = 600.0
#: an unreadable lock file (being written) counts as live for this long after its mtime
_UNREADABLE_GRACE_S = 10.0


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """``(state, start time in clock ticks)`` of ``pid``: fields 3 and 22 of
    ``/proc/<pid>/stat``; None without /proc."""
    fields = (_read(f"/proc/{pid}/stat") or "").rsplit(")", 1)[-1].split()
    return (fields[0], fields[19]) if len(fields) >= 20 else None


_ME: dict | None = None


def _identity() -> dict:
    """This process: host, pid, start time, boot id, pid namespace."""
    global _ME
    if _ME is None or _ME["pid"] != os.getpid():  # (a forked child is another process)
        proc = _proc_stat(os.getpid())
        try:
            ns = os.readlink("/proc/self/ns/pid")
        except OSError:
            ns = None
        _ME = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": proc[1] if proc else None,
               "boot_id": _read("/proc/sys/kernel/random/boot_id"), "pid_namespace": ns}
    return _ME


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return (f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago"
            if seconds < 7200 else f"{seconds / 3600:.1f} h ago")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class LockInfo:
    """What ``<root>/hookloop.lock`` says (``doc``; ``{}`` if unreadable), and
    what it means here: ``live`` (its process runs, or may), ``ours`` (this
    process's), ``why``."""

    def __init__(self, path: Path, doc: dict, live: bool, ours: bool, why: str, mtime: float):
        self.path, self.doc, self.live, self.ours, self.why, self.mtime = path, doc, live, ours, why, mtime
        self.token = doc.get("token")

    def describe(self) -> str:
        """``host H, pid P, since T (N min ago), run R, last heartbeat N s ago``."""
        doc, now = self.doc, time.time()
        if not doc:
            return f"an unreadable lock file (modified {_ago(now - self.mtime)})"
        since = str(doc.get("since") or "?") + (f" ({_ago(now - doc['since_unix'])})"
                                                if _number(doc.get("since_unix")) else "")
        beat = f", last heartbeat {_ago(now - doc['heartbeat_unix'])}" if _number(doc.get("heartbeat_unix")) else ""
        return (f"host {doc.get('host', '?')}, pid {doc.get('pid', '?')}, since {since}, "
                f"run {str(doc.get('run_id') or '?')[:8]}{beat}")


def read_lock(root) -> LockInfo | None:
    """The lock of ``root`` (None: there is none), judged live or stale."""
    path = Path(root) / LOCK_FILE
    try:
        st = path.stat()
        # (never opened unless a regular file: a FIFO planted there would hang the read)
        raw = path.read_bytes()[:65536] if stat.S_ISREG(st.st_mode) else b""
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read the run lock {str(path)!r}: {type(exc).__name__}: {exc}") from exc
    try:
        doc = json.loads(raw.decode("utf-8"))
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError("not a hookloop lock")
    except (UnicodeDecodeError, ValueError):
        young = time.time() - st.st_mtime < _UNREADABLE_GRACE_S
        why = "it is being written" if young else "it is not a hookloop lock file (unreadable)"
        return LockInfo(path, {}, young, False, why, st.st_mtime)
    return LockInfo(path, doc, *_judge(doc, st.st_mtime), st.st_mtime)


def _judge(doc: dict, mtime: float) -> tuple[bool, bool, str]:
    """``(live, ours, why)`` for a lock's content."""
    me, pid, start = _identity(), doc.get("pid"), doc.get("start_time")
    same_host = doc.get("host") == me["host"]
    if same_host and doc.get("boot_id") and me["boot_id"] and doc["boot_id"] != me["boot_id"]:
        return False, False, "its machine restarted since (another boot id)"
    other_ns = bool(doc.get("pid_namespace") and me["pid_namespace"] and doc["pid_namespace"] != me["pid_namespace"])
    if same_host and not other_ns and isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
        if pid == me["pid"]:
            if start is None or me["start_time"] is None or start == me["start_time"]:
                return True, True, "this process holds it"
            return False, False, f"pid {pid} is now this process, started at another time"
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False, False, f"process {pid} is gone"
        except OSError:
            pass  # alive (another user's: PermissionError)
        proc = _proc_stat(pid)
        if proc is not None and proc[0] in ("Z", "X", "x"):
            return False, False, f"process {pid} has ended (a zombie)"
        if proc is not None and start is not None and proc[1] != start:
            return False, False, f"pid {pid} is another process now (started at tick {proc[1]}, not {start})"
        return True, False, f"process {pid} is running"
    # another machine (or a pid namespace this process cannot see into): the heartbeat
    beat = doc["heartbeat_unix"] if _number(doc.get("heartbeat_unix")) else 0.0
    after = doc["stale_after"] if _number(doc.get("stale_after")) and doc["stale_after"] > 0 else STALE_AFTER_S
    age, where = time.time() - max(beat, mtime), "another machine" if not same_host else "another pid namespace"
    if age > after:
        return False, False, f"on {where}, and no heartbeat for {age:.0f} s (stale after {after:.0f} s)"
    return True, False, f"on {where}, heartbeat {age:.0f} s ago (stale after {after:.0f} s)"


@contextlib.contextmanager
def _guard(root: Path, wait_s: float = 10.0):
    """An exclusive ``flock`` of the root directory for one change of the
    lock file; none where the file system has none, or after ``wait_s``
    (then the hard link alone keeps creation atomic)."""
    try:
        import fcntl

        fd = os.open(root, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    deadline = time.monotonic() + wait_s
    try:
        while time.monotonic() < deadline:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.005)
            except OSError:
                break  # not supported here
        yield
    finally:
        os.close(fd)  # (releases the flock)


def _write_temp(root: Path, doc: dict) -> Path:
    tmp = root / f"{TMP_PREFIX}lock-{os.getpid()}"  # (a leftover is removed by layout.clean)
    with open(tmp, "wb") as f:
        f.write((json.dumps(doc, indent=1) + "\n").encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
    return tmp


def _create(root: Path, doc: dict) -> bool:
    """Create the lock file with ``doc``, atomically; False if one exists."""
    path, tmp = root / LOCK_FILE, _write_temp(root, doc)
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:  # no hard links here: the content goes in under O_EXCL
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(tmp.read_bytes())
                f.flush()
                os.fsync(f.fileno())
    finally:
        os.unlink(tmp)
    fsync_dir(root)
    return True


class RunLock:
    """This process's hold on a root's lock (:func:`acquire`); ``owners``:
    who holds it (two ``Checkpoint`` plugins with one ``dir``)."""

    def __init__(self, root: Path, doc: dict):
        self.root, self.path, self.doc = root, root / LOCK_FILE, doc
        self.owners: set = set()
        self.pid, self._beat, self._lost = os.getpid(), time.monotonic(), False

    def refresh(self, force: bool = False) -> None:
        """Write the heartbeat, at most every :data:`HEARTBEAT_EVERY_S` s
        (``force``: now). A heartbeat that cannot be written, or a lock that
        another process took over, is a warning."""
        now = time.monotonic()
        if self._lost or (not force and now - self._beat < HEARTBEAT_EVERY_S):
            return
        self._beat = now
        try:
            with _guard(self.root):
                info = read_lock(self.root)
                if info is not None and info.token != self.doc["token"]:
                    self._lost = True
                    warnings.warn(f"hookloop: the run lock {self.path} was taken over by another process "
                                  f"({info.describe()}): two runs may now write into {self.root}",
                                  RuntimeWarning, stacklevel=3)
                    return
                t = time.time()
                self.doc.update(heartbeat=_stamp(t), heartbeat_unix=t)
                if info is None:  # deleted by hand: held again
                    _create(self.root, self.doc)
                else:
                    os.replace(_write_temp(self.root, self.doc), self.path)
        except (OSError, CheckpointError) as exc:
            warnings.warn(f"hookloop: cannot refresh the run lock {self.path}: {type(exc).__name__}: {exc}",
                          RuntimeWarning, stacklevel=3)

    def release(self, owner=None) -> None:
        """Let go for ``owner``; the last owner deletes the file, if it is
        still this hold's. Never raises."""
        self.owners.discard(id(owner))
        if self.owners or self.pid != os.getpid():
            return
        if _held.get(os.path.realpath(self.root)) is self:
            del _held[os.path.realpath(self.root)]
        with contextlib.suppress(OSError, CheckpointError), _guard(self.root):
            info = read_lock(self.root)
            if not self._lost and info is not None and info.token == self.doc["token"]:
                os.unlink(self.path)
                fsync_dir(self.root)


#: this process's holds, by the real path of their root
_held: dict[str, RunLock] = {}


def acquire(root, run_id: str, owner=None) -> RunLock:
    """Hold ``root`` (it exists) for this process, on the main process. A
    live lock of another process is a :class:`CheckpointError` naming it and
    what to do; a stale one is taken over with a warning naming it; one this
    process holds already gets another owner."""
    root = Path(root)
    lock = _held.get(os.path.realpath(root))
    if lock is not None and lock.pid == os.getpid() and not lock._lost:
        lock.owners.add(id(owner))
        lock.doc["run_id"] = run_id
        return lock
    t = time.time()
    stale_after = STALE_AFTER_S
    with contextlib.suppress(ValueError):
        stale_after = max(float(os.environ.get("HOOKLOOP_LOCK_STALE_AFTER", STALE_AFTER_S)), 1.0)
    doc = {"format": FORMAT, "version": 1, **_identity(), "run_id": run_id, "root": os.path.realpath(root),
           "since": _stamp(t), "since_unix": t, "heartbeat": _stamp(t), "heartbeat_unix": t,
           "heartbeat_every": HEARTBEAT_EVERY_S, "stale_after": stale_after, "token": uuid.uuid4().hex}
    try:
        with _guard(root):
            for _ in range(20):
                if _create(root, doc):
                    break
                info = read_lock(root)
                if info is None:
                    continue  # released meanwhile
                if info.ours:  # left by this process: a loop that never released it
                    os.replace(_write_temp(root, doc), info.path)
                    break
                if info.live:
                    raise CheckpointError(live_message(info, root, for_fit=True))
                # a crash is what resuming is for: one plain line, not a warning
                print(f"hookloop: taking over the stale run lock {info.path} of a run that ended without "
                      f"releasing it: {info.describe()}; {info.why}", file=sys.stderr)
                again = read_lock(root)  # the one judged stale still (under the guard)
                if again is not None and again.doc == info.doc:
                    os.unlink(info.path)
            else:
                raise CheckpointError(f"cannot take the run lock {str(root / LOCK_FILE)!r}: other "
                                      "processes keep taking it")
    except OSError as exc:
        raise CheckpointError(f"cannot take the run lock {str(root / LOCK_FILE)!r}: "
                              f"{type(exc).__name__}: {exc}") from exc
    lock = _held[os.path.realpath(root)] = RunLock(root, doc)
    lock.owners.add(id(owner))
    return lock


def live_message(info: LockInfo, root, *, for_fit: bool = False, resume_from=None) -> str:
    """What a second process is told about a live run's root."""
    if for_fit:
        what, effect = f"cannot train into {str(root)!r}", "its checkpoints would be mixed with that run's"
    else:
        what = f"resume_from={str(resume_from)!r}: not resuming {str(root)!r}"
        effect = "it would continue that run's checkpoints while that run writes them; nothing was loaded"
    return (f"{what}: a run that is still running holds it: {info.describe()} ({info.why}; lock "
            f"{str(info.path)!r}), and {effect}. Give this run a checkpoint folder of its own: "
            "Checkpoint(dir=...) with another directory, or, with the default run folders, start "
            "it without resume_from (it takes the next version_N). If that run is in fact not "
            f"running (on another machine), delete {str(info.path)!r}.")


def refuse_live_run(resume_from, root) -> None:
    """Before anything is read: a :class:`CheckpointError` on every process if
    ``resume_from`` (``"latest"`` of ``root``, a root, a checkpoint in one) is
    in a root that a live run of another process holds (the main process
    decides; one agreement)."""
    with every_rank():
        if accel.process_index() == 0:
            if resume_from == "latest":
                target = Path(root)
                if not ((target / LOCK_FILE).exists() and ((target / LATEST).exists() or list_checkpoints(target))):
                    return
            else:
                path = Path(os.fspath(resume_from)).expanduser()
                target = path if path.is_dir() and not (path / STATE_FILE).exists() else path.parent
            info = read_lock(target)
            if info is not None and info.live and not info.ours:
                raise CheckpointError(live_message(info, target, resume_from=resume_from))


@atexit.register
def _release_all() -> None:
    """At interpreter exit: every hold this process still has."""
    for lock in list(_held.values()):
        lock.owners.clear()
        lock.release()
