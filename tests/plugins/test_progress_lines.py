"""The built-in progress without a terminal: plain lines (update/total, epoch,
loss, rate, time left) and one line of metrics per epoch, never a carriage
return; on a terminal the bar and none of those lines.

The real runs are subprocesses whose output goes where a user's does
(``python train.py > out.log 2> err.log``, a pseudo-terminal); the schedule
and the format are checked in-process against an injected clock.
"""

import json
import os
import re
import select
import subprocess
import sys
import time

import pytest
import torch

from hookloop import hookimpl
from hookloop.plugins import ProgressBar
from hookloop.plugins import progress as progress_module

#: 2 epochs of 20 updates; loop.log({"seen": examples}) each update (no tracker); every
#: update's loss and fit's metrics written to files, the metrics also printed on stdout
SCRIPT = """
import json, sys
import torch
from torch.utils.data import DataLoader, TensorDataset
from hookloop import Loop, hookimpl

class Record:
    losses = {}

    @hookimpl
    def after_step(self, loop, loss):
        loop.log({"seen": loop.state.global_step * 8})
        self.losses[loop.state.global_step] = float(loss.detach())

torch.manual_seed(0)
x, y = torch.randn(160, 8), torch.randint(0, 3, (160,))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
loop = Loop(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
            train_data=DataLoader(TensorDataset(x, y), batch_size=8),
            eval_data=DataLoader(TensorDataset(x[:32], y[:32]), batch_size=8), plugins=[Record()])
metrics = loop.fit(epochs=2)
print("metrics", json.dumps(metrics))
json.dump({"losses": Record.losses, "metrics": metrics}, open(sys.argv[1], "w"))
"""
TOTAL = 40
PROGRESS = re.compile(r"update (\d+)/40 \((\d+)%\) \| epoch (\d+) \| loss (\S+) seen (\d+) \| "
                      r"(?:[\d.]+ updates/s|[\d.]+ s/update) \| \d+:\d\d:\d\d elapsed, \d+:\d\d:\d\d left")
EPOCH = re.compile(r"epoch (\d+) eval_loss (\S+) eval_accuracy (\S+)")


def script_env():
    return dict(os.environ, OMP_NUM_THREADS="1", HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD="1")


def test_with_stdout_and_stderr_to_files_it_prints_progress_lines_and_epoch_metrics(tmp_path):
    script, record = tmp_path / "train.py", tmp_path / "record.json"
    script.write_text(SCRIPT)
    with open(tmp_path / "out.log", "wb") as out, open(tmp_path / "err.log", "wb") as err:
        done = subprocess.run([sys.executable, str(script), str(record)], stdout=out, stderr=err,
                              env=script_env(), timeout=300)
    out, err = (tmp_path / "out.log").read_bytes(), (tmp_path / "err.log").read_bytes()
    assert done.returncode == 0, err.decode()[-3000:]
    assert b"\r" not in out and b"\r" not in err
    ran = json.loads(record.read_text())
    lines = err.decode().splitlines()
    shown = {}
    for line in lines:
        match = PROGRESS.fullmatch(line)
        if match:
            update, percent, epoch, loss, seen = match.groups()
            shown[int(update)] = line
            assert int(percent) == int(update) * 100 // TOTAL, line
            assert int(epoch) == (int(update) - 1) // 20, line  # 20 updates an epoch
            assert loss == f"{ran['losses'][update]:.4g}", line  # this update's loss (on the host)
            assert int(seen) == int(update) * 8, line  # the latest loop.log value
    # the first update, every tenth of the run, the last; more only if 60 s passed in between
    assert {1, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40} <= set(shown), lines
    epochs = [EPOCH.fullmatch(line) for line in lines if line.startswith("epoch ")]
    assert [m and m.group(1) for m in epochs] == ["0", "1"], lines
    last = ran["metrics"]
    assert epochs[1].groups()[1:] == (f"{last['eval_loss']:.4g}", f"{last['eval_accuracy']:.4g}")
    # in order: epoch 0's line after update 20's, before update 24's
    assert lines.index(shown[20]) < lines.index(epochs[0].group(0)) < lines.index(shown[24])
    # stdout stays the program's own
    assert out.decode().splitlines() == [f"metrics {json.dumps(last)}"]


def run_on_a_terminal(tmp_path, deadline_s=300):
    """Run SCRIPT with stdout and stderr on a pseudo-terminal (120 columns);
    return everything the terminal received."""
    import fcntl
    import pty
    import struct
    import termios

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "record.json")], stdin=slave,
                            stdout=slave, stderr=slave, env=script_env(), close_fds=True)
    os.close(slave)
    received, deadline = b"", time.monotonic() + deadline_s
    try:
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"the run on a pseudo-terminal did not end within {deadline_s} s:\n{received[-3000:]!r}"
            ready, _, _ = select.select([master], [], [], left)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # (EIO: every end of the terminal's other side is closed)
                break
            if not data:
                break
            received += data
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    assert proc.wait(timeout=60) == 0, received[-3000:]
    return received.decode()


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals (pty) are POSIX")
def test_on_a_terminal_the_bar_shows_and_none_of_the_lines(tmp_path):
    shown = run_on_a_terminal(tmp_path)
    assert "40/40" in shown and "step/s" in shown  # the bar
    assert "seen=" in shown  # loop.log's latest value, without a tracker, on the bar
    assert not re.search(r"update \d+/40", shown), shown
    assert not re.search(r"epoch \d+ eval_loss", shown), shown


# -- in-process: the schedule, the format, the options -----------------------------------


class Clock:
    """The progress plugin's clock, advanced by ``seconds`` at each batch."""

    def __init__(self, seconds):
        self.seconds, self.now = seconds, 0.0

    @hookimpl(tryfirst=True)
    def before_step(self):
        self.now += self.seconds


class Losses:
    def __init__(self):
        self.at = {}

    @hookimpl
    def after_step(self, loop, loss):
        self.at[loop.state.global_step] = float(loss.detach())


def clocked_loop(tiny_loop, monkeypatch, seconds, bar, *plugins, **kwargs):
    clock, losses = Clock(seconds), Losses()
    monkeypatch.setattr(progress_module, "monotonic", lambda: clock.now)
    loop = tiny_loop([clock, losses, bar, *plugins], n=8 * 20, block=[], **kwargs)  # 20 updates an epoch
    return loop, losses


def test_a_line_every_n_updates_or_m_seconds_with_rate_and_time_left(tiny_loop, monkeypatch, capsys):
    """7 s an update: lines at the first update, then whenever 60 s have passed
    (updates 10, 19, 34) or at update 25 (every 25), and the last; the epoch
    metrics after each epoch."""
    bar = ProgressBar(lines=True, line_updates=25, line_seconds=60)
    loop, losses = clocked_loop(tiny_loop, monkeypatch, 7.0, bar, eval_data=True)
    metrics = loop.fit(epochs=2)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert [int(line.split()[1].split("/")[0]) for line in lines if line.startswith("update ")] == [
        1, 10, 19, 25, 34, 40]
    loss = losses.at
    assert (f"update 1/40 (2%) | epoch 0 | loss {loss[1]:.4g} | 7.0 s/update | "
            "0:00:07 elapsed, 0:04:33 left") in lines
    # the rate leaves the first update's setup out: (10 - 1) updates in (70 - 7) s; 30 left
    assert (f"update 10/40 (25%) | epoch 0 | loss {loss[10]:.4g} | 7.0 s/update | "
            "0:01:10 elapsed, 0:03:30 left") in lines
    assert (f"update 40/40 (100%) | epoch 1 | loss {loss[40]:.4g} | 7.0 s/update | "
            "0:04:40 elapsed, 0:00:00 left") in lines
    epoch_lines = [line for line in lines if line.startswith("epoch ")]
    assert epoch_lines[1] == (f"epoch 1 eval_loss {metrics['eval_loss']:.4g} "
                              f"eval_accuracy {metrics['eval_accuracy']:.4g}")
    update_19 = next(line for line in lines if line.startswith("update 19/"))
    assert lines.index(epoch_lines[0]) == lines.index(update_19) + 1  # after update 20, before 25
    assert "\r" not in captured.err and captured.out == ""
    assert bar.mode is None and bar.bar is None  # closed at the fit's end


def test_a_resumed_fit_counts_its_own_updates_a_line_every_tenth_by_default(tiny_loop, monkeypatch, capsys):
    """A second fit starts at update 20, as a resumed run does: its rate and
    time left count from there; a line at its first update and at every tenth
    of the whole run (4 updates)."""
    loop, losses = clocked_loop(tiny_loop, monkeypatch, 0.25, ProgressBar(lines=True))
    loop.fit(epochs=1)
    capsys.readouterr()
    loop.fit(epochs=2)
    lines = capsys.readouterr().err.splitlines()
    updates = [line for line in lines if line.startswith("update ")]
    assert [int(line.split()[1].split("/")[0]) for line in updates] == [21, 24, 28, 32, 36, 40]
    # 1 update in 0.25 s since the fit started; 19 left
    assert updates[0] == (f"update 21/40 (52%) | epoch 1 | loss {losses.at[21]:.4g} | 4.0 updates/s | "
                          "0:00:00 elapsed, 0:00:05 left")
    # (24 - 21) updates in 0.75 s since the first line; 16 left
    assert updates[1] == (f"update 24/40 (60%) | epoch 1 | loss {losses.at[24]:.4g} | 4.0 updates/s | "
                          "0:00:01 elapsed, 0:00:04 left")
    assert lines[-1] == "epoch 1 ended (no metrics)"


def test_a_loop_log_value_is_read_from_the_host_copy_at_the_line(tiny_loop, monkeypatch, capsys):
    """Without a tracker, the newest loop.log values ride with the loss; with
    ``every=1000`` the copy is made at the line's update itself."""

    class LogsTwice:
        @hookimpl(tryfirst=True)  # before the progress plugin's line
        def after_step(self, loop):
            step = loop.state.global_step
            loop.log({"double": float(2 * step), "half": torch.tensor(step / 2)})

    bar = ProgressBar(every=1000, lines=True, line_updates=7)
    loop, _ = clocked_loop(tiny_loop, monkeypatch, 0.5, bar, LogsTwice())
    loop.fit(max_steps=14)
    updates = [line for line in capsys.readouterr().err.splitlines() if line.startswith("update ")]
    assert [re.search(r"loss \S+ double (\S+) half (\S+) \|", line).groups() for line in updates] == [
        ("2", "0.5"), ("14", "3.5"), ("28", "7")]


class LateEvent:
    """A CUDA event as a busy device gives it: the copy arrives at the third look."""

    def __init__(self):
        self.looks = 0

    def query(self):
        self.looks += 1
        return self.looks >= 3


def test_a_line_waits_for_its_copy_and_the_epoch_end_prints_it_with_the_newest_there(
        tiny_loop, monkeypatch, capsys):
    """Copies that arrive two updates late (as from a busy GPU): each line is
    printed when its copy is there, with that copy's loss; the last one,
    still waiting at the epoch's end, with the newest copy there."""
    copy = progress_module._to_host
    monkeypatch.setattr(progress_module, "_to_host", lambda values: (LateEvent(), copy(values)[1]))
    loop, losses = clocked_loop(tiny_loop, monkeypatch, 0.5, ProgressBar(lines=True, line_updates=5))
    loop.fit(epochs=1)
    lines = capsys.readouterr().err.splitlines()
    shown = [re.match(r"update (\d+)/20 \(\d+%\) \| epoch 0 \| loss (\S+) \|", line).groups()
             for line in lines[:-1]]
    loss = losses.at
    assert shown == [("3", f"{loss[1]:.4g}"), ("7", f"{loss[5]:.4g}"), ("12", f"{loss[10]:.4g}"),
                     ("17", f"{loss[15]:.4g}"), ("20", f"{loss[15]:.4g}")]
    assert lines[-1] == "epoch 0 ended (no metrics)"


def test_under_gradient_accumulation_the_lines_count_updates_not_batches(tiny_loop, capsys):
    from accelerate import Accelerator

    loop = tiny_loop([ProgressBar(lines=True, line_updates=2)], block=[],
                     accelerator=Accelerator(gradient_accumulation_steps=2))  # 8 batches: 4 updates
    loop.fit(epochs=1)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" | ")[0] for line in lines if line.startswith("update ")] == [
        "update 1/4 (25%)", "update 2/4 (50%)", "update 4/4 (100%)"]


def test_the_options_choose_the_mode_and_only_the_main_process_prints(tiny_loop, monkeypatch, capsys):
    from accelerate import Accelerator

    def shown(bar, **kwargs):
        loop = tiny_loop([bar], block=[], **kwargs)
        loop.fit(max_steps=3)
        return capsys.readouterr().err

    # not a terminal here (captured): lines by default
    assert "update 1/3 (33%) | epoch 0 | loss " in shown(ProgressBar())
    assert shown(ProgressBar(disable=True)) == ""
    assert shown(ProgressBar(lines=False)) == ""  # no terminal, no lines: nothing
    forced = shown(ProgressBar(disable=False))  # the bar, even here
    assert "3/3" in forced and "update 1/3" not in forced
    monkeypatch.setattr(Accelerator, "is_main_process", property(lambda self: False))
    assert shown(ProgressBar(lines=True)) == ""


@pytest.mark.parametrize("kwargs, message", [
    ({"disable": False, "lines": True}, r"ProgressBar\(disable=False, lines=True\): .* give one of them"),
    ({"line_updates": 0}, "line_updates must be a positive number of updates, got 0"),
    ({"line_seconds": -1}, "line_seconds must be a positive number of seconds or None"),
    ({"lines": "yes"}, "lines is None .*, True or False, got 'yes'"),
    ({"every": 2.5}, "every must be a positive number of updates, got 2.5"),
])
def test_bad_options_are_refused_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ProgressBar(**kwargs)
