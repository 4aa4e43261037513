"""SIGTERM / SIGINT: finish the step, save, run on_exception, exit with 75."""

import json
import os
import signal
import sys
import time
from pathlib import Path

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
    while not marker.exists():  # held inside batch 14 (update 7), before its backward pass
        assert process.poll() is None, process.communicate()[0][-3000:]
        time.sleep(0.02)
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
    assert signal.getsignal(signal.SIGINT) is before  # handlers given back


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
