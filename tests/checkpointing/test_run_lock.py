"""The run lock: a live run is never taken over.

A run holds its checkpoint root (``<root>/hookloop.lock``) from the start of
a fit to its end, however it ends; another process asking for its
``latest`` (or a checkpoint in it) is refused before anything is read; a
lock whose process is gone is stale and taken over with a warning; two runs
started together get two run folders and temporary save folders of their
own. The lock files these tests write by hand are JSON as docs/checkpoints.md
("The lock") describes them.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hookloop import checkpointing, hookimpl
from hookloop.checkpointing import CheckpointError
from hookloop.plugins import Checkpoint
from hookloop.preemption import PREEMPTED_EXIT_CODE, Preempted
from hookloop.testing import reset_accelerate, tiny_loop

import runner

LOCK = "hookloop.lock"
ARGS = ("--strategy", "supervised", "--accum", "2", "--epochs", "3", "--every-steps", "3")


# -- helpers -------------------------------------------------------------------------


def _read(path):
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def start_time(pid):
    text = _read(f"/proc/{pid}/stat")
    return text.rsplit(")", 1)[1].split()[19] if text else None


def write_lock(root, pid, *, host=None, start="auto", heartbeat_age=0.0, boot_id="auto",
               run_id="feedc0de" * 4):
    """A lock as another process would have written it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    now = time.time()
    since = now - 3600
    ns = None
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    doc = {
        "format": "hookloop-lock", "version": 1, "host": host or socket.gethostname(), "pid": pid,
        "start_time": start_time(pid) if start == "auto" else start,
        "boot_id": _read("/proc/sys/kernel/random/boot_id") if boot_id == "auto" else boot_id,
        "pid_namespace": ns, "run_id": run_id, "root": os.path.realpath(root),
        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(since)), "since_unix": since,
        "heartbeat": "", "heartbeat_unix": now - heartbeat_age, "heartbeat_every": 30.0,
        "stale_after": 600.0, "token": "0" * 32,
    }
    (root / LOCK).write_text(json.dumps(doc))
    if heartbeat_age:
        os.utime(root / LOCK, (now - heartbeat_age, now - heartbeat_age))
    return doc


def saved_run(root, steps=4):
    """A finished run in ``root``: checkpoints, no lock."""
    reset_accelerate()
    tiny_loop([Checkpoint(dir=root, every_steps=2, signals=None)]).fit(max_steps=steps)
    reset_accelerate()
    assert (root / "latest").exists()


def snapshot(root):
    return sorted((str(p.relative_to(root)), p.stat().st_mtime_ns) for p in Path(root).rglob("*"))


def forbid_reading(monkeypatch):
    """Staging a checkpoint (reading its files) fails the test."""
    def stage(*args, **kwargs):
        raise AssertionError("a checkpoint was read")
    try:
        from hookloop.checkpointing import resume as loading
    except ImportError:  # hookloop 0.2: one module
        return
    monkeypatch.setattr(loading, "stage", stage)


@pytest.fixture
def sleeper():
    """A live process of this machine that is not this one."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    yield process
    process.kill()
    process.wait()


def dead_pid():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()  # reaped: the pid is free
    return process.pid


class LockSeen:
    """Reads the lock file at every update (and tries ``find`` on the root)."""

    def __init__(self, root, find=False):
        self.root, self.find, self.seen, self.found = Path(root), find, [], []

    @hookimpl
    def after_step(self, loop):
        path = self.root / LOCK
        self.seen.append(json.loads(path.read_text()) if path.exists() else None)
        if self.find and (self.root / "latest").exists():
            self.found.append(checkpointing.find("latest", self.root)[0])


# -- a live run is refused, before anything is read --------------------------------------


def test_latest_of_a_live_runs_root_is_refused_naming_the_run_before_anything_is_read(
        tmp_path, sleeper, monkeypatch):
    root = tmp_path / "checkpoints"
    saved_run(root)
    doc = write_lock(root, sleeper.pid)
    before = snapshot(root)
    forbid_reading(monkeypatch)
    for resume_from in ("latest", root, root / "step-00000004", str(root / "step-00000002")):
        reset_accelerate()
        with pytest.raises(CheckpointError) as info:
            tiny_loop([Checkpoint(dir=root)], resume_from=resume_from)
        message = str(info.value)
        assert doc["host"] in message and f"pid {sleeper.pid}" in message
        assert f"since {doc['since']}" in message and "run feedc0de" in message
        assert "Checkpoint(dir=" in message and "version_N" in message  # what to do
        assert "still running" in message and str(root / LOCK) in message
    assert snapshot(root) == before  # nothing changed, the lock neither


def test_a_run_from_scratch_into_a_live_runs_root_is_refused_when_its_fit_starts(tmp_path, sleeper):
    root = tmp_path / "checkpoints"
    doc = write_lock(root, sleeper.pid)
    loop = tiny_loop([Checkpoint(dir=root, every_steps=1)])
    with pytest.raises(CheckpointError, match=f"pid {sleeper.pid}.*still running|still running.*pid {sleeper.pid}"):
        loop.fit(max_steps=2)
    assert loop.state.global_step == 0
    assert sorted(p.name for p in root.iterdir()) == [LOCK]
    assert json.loads((root / LOCK).read_text()) == doc  # never released by the refused run


def test_a_lock_of_another_machine_with_a_recent_heartbeat_is_live(tmp_path):
    root = tmp_path / "checkpoints"
    saved_run(root)
    write_lock(root, 12345, host="elsewhere.example", start="1", heartbeat_age=20)
    with pytest.raises(CheckpointError, match="host elsewhere.example, pid 12345"):
        tiny_loop([Checkpoint(dir=root)], resume_from="latest")


# -- a stale lock is taken over, with a warning --------------------------------------------


@pytest.mark.parametrize("case", ["dead pid", "pid reused", "other machine, old heartbeat",
                                  "machine restarted"])
def test_a_stale_lock_is_taken_over_with_one_plain_line_and_the_resume_works(tmp_path, case, request, capsys,
                                                                            recwarn):
    root = tmp_path / "checkpoints"
    saved_run(root)
    if case == "dead pid":
        pid = dead_pid()
        write_lock(root, pid, start=None)
    elif case == "pid reused":  # a live process, started after the one that wrote the lock
        pid = request.getfixturevalue("sleeper").pid
        write_lock(root, pid, start="1")
    elif case == "other machine, old heartbeat":
        pid = 12345
        write_lock(root, pid, host="elsewhere.example", heartbeat_age=7200)
    else:
        pid = request.getfixturevalue("sleeper").pid
        write_lock(root, pid, boot_id="00000000-0000-0000-0000-000000000000")
    loop = tiny_loop([Checkpoint(dir=root, every_steps=2, signals=None)], resume_from="latest")
    assert loop.resumed_from == root / "step-00000004"
    loop.fit(max_steps=6)
    message = next(line for line in capsys.readouterr().err.splitlines() if "stale run lock" in line)
    assert str(root / LOCK) in message and f"pid {pid}" in message
    assert not [w for w in recwarn if "lock" in str(w.message)]  # (0.3: a RuntimeWarning and its source line)
    assert loop.state.global_step == 6 and (root / "step-00000006").is_dir()
    assert not (root / LOCK).exists()  # released at the end of the fit


# -- held while training, released however the fit ends ------------------------------------


def test_the_lock_is_held_while_training_and_released_when_the_fit_ends(tmp_path):
    root = tmp_path / "checkpoints"
    seen = LockSeen(root)
    loop = tiny_loop([Checkpoint(dir=root, every_steps=2, signals=None), seen])
    loop.fit(max_steps=4)
    assert all(s is not None for s in seen.seen) and len(seen.seen) == 4
    first = seen.seen[0]
    assert first["pid"] == os.getpid() and first["host"] == socket.gethostname()
    assert first["run_id"] == loop.state.run.id and first["since"]
    assert first["start_time"] == start_time(os.getpid())
    assert not (root / LOCK).exists()


class Raise:
    @hookimpl
    def after_step(self, loop):
        if loop.state.global_step == 3:
            raise RuntimeError("boom")


class SendSigterm:
    @hookimpl
    def before_backward(self, loop):
        if loop.state.micro_step + 1 == 3:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("how", ["exception", "preempted"])
def test_the_lock_is_released_when_the_fit_raises_or_is_preempted(tmp_path, how):
    root = tmp_path / "checkpoints"
    seen = LockSeen(root)
    plugin = Raise() if how == "exception" else SendSigterm()
    loop = tiny_loop([seen, plugin, Checkpoint(dir=root, every_steps=2)])
    with pytest.raises(RuntimeError if how == "exception" else Preempted):
        loop.fit(max_steps=8)
    assert seen.seen and all(s is not None and s["pid"] == os.getpid() for s in seen.seen)
    assert not (root / LOCK).exists()
    assert (root / "latest").exists()


def test_the_heartbeat_is_written_at_safe_points_rate_limited(tmp_path, monkeypatch):
    from hookloop.checkpointing import lock

    root = tmp_path / "checkpoints"
    seen = LockSeen(root)
    monkeypatch.setattr(lock, "HEARTBEAT_EVERY_S", 3600.0)
    tiny_loop([Checkpoint(dir=root, signals=None), seen]).fit(max_steps=3)
    assert len({s["heartbeat_unix"] for s in seen.seen}) == 1  # not refreshed within the hour
    reset_accelerate()
    seen = LockSeen(root)
    monkeypatch.setattr(lock, "HEARTBEAT_EVERY_S", 0.0)
    tiny_loop([Checkpoint(dir=root, signals=None), seen], resume_from="latest").fit(max_steps=6)
    beats = [s["heartbeat_unix"] for s in seen.seen]
    assert beats == sorted(beats) and len(set(beats)) == len(beats)  # at every safe point


# -- the same process may resume its own run -----------------------------------------------


def test_the_process_holding_the_lock_may_resume_its_own_run(tmp_path):
    root = tmp_path / "checkpoints"
    seen = LockSeen(root, find=True)
    loop = tiny_loop([Checkpoint(dir=root, every_steps=2, signals=None), seen])
    loop.fit(max_steps=5)
    assert seen.seen[-1]["pid"] == os.getpid()  # held while find() ran: not refused
    assert seen.found[-1] == root / "step-00000004"
    # the same loop between two fits, and a new loop of this process
    assert loop.load_checkpoint("latest") == root / "step-00000005"
    loop.fit(max_steps=6, resume_from="latest")
    reset_accelerate()
    again = tiny_loop([Checkpoint(dir=root, every_steps=2, signals=None)], resume_from="latest")
    assert again.resumed_from == root / "step-00000006"
    again.fit(max_steps=8)
    assert not (root / LOCK).exists()


# -- run folders and temporary folders ----------------------------------------------------


@pytest.mark.parametrize("resume_from", ["latest", None])
def test_a_run_killed_in_its_first_save_is_continued_in_its_folder_and_cleaned(tmp_path, monkeypatch, capsys,
                                                                               resume_from):
    # 0.3: the same command started version_1; version_0 kept the partial save and the lock
    monkeypatch.chdir(tmp_path)  # Checkpoint() without dir: ./checkpoints/version_<N>
    folder = tmp_path / "checkpoints" / "version_0"
    partial = folder / ".tmp-step-00000002-deadbeef-4242"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"\0" * 4096)  # killed while writing
    write_lock(folder, dead_pid(), run_id="deadbeef" * 4)
    reset_accelerate()
    loop = tiny_loop([Checkpoint(every_steps=2, signals=None)], resume_from=resume_from)
    loop.fit(max_steps=2)
    assert "taking over the stale run lock" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["version_0"]
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-00000002"]
    assert checkpointing.read_manifest(folder / "step-00000002")["run_id"] == loop.state.run.id


def test_a_run_folder_held_by_a_live_run_is_never_taken_for_a_fresh_run(tmp_path, monkeypatch, sleeper):
    monkeypatch.chdir(tmp_path)
    write_lock(tmp_path / "checkpoints" / "version_0", sleeper.pid)  # training its first epoch
    reset_accelerate()
    tiny_loop([Checkpoint(every_steps=2, signals=None)]).fit(max_steps=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["version_0", "version_1"]
    assert (tmp_path / "checkpoints" / "version_1" / "latest").exists()


def test_a_run_folder_taken_meanwhile_gives_the_next_one(tmp_path, monkeypatch):
    from hookloop.checkpointing import store as layout

    base = tmp_path / "checkpoints"
    original = layout.next_run_name
    calls = []

    def next_run_name(b):  # another process creates the folder right after we named it
        name = original(b)
        calls.append(name)
        if len(calls) == 1:
            (Path(b) / name).mkdir(parents=True)
        return name

    monkeypatch.setattr(layout, "next_run_name", next_run_name)
    assert layout.claim_run_folder(base) == base / "version_1"
    assert calls == ["version_0", "version_1"]
    assert layout.claim_run_folder(base) == base / "version_2"


def test_the_temporary_folders_of_two_runs_saving_at_once_do_not_collide(tmp_path, monkeypatch):
    from hookloop.checkpointing import writer

    root = tmp_path / "checkpoints"
    a = tiny_loop(seed=1)
    b = tiny_loop(seed=2)
    original = writer.publish
    seen = {}

    def publish(tmp, final, *args, **kwargs):
        if "a" not in seen:  # A is about to publish: B saves the same name meanwhile
            seen["a"] = tmp
            checkpointing.save(b, root, reason="test", name="step-00000004", update_latest=False)
            seen["a intact after b"] = (tmp / "hookloop.json").is_file()
        else:
            seen["b"] = tmp
        return original(tmp, final, *args, **kwargs)

    monkeypatch.setattr(writer, "publish", publish)
    checkpointing.save(a, root, reason="test", name="step-00000004", update_latest=False)
    assert seen["a"] != seen["b"]
    assert seen["a"].name.startswith(".tmp-step-00000004-")
    assert a.state.run.id[:8] in seen["a"].name and str(os.getpid()) in seen["a"].name
    assert b.state.run.id[:8] in seen["b"].name
    assert seen["a intact after b"]
    assert checkpointing.read_manifest(root / "step-00000004")["run_id"] == a.state.run.id


def test_clean_removes_dead_leftovers_and_leaves_a_live_save_alone(tmp_path):
    from hookloop.checkpointing import store as layout

    root = tmp_path
    dead = root / ".tmp-step-00000002-deadbeef-1"
    dead.mkdir()
    (root / ".trash-step-00000001-1").mkdir()
    live = root / ".tmp-step-00000004-0123abcd-2"
    live.mkdir()
    layout.mark_live(live)  # (a save of this process in progress)
    try:
        layout.clean(root)
        assert sorted(p.name for p in root.iterdir()) == [live.name]
    finally:
        layout.mark_live(live, False)
    layout.clean(root)
    assert list(root.iterdir()) == []


# -- other processes ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_second_process_is_refused_while_a_run_trains_and_resumes_after_a_kill(tmp_path, monkeypatch):
    out = tmp_path / "run"
    root = out / "checkpoints"
    run = runner.Run(out, *ARGS, "--pause", "step:10", name="first")  # update 5; saved at 3 and 4 (epoch end)
    run.wait_paused()
    doc = json.loads((root / LOCK).read_text())
    assert doc["pid"] == run.process.pid and doc["host"] == socket.gethostname()
    before = snapshot(root)
    forbid_reading(monkeypatch)
    with pytest.raises(CheckpointError) as info:
        tiny_loop([Checkpoint(dir=root)], resume_from="latest")
    message = str(info.value)
    assert f"host {doc['host']}, pid {doc['pid']}, since {doc['since']}" in message
    assert f"run {doc['run_id'][:8]}" in message
    assert snapshot(root) == before
    monkeypatch.undo()

    run.kill()  # kill -9: the lock stays, and is stale
    assert json.loads((root / LOCK).read_text())["pid"] == doc["pid"]
    final = runner.Run(out, *ARGS, name="resumed")
    final.finish()
    assert json.loads((out / "run.json").read_text())["started_at"] == 4
    log = final.output()
    assert "stale run lock" in log and f"pid {doc['pid']}" in log and "is gone" in log
    assert "RuntimeWarning: hookloop" not in log  # a crash is what resuming is for: one plain line (0.3: a warning)
    assert not (root / LOCK).exists()


@pytest.mark.slow
def test_a_sigterm_preemption_exit_75_releases_the_lock(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    process = runner.plain_python(out, *ARGS, "--pause", "signal:14")
    runner.wait_for_markers(process, out / "paused-0")
    assert json.loads((out / "checkpoints" / LOCK).read_text())["pid"] == process.pid
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=runner.PATIENCE_S)[0]
    assert process.returncode == PREEMPTED_EXIT_CODE, output[-3000:]
    assert not (out / "checkpoints" / LOCK).exists()


@pytest.mark.slow
def test_a_lock_still_held_at_interpreter_exit_is_released(tmp_path):
    code = ("import sys; from hookloop.checkpointing import lock; "
            "lock.acquire(sys.argv[1], 'cafe' * 8); print(open(sys.argv[1] + '/hookloop.lock').read())")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          timeout=runner.PATIENCE_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["run_id"] == "cafe" * 8
    assert not (tmp_path / LOCK).exists()


@pytest.mark.slow
def test_two_runs_started_together_in_one_directory_get_two_run_folders(tmp_path):
    import sweep_member

    ctx = runner.context()
    members = []
    for tag, lr in (("a", 0.1), ("b", 0.5)):
        process = ctx.Process(target=sweep_member.member,
                              args=([str(tmp_path), tag, lr, 2], str(tmp_path / f"{tag}.log")))
        process.start()
        members.append((tag, process))
    for tag, process in members:
        process.join(runner.PATIENCE_S)
        assert process.exitcode == 0, (tmp_path / f"{tag}.log").read_text()[-3000:]
    # both named version_0 first: the same race as two processes started at once
    assert {(tmp_path / f"chose-{t}").read_text() for t in "ab"} == {"version_0"}
    results = {t: json.loads((tmp_path / f"result-{t}.json").read_text()) for t in "ab"}
    base = tmp_path / "checkpoints"
    assert sorted(p.name for p in base.iterdir()) == ["version_0", "version_1"]
    assert {Path(r["dir"]).name for r in results.values()} == {"version_0", "version_1"}
    assert results["a"]["run_id"] != results["b"]["run_id"]
    for tag, result in results.items():
        folder = Path(result["dir"])
        names = sorted(p.name for p in folder.iterdir())
        assert LOCK not in names and not [n for n in names if n.startswith(".tmp-")], names
        checkpoints = checkpointing.list_checkpoints(folder)
        assert checkpoints
        for path in checkpoints:  # only this member's checkpoints, with its learning rate
            assert checkpointing.read_manifest(path)["run_id"] == result["run_id"]
            groups = torch.load(path / "optimizer.bin", weights_only=True)["param_groups"]
            assert groups[0]["lr"] == result["lr"]


@pytest.mark.slow
def test_two_processes_asking_for_a_live_runs_latest_are_both_refused(tmp_path, sleeper):
    out = tmp_path / "run"
    root = out / "checkpoints"
    saved_run(root)
    write_lock(root, sleeper.pid)
    process = runner.launch_two(out, *ARGS)
    output = process.communicate(timeout=runner.PATIENCE_S)[0]
    assert process.returncode != 0
    assert output.count("still running") >= 2, output[-4000:]  # every rank raised it
    assert sorted(p.name for p in out.glob("refused-*")) == ["refused-0", "refused-1"]  # (refusals.py)
    assert f"pid {sleeper.pid}" in output
    assert not (out / "run.json").exists()


def test_a_lock_file_that_is_no_lock_is_never_opened_and_is_stale_once_old(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    saved_run(root)
    os.mkfifo(root / LOCK)  # reading it would hang
    with pytest.raises(CheckpointError, match="unreadable lock file"):  # just planted: being written?
        tiny_loop([Checkpoint(dir=root)], resume_from="latest")
    old = time.time() - 3600
    os.utime(root / LOCK, (old, old))
    reset_accelerate()
    loop = tiny_loop([Checkpoint(dir=root, signals=None)], resume_from="latest")
    loop.fit(max_steps=5)
    assert re.search("stale run lock .*not a hookloop lock file", capsys.readouterr().err)
    assert not (root / LOCK).exists()
