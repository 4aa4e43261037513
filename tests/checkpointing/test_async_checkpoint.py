"""Asynchronous checkpoints (``Checkpoint(asynchronous=True)``): the same
checkpoint as a synchronous save, written by a background thread while
training goes on; at most one in flight; ``latest`` moves only once the new
one is complete; the fit's end, ``close()`` and an exception wait for it; a
failed write is an error naming it; killed during the write, the previous
checkpoint resumes bit for bit. And the files are Accelerate's."""

import io
import json
import os
import re
import signal
import threading
import time
import zipfile
from pathlib import Path

import launching
import pytest
import torch
from accelerate import Accelerator

import runner
import writer_setup
from hookloop import hookimpl
from hookloop import checkpointing
from hookloop.checkpointing import CheckpointError, read_latest, writer
from hookloop.checkpointing import saving
from hookloop.plugins import Checkpoint
from hookloop.testing import reset_accelerate, tiny_loop

EPOCHS = 2  # tiny_loop: 8 updates an epoch


def make(root, *plugins, asynchronous=True, every_steps=2, resume_from=None, **kwargs):
    reset_accelerate()
    checkpoint = Checkpoint(dir=root, every_steps=every_steps, keep_last=None, signals=None,
                            asynchronous=asynchronous)
    loop = tiny_loop([checkpoint, *plugins], accelerator=Accelerator(), eval_data=True,
                     resume_from=resume_from, **kwargs)
    return loop, checkpoint


def params(loop):
    return {k: v.detach().clone() for k, v in loop.networks["model"].unwrapped.state_dict().items()}


def differing(a, b):
    return [k for k in a if not torch.equal(a[k], b[k])]


def manifest(path):
    return json.loads((path / "hookloop.json").read_text())


def _rank_file(path):
    from safetensors import safe_open

    with safe_open(path / "hookloop-rank0.safetensors", "pt") as f:
        return f.metadata(), {k: f.get_tensor(k).tolist() for k in f.keys()}


#: what differs between two saves of the same state: when, which run, where
_CIRCUMSTANCES = {"created", "run_id", "root", "manifest_crc32"}


class Hold:
    """Holds the writer process of the checkpoints named in ``names`` before
    it writes their ``optimizer.bin`` (model written, the rest not), until
    :meth:`release`; records what happened in both processes, in order."""

    def __init__(self, monkeypatch, folder, *names, release_after=None):
        folder.mkdir(parents=True, exist_ok=True)
        self.file = folder / "events.jsonl"
        config = {"events": str(self.file), "hold": list(names)}
        if release_after is not None:  # (after it is held: later than the training
            config["release_after"] = release_after  # thread's return, were it not waiting)
        writer_setup.use(monkeypatch, **config)

    @property
    def events(self) -> list:
        return writer_setup.read(self.file)

    def append(self, event) -> None:
        writer_setup.record(self.file, *event)

    def release(self, after: float = 0.0):
        threading.Timer(after, (self.file.parent / f"{self.file.name}.release").touch).start()


class Watch:
    """Records, in after_step, the update and what ``latest`` names; calls
    ``at[step](loop)`` at those updates."""

    name = "watch"

    def __init__(self, root, events, at=None):
        self.root, self.events, self.at = Path(root), events, at or {}

    @hookimpl
    def after_step(self, loop):
        step = loop.state.global_step
        self.events.append(("step", step, read_latest(self.root)))
        if step in self.at:
            self.at[step](loop)


# -- the same checkpoint ---------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*also holds newer checkpoints")
def test_an_asynchronous_checkpoint_is_the_synchronous_one_and_resumes_bit_for_bit(tmp_path):
    sync, _ = make(tmp_path / "sync", asynchronous=False)
    sync.fit(epochs=EPOCHS)
    reference = params(sync)
    loop, checkpoint = make(tmp_path / "async")
    loop.fit(epochs=EPOCHS)
    assert differing(params(loop), reference) == []  # saving in the background changes no step
    names = sorted(p.name for p in (tmp_path / "sync").iterdir())
    assert sorted(p.name for p in (tmp_path / "async").iterdir()) == names
    assert checkpoint.last_saved == tmp_path / "async" / "step-00000016-epoch-end"
    assert checkpoint.saving is None
    for name in ("step-00000006", "step-00000008-epoch-end", "step-00000016-epoch-end"):
        a, b = tmp_path / "sync" / name, tmp_path / "async" / name
        files = sorted(p.name for p in a.iterdir())
        assert sorted(p.name for p in b.iterdir()) == files
        for file in set(files) - {"hookloop.json", "hookloop-rank0.safetensors"}:
            assert (a / file).read_bytes() == (b / file).read_bytes(), f"{name}/{file}"
        # (safetensors orders a metadata of several keys anew each time: compared read)
        assert _rank_file(a) == _rank_file(b)
        doc_a, doc_b = manifest(a), manifest(b)
        for doc in (doc_a, doc_b):
            del doc["crc32"]["hookloop-rank0.safetensors"]  # (its metadata's order, above)
        assert {k: v for k, v in doc_a.items() if k not in _CIRCUMSTANCES} == \
               {k: v for k, v in doc_b.items() if k not in _CIRCUMSTANCES}
        assert doc_b["checksum"] == "crc32"
    loop.close()

    resumed, _ = make(tmp_path / "async", resume_from=tmp_path / "async" / "step-00000006")
    assert resumed.state.global_step == 6
    resumed.fit(epochs=EPOCHS)
    assert differing(params(resumed), reference) == []


def test_the_files_are_accelerates_and_accelerator_load_state_reads_them(tmp_path):
    loop, _ = make(tmp_path / "ckpt", every_steps=None)
    loop.fit(max_steps=5)
    path = saving.save(loop, tmp_path / "ckpt", reason="test", name="step-00000099",
                       asynchronous=True)
    saving.wait(loop)
    acc = loop.accelerator
    acc.save_state(str(tmp_path / "plain"))  # the same state, the same random states
    plain = tmp_path / "plain"
    for name in ("model.safetensors", "scheduler.bin", "random_states_0.pkl"):
        assert (path / name).read_bytes() == (plain / name).read_bytes(), name
    # optimizer.bin: the same zip records, byte for byte (torch names the zip's top
    # folder after the file only when it opens the file itself)
    ours, theirs = zipfile.ZipFile(path / "optimizer.bin"), zipfile.ZipFile(plain / "optimizer.bin")
    strip = lambda z: {n.split("/", 1)[1]: z.read(n) for n in z.namelist()}  # noqa: E731
    assert strip(ours) == strip(theirs)

    model = loop.networks["model"]
    before = params(loop), model.optimizer.state_dict()
    with torch.no_grad():
        for p in model.unwrapped.parameters():
            p.add_(1.0)
    acc.load_state(str(path))  # Accelerate itself reads a hookloop checkpoint
    assert differing(params(loop), before[0]) == []
    after = model.optimizer.state_dict()
    for key, entry in before[1]["state"].items():
        for name, value in entry.items():
            assert torch.equal(after["state"][key][name], value), (key, name)
    buffer = io.BytesIO((path / "optimizer.bin").read_bytes())
    assert torch.load(buffer, weights_only=True)["param_groups"] == before[1]["param_groups"]


# -- in flight ---------------------------------------------------------------------------


@pytest.mark.parametrize("start", ["fork", "interpreter"])  # (Linux's writer; macOS's, a new python)
def test_training_goes_on_during_the_write_and_the_next_save_waits_for_it(tmp_path, monkeypatch, start):
    monkeypatch.setattr(writer, "START", start)
    hold = Hold(monkeypatch, tmp_path / "events", "step-00000004")
    # at update 5, the save of update 4 is held mid-write: latest names update 2's
    watch = Watch(tmp_path, hold, at={5: lambda loop: hold.release(after=0.2)})
    loop, checkpoint = make(tmp_path, watch)
    loop.fit(max_steps=7)
    events = hold.events
    # update 5 trained while update 4's save was unfinished (held until then), and the
    # previous checkpoint stayed latest
    assert ("step", 5, "step-00000002") in events
    assert events.index(("step", 5, "step-00000002")) < events.index(("published", "step-00000004"))
    # the save of update 6 waited for update 4's to be published before it began
    assert events.index(("published", "step-00000004")) < events.index(("write", "step-00000006"))
    assert [e[1] for e in events if e[0] == "published"] == [
        "step-00000002", "step-00000004", "step-00000006", "step-00000007"]
    assert read_latest(tmp_path) == "step-00000007"  # the fit's end waited for its last save
    assert checkpoint.last_saved == tmp_path / "step-00000007"


class FirstSave:
    """Records, when the first save of a fit is asked for (before_save_checkpoint),
    the writers that are ready then (their ``ready`` events) and alive."""

    name = "first_save"

    def __init__(self, events):
        self.events, self.seen = events, None

    @hookimpl
    def before_save_checkpoint(self, checkpoint):
        if self.seen is None:
            ready = [e[1] for e in writer_setup.read(self.events) if e[0] == "ready"]
            self.seen = (checkpoint.name, [pid for pid in ready if _alive(pid)])


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_writer_is_ready_before_the_first_save_and_only_a_fit_that_saves_asynchronously_has_one(
        tmp_path, monkeypatch):
    """The writer process of a fit with ``Checkpoint(asynchronous=True)`` is running and
    waiting for work (its setup done) when the fit's first save is asked for, so that
    no save waits for a writer's start-up (0.4's writer was a new interpreter, ready
    1.5-4 s after the loop was built: the first save's job waited in its pipe, and the
    second save ~1 s for the first). One writer serves every save of the fit. A fit
    with a synchronous Checkpoint, or with none, starts no writer."""
    events = tmp_path / "events.jsonl"
    writer_setup.use(monkeypatch, events=str(events))
    first = FirstSave(events)
    loop, _ = make(tmp_path / "async", first)
    loop.fit(max_steps=6)
    name, ready = first.seen
    assert name == "step-00000002"
    assert len(ready) == 1 and ready[0] != os.getpid(), \
        f"no writer process was ready when {name} was asked for: {writer_setup.read(events)}"
    assert [e for e in writer_setup.read(events) if e[0] == "ready"] == [("ready", ready[0])]  # one, reused
    assert read_latest(tmp_path / "async") == "step-00000006"
    loop.close()
    assert not _alive(ready[0]) or _zombie(ready[0])  # closed with its loop

    events.unlink()
    for plugins in ([Checkpoint(dir=tmp_path / "sync", every_steps=2, signals=None)], []):
        reset_accelerate()
        other = tiny_loop(plugins, accelerator=Accelerator())
        other.fit(max_steps=4)
        other.close()
        assert writer_setup.read(events) == [], f"a writer started for plugins {plugins}"
    assert read_latest(tmp_path / "sync") == "step-00000004"


def _zombie(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


class SignalEveryProcess:
    """At update ``at``, once the writer holds checkpoint ``held`` mid-write: ``signum``
    to the writer process and to this one, as a cluster that preempts a job signals
    every process of it (SLURM's scancel, systemd's stop); then the writer goes on."""

    name = "signal_every_process"

    def __init__(self, hold, at, held, signum):
        self.hold, self.at, self.held, self.signum = hold, at, held, signum

    @hookimpl
    def after_step(self, loop):
        if loop.state.global_step != self.at:
            return
        deadline = time.monotonic() + 60
        while ("held", self.held) not in self.hold.events:
            assert time.monotonic() < deadline, f"the writer never held {self.held}: {self.hold.events}"
            time.sleep(0.01)
        (writer_pid,) = [e[1] for e in self.hold.events if e[0] == "ready"]
        os.kill(writer_pid, self.signum)
        os.kill(os.getpid(), self.signum)
        self.hold.release()


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGUSR1"])
def test_a_preemption_signal_to_every_process_lets_the_save_in_flight_land_before_its_own(
        tmp_path, monkeypatch, signum):
    """SIGTERM (or SLURM's SIGUSR1) sent to the training process and to the writer while
    the writer is writing update 4's checkpoint: the writer leaves the signal to the
    training process and finishes; the training process stops at its next safe point
    with a preemption checkpoint, after update 4's is published. (0.4.0.dev0's writer
    died of the signal: update 4's save failed, and the preemption checkpoint with it.)"""
    from hookloop.preemption import Preempted

    hold = Hold(monkeypatch, tmp_path / "events", "step-00000004")
    reset_accelerate()
    checkpoint = Checkpoint(dir=tmp_path / "ckpt", every_steps=2, keep_last=None, asynchronous=True)
    loop = tiny_loop([checkpoint, SignalEveryProcess(hold, 5, "step-00000004", getattr(signal, signum))],
                     accelerator=Accelerator())
    with pytest.raises(Preempted) as info:
        loop.fit(epochs=EPOCHS)
    loop.close()
    assert info.value.global_step == 5 and info.value.checkpoint == tmp_path / "ckpt" / "step-00000005"
    assert manifest(tmp_path / "ckpt" / "step-00000004")["reason"] == "every_steps"
    assert manifest(tmp_path / "ckpt" / "step-00000005")["reason"] == "preempted"
    assert read_latest(tmp_path / "ckpt") == "step-00000005"


def test_the_fit_end_waits_for_the_writer(tmp_path, monkeypatch):
    hold = Hold(monkeypatch, tmp_path / "events", "step-00000003", release_after=0.3)
    loop, checkpoint = make(tmp_path, every_steps=None)
    loop.fit(max_steps=3)
    assert ("published", "step-00000003") in hold.events
    assert read_latest(tmp_path) == "step-00000003" and checkpoint.saving is None
    assert (tmp_path / "step-00000003" / "hookloop.json").exists()


def test_close_waits_for_a_save_made_outside_a_fit(tmp_path, monkeypatch):
    hold = Hold(monkeypatch, tmp_path / "events", "step-00000000-epoch-end", release_after=0.3)
    loop, checkpoint = make(tmp_path)
    path = checkpoint.save(loop)  # outside a fit: at once, in the background
    assert path == tmp_path / "step-00000000-epoch-end" and checkpoint.saving == path
    assert read_latest(tmp_path) is None
    loop.close()
    assert ("held", "step-00000000-epoch-end") in hold.events
    assert read_latest(tmp_path) == "step-00000000-epoch-end" and checkpoint.last_saved == path


def test_an_exception_waits_for_the_writer(tmp_path, monkeypatch):
    Hold(monkeypatch, tmp_path / "events", "step-00000002", release_after=0.3)

    def fail(loop):
        raise RuntimeError("boom at update 3")

    loop, _ = make(tmp_path, Watch(tmp_path, [], at={3: fail}))
    with pytest.raises(RuntimeError, match="boom at update 3"):
        loop.fit(epochs=1)
    assert read_latest(tmp_path) == "step-00000002"  # published before the error came out
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_failed_write_is_an_error_naming_the_checkpoint(tmp_path, monkeypatch):
    writer_setup.use(monkeypatch, fail=["step-00000004", "optimizer.bin"])
    loop, checkpoint = make(tmp_path)
    with pytest.raises(CheckpointError, match=r"asynchronous save of checkpoint .*step-00000004.* "
                                              r"failed: .*No space left on device"):
        loop.fit(epochs=1)
    assert read_latest(tmp_path) == "step-00000002"
    assert not list(tmp_path.glob(".tmp-*"))  # the unfinished folder was removed
    assert checkpoint.last_saved == tmp_path / "step-00000002"


class NaNGradAt:
    """Makes one gradient NaN in update ``at``: the weights go NaN, the loss stays finite."""

    name = "nan_grad"

    def __init__(self, at):
        self.at = at

    @hookimpl
    def after_backward(self, loop, network):
        if loop.state.global_step + 1 == self.at:
            with torch.no_grad():
                next(network.model.parameters()).grad[0, 0] = float("nan")


def test_a_non_finite_host_copy_is_refused_by_the_writer_before_any_file(tmp_path, monkeypatch):
    """The finiteness of an asynchronous save is checked on its host copy, off the
    training thread: update 6's NaN weights are never written; the refusal names the
    tensor and the update they went bad at, and the last finite checkpoint stays."""
    from hookloop.plugins import GradClip

    writer_setup.use(monkeypatch, events=str(tmp_path / "events.jsonl"))
    # (FiniteCheck blocked: update 7's NaN loss would stop the fit first, the refusal a warning)
    loop, _ = make(tmp_path, NaNGradAt(6), GradClip(max_norm=1.0), block=["progress", "finite"])
    with pytest.raises(checkpointing.NonFiniteCheckpoint) as info:
        loop.fit(epochs=1)
    message = str(info.value)
    assert "refusing to save checkpoint step-00000006 after step 6: network 'model' " in message
    assert "first went bad at update 6 (GradClip" in message
    assert "still names step-00000004, the last finite checkpoint" in message
    assert info.value.network == "model" and info.value.first_bad[0] == 6
    assert ("write", "step-00000006") not in writer_setup.read(tmp_path / "events.jsonl")  # not one file
    assert ("write", "step-00000004") in writer_setup.read(tmp_path / "events.jsonl")
    assert read_latest(tmp_path) == "step-00000004"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(("hookloop.lock", "events"))) == [
        "latest", "step-00000002", "step-00000004"]


def test_best_k_keeps_what_the_synchronous_run_keeps_however_slow_the_writer(tmp_path, monkeypatch):
    """``save_top_k=2`` on ``eval_loss`` with a save at every evaluation: whatever the
    writer's timing (every file operation slowed by 10 ms, as on network storage), an
    asynchronous run keeps exactly the checkpoints the synchronous run keeps: the
    best-k ranking and the rotation are decided in the order the saves were asked
    for, never against a save still in flight. (0.3 ranked against the last
    *published* save: 3 runs in 4 lost one of the best two, silently.)"""
    import time

    from hookloop.checkpointing import store as layout

    def run(root, asynchronous):
        reset_accelerate()
        checkpoint = Checkpoint(dir=root, monitor="eval_loss", save_top_k=2, asynchronous=asynchronous,
                                signals=None)
        loop = tiny_loop([checkpoint], accelerator=Accelerator(), eval_data=True)
        loop.fit(max_steps=32, eval_every=4)
        loop.close()
        return sorted(p.name for p in checkpointing.list_checkpoints(root)), checkpoint.best["path"].name

    expected = run(tmp_path / "sync", asynchronous=False)
    assert expected == (["step-00000028", "step-00000032-epoch-end"], "step-00000032-epoch-end")
    write_file, write_latest = writer.write_file, layout.write_latest

    def slowly(step):
        return lambda *args, **kwargs: (time.sleep(0.01), step(*args, **kwargs))[1]

    monkeypatch.setattr(writer, "write_file", slowly(write_file))  # (a writer in this process)
    monkeypatch.setattr(layout, "write_latest", slowly(write_latest))
    writer_setup.use(monkeypatch, slow=0.01)  # (the writer process)
    for i in range(4):
        assert run(tmp_path / f"async-{i}", asynchronous=True) == expected, f"run {i}"


def test_asynchronous_must_be_a_bool():
    with pytest.raises(ValueError, match="asynchronous must be True or False, got 'yes'"):
        Checkpoint(asynchronous="yes")


# -- killed during the background write ----------------------------------------------------

SUPERVISED = ("--strategy", "supervised", "--accum", "2", "--epochs", "3", "--every-steps", "3")


class AsyncRun(runner.Run):
    """A run of async_resumable.py, forked from runner.py's server."""

    def __init__(self, out, *args, name="run"):
        import async_resumable

        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = self.out / f"{name}.log"
        for marker in self.out.glob("paused-*"):
            marker.unlink()
        self.process = runner.context().Process(target=async_resumable.child,
                                                args=([str(self.out), *map(str, args)], str(self.log)))
        self.process.start()


def test_killed_during_a_background_write_the_previous_checkpoint_resumes_bit_for_bit(tmp_path):
    reference = AsyncRun(tmp_path / "reference", *SUPERVISED).finish()
    out = tmp_path / "run"
    # 4 updates an epoch; checkpoints at 3, 4 (epoch end), 6, 8 ...: held writing 6's
    run = AsyncRun(out, *SUPERVISED, "--hold", "6", name="held")
    run.wait_paused()
    run.kill()
    root = out / "checkpoints"
    assert read_latest(root) == "step-00000004-epoch-end"
    (unfinished,) = root.glob(".tmp-step-00000006-*")
    assert (unfinished / "model.safetensors").exists()  # mid-write: the model, not the rest
    assert not (unfinished / "optimizer.bin").exists() and not (unfinished / "hookloop.json").exists()
    final = AsyncRun(out, *SUPERVISED, name="final").finish()
    assert json.loads((out / "run.json").read_text())["started_at"] == 4
    assert runner.same(final, reference) == []
    assert not list(root.glob(".tmp-*"))


def test_a_writer_process_killed_mid_write_is_an_error_and_the_previous_checkpoint_resumes(tmp_path):
    """``kill -9`` of the writer process (the OOM killer's choice, say) while it writes
    update 6's checkpoint: the training process stops at its next safe point with a
    CheckpointError naming the writer and the checkpoint, never reports it saved, and
    a new run resumes update 4's checkpoint bit for bit."""
    import signal

    reference = AsyncRun(tmp_path / "reference", *SUPERVISED).finish()
    out = tmp_path / "run"
    run = AsyncRun(out, *SUPERVISED, "--hold", "6", name="held")
    run.wait_paused()
    writer_pid = json.loads((out / "paused-0").read_text())["pid"]
    assert writer_pid != run.process.pid  # the writer is a process of its own
    os.kill(writer_pid, signal.SIGKILL)
    assert run.wait() != 0
    log = run.output()
    assert re.search(rf"CheckpointError: the asynchronous save of checkpoint '[^']*step-00000006' failed: the "
                     rf"checkpoint writer process \(pid {writer_pid}\) died with exit status -9 while writing "
                     r"it\. Nothing was published; 'latest' still names the previous checkpoint", log), log[-3000:]
    root = out / "checkpoints"
    assert read_latest(root) == "step-00000004-epoch-end"
    assert not (root / "step-00000006").exists() and not list(root.glob(".tmp-*"))
    final = AsyncRun(out, *SUPERVISED, name="final").finish()
    assert json.loads((out / "run.json").read_text())["started_at"] == 4
    assert runner.same(final, reference) == []


@pytest.mark.slow
def test_two_processes_save_in_the_background_what_they_save_synchronously(tmp_path):
    """``accelerate launch --multi_gpu --num_processes 2`` (CPU, gloo): every rank's random
    states land before the main process's writer publishes; the run ends where the
    synchronous one ends, with the same checkpoints."""

    def launch(out, script):
        done = launching.run_two(script, out, *SUPERVISED, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert json.loads((out / "run.json").read_text())["num_processes"] == 2
        return runner.params(out)

    sync = launch(tmp_path / "sync", runner.SCRIPT)
    background = launch(tmp_path / "async", runner.HERE / "async_resumable.py")
    assert runner.same(background, sync) == []
    names = sorted(p.name for p in (tmp_path / "sync" / "checkpoints").glob("step-*"))
    assert sorted(p.name for p in (tmp_path / "async" / "checkpoints").glob("step-*")) == names
    assert len(names) == 3  # keep_last=3
    for name in names:
        a, b = (tmp_path / d / "checkpoints" / name for d in ("sync", "async"))
        assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
        assert {"random_states_0.pkl", "random_states_1.pkl", "hookloop-rank1.safetensors"} <= \
            set(manifest(b)["files"])
        for file in ("model.safetensors", "optimizer.bin", "random_states_1.pkl"):
            assert (a / file).read_bytes() == (b / file).read_bytes(), (name, file)
