"""SIGTERM / SIGINT / SIGUSR1: finish the step, save, run on_exception, exit with 75."""

import json
import os
import signal

import pytest
from accelerate import Accelerator

from hookloop import hookimpl
from hookloop.checkpointing import read_manifest
from hookloop.plugins import Checkpoint
from hookloop.preemption import PREEMPTED_EXIT_CODE, Preempted
from hookloop.testing import HookRecorder

import runner

ARGS = ("--strategy", "supervised", "--accum", "2", "--epochs", "3", "--every-steps", "3")


def test_the_exit_status_is_documented_and_distinct():
    assert PREEMPTED_EXIT_CODE == 75  # EX_TEMPFAIL; not 143, what a plain SIGTERM kill shows
    assert Preempted(signal.SIGTERM, 3).code == 75


def test_sigterm_exits_75_after_the_current_step_and_the_run_resumes_equal(tmp_path):
    reference = runner.Run(tmp_path / "reference", *ARGS).finish()
    out = tmp_path / "run"
    out.mkdir()
    # a plain interpreter: its own exit status, not multiprocessing's
    process = runner.plain_python(out, *ARGS, "--pause", "signal:14")
    marker = out / "paused-0"
    runner.wait_for_markers(process, marker)  # held inside batch 14 (update 7), before its backward pass
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=runner.PATIENCE_S)[0]
    assert process.returncode == PREEMPTED_EXIT_CODE, output[-3000:]
    assert "SIGTERM received" in output and "exiting with status 75" in output

    stopped = json.loads((out / "preempted-0.json").read_text())
    assert stopped["step"] == 7  # update 7 finished; no update 8
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == "step-00000007"  # not a periodic one: 6 and 9 are
    doc = read_manifest(out / "checkpoints" / latest)  # complete: every file, its size
    assert doc["reason"] == "preempted" and doc["loop"]["global_step"] == 7

    final = runner.Run(out, *ARGS, name="resumed").finish()
    assert json.loads((out / "run.json").read_text())["started_at"] == 7
    assert runner.same(final, reference) == []


class SendSignal:
    """Sends this process ``signum`` during batch ``at`` (``times`` times)."""

    name = "send_signal"

    def __init__(self, at, signum=signal.SIGINT, times=1):
        self.at, self.signum, self.times = at, signum, times

    @hookimpl
    def before_backward(self, loop):
        if loop.state.micro_step + 1 == self.at:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)


def test_sigint_in_process_stops_after_the_step_saves_and_calls_on_exception(tiny_loop, tmp_path):
    before = signal.getsignal(signal.SIGINT)
    recorder = HookRecorder(hooks=["on_exception", "on_fit_end", "after_step"])
    loop = tiny_loop([SendSignal(at=3), Checkpoint(dir=tmp_path), recorder])
    with pytest.raises(Preempted) as info:
        loop.fit(epochs=2)
    assert info.value.code == PREEMPTED_EXIT_CODE
    assert info.value.global_step == 3 and loop.state.global_step == 3
    assert info.value.checkpoint == tmp_path / "step-00000003"
    assert (tmp_path / "latest").read_text().strip() == "step-00000003"
    assert recorder.names()[-2:] == ["after_step", "on_exception"]
    assert "on_fit_end" not in recorder.names()
    loop.close()
    assert signal.getsignal(signal.SIGINT) is before  # handlers given back with the loop


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_slurms_warning_signal_sigusr1_is_a_preemption_by_default(tiny_loop, tmp_path):
    """``#SBATCH --signal=USR1@90``: the warning saves and stops as SIGTERM does (0.3
    left SIGUSR1 to its default action, which kills the process, nothing saved)."""
    before = signal.getsignal(signal.SIGUSR1)
    loop = tiny_loop([SendSignal(at=3, signum=signal.SIGUSR1), Checkpoint(dir=tmp_path)])
    with pytest.raises(Preempted) as info:
        loop.fit(epochs=2)
    assert info.value.code == PREEMPTED_EXIT_CODE and info.value.signal == signal.SIGUSR1
    assert info.value.global_step == 3
    assert read_manifest(tmp_path / "step-00000003")["reason"] == "preempted"
    assert json.loads((tmp_path / "PREEMPTED").read_text())["signal"] == "SIGUSR1"
    loop.close()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_under_accumulation_the_stop_waits_for_the_optimizer_step(tiny_loop, tmp_path):
    loop = tiny_loop([SendSignal(at=3, signum=signal.SIGTERM), Checkpoint(dir=tmp_path)],
                     accelerator=Accelerator(gradient_accumulation_steps=2))
    with pytest.raises(Preempted) as info:
        loop.fit(epochs=2)
    # batch 3 only accumulated gradients, which no checkpoint keeps: batch 4 applies
    # them, completing update 2
    assert info.value.global_step == 2 and loop.state.micro_step == 4
    assert info.value.signal == signal.SIGTERM


def test_a_second_sigint_interrupts_at_once(tiny_loop, tmp_path):
    recorder = HookRecorder(hooks=["on_exception"])
    loop = tiny_loop([SendSignal(at=3, times=2), Checkpoint(dir=tmp_path), recorder])
    with pytest.raises(KeyboardInterrupt):
        loop.fit(epochs=2)
    assert loop.state.global_step == 2  # step 3 never finished
    assert recorder.names() == ["on_exception"]
    assert not (tmp_path / "latest").exists()


def test_signals_none_leaves_signal_handling_alone(tiny_loop, tmp_path):
    seen = []

    class Look:
        @hookimpl
        def after_step(self):
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    tiny_loop([Checkpoint(dir=tmp_path, signals=None), Look()]).fit(max_steps=1)
    assert seen == [before]


# -- preemption covers the whole process: start-up, load_checkpoint, after fit --------------


def _held(process, out, rank=0):
    marker = out / f"paused-{rank}"
    runner.wait_for_markers(process, marker)
    return json.loads(marker.read_text())


@pytest.mark.slow  # three fresh processes, ~20 s
def test_sigterm_during_start_up_in_load_checkpoint_exits_75_and_the_run_resumes(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    first = runner.plain_python(out, *ARGS, "--pause", "step:7")
    os.kill(_held(first, out)["pid"], signal.SIGKILL)  # a checkpoint after update 3 is left
    first.communicate(timeout=runner.PATIENCE_S)
    process = runner.plain_python(out, *ARGS, "--pause", "load")  # held in Loop(resume_from=...)
    _held(process, out)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=runner.PATIENCE_S)[0]
    assert process.returncode == PREEMPTED_EXIT_CODE, output[-3000:]  # not -15
    assert "SIGTERM received outside fit (nothing new to save" in output
    stopped = json.loads((out / "preempted-0.json").read_text())
    assert stopped["where"] == "start-up" and stopped["code"] == 75
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000003"  # nothing new
    final = runner.Run(out, *ARGS, name="resumed").finish()
    assert json.loads((out / "run.json").read_text())["started_at"] == 3
    reference = runner.Run(tmp_path / "reference", *ARGS).finish()
    assert runner.same(final, reference) == []


@pytest.mark.slow  # three fresh processes, ~20 s
def test_sigterm_during_a_predict_after_fit_exits_75_and_marks_the_root(tmp_path):
    process = runner.plain_python(tmp_path, *ARGS, "--predict", "--pause", "predict:2")
    _held(process, tmp_path)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=runner.PATIENCE_S)[0]
    assert process.returncode == PREEMPTED_EXIT_CODE, output[-3000:]  # not -15
    stopped = json.loads((tmp_path / "preempted-0.json").read_text())
    assert stopped["where"] == "predict" and stopped["step"] == 12
    root = tmp_path / "checkpoints"
    assert stopped["checkpoint"] == str(root / "step-00000012-epoch-end")  # the fit's last
    marker = json.loads((root / "PREEMPTED").read_text())  # for a wrapper under a launcher
    assert marker["signal"] == "SIGTERM" and marker["global_step"] == 12
    assert not (root / "hookloop.lock").exists()  # no fit holds the root


def test_a_sigint_between_two_fits_raises_preempted_in_process(tiny_loop, tmp_path):
    loop = tiny_loop([Checkpoint(dir=tmp_path)])
    loop.fit(max_steps=2)
    with pytest.raises(Preempted) as info:
        signal.raise_signal(signal.SIGINT)  # the handler runs in this (the main) thread, at once
    assert info.value.global_step == 2 and info.value.checkpoint == tmp_path / "step-00000002"
    assert (tmp_path / "PREEMPTED").exists()
    loop.fit(max_steps=4)  # a resumed fit is the next one: the marker goes
    assert not (tmp_path / "PREEMPTED").exists()
