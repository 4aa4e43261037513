"""Start, pause and kill runs of resumable.py for the tests, cheaply.

A new ``python`` that imports torch and creates an optimizer (which imports
``torch._dynamo``) takes several seconds here; the kill-and-resume tests
need a dozen processes. Runs are therefore forked from a multiprocessing
*forkserver* that imported all that once: each run is still a separate
process, started from a clean state (the server never trains), killed with a
real SIGKILL, with its own exit status. One test per file uses a plain
``python resumable.py`` as well, for the interpreter's own exit status.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "resumable.py"
#: generous: only a broken run takes this long (then the test fails)
PATIENCE_S = 180

def context():
    """The forkserver launching.py's two-rank runs use too (one per process)."""
    import launching

    return launching.forkserver()


class Run:
    """One run of resumable.py in ``out`` (a forked process)."""

    def __init__(self, out: Path, *args, name="run"):
        import resumable

        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = self.out / f"{name}.log"
        for marker in self.out.glob("paused-*"):
            marker.unlink()
        self.process = context().Process(target=resumable.child,
                                         args=([str(self.out), *map(str, args)], str(self.log)))
        self.process.start()

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def wait_paused(self, ranks=(0,)):
        """Until the run holds at its --pause point (markers paused-<rank>)."""
        deadline = time.monotonic() + PATIENCE_S
        while not all((self.out / f"paused-{r}").exists() for r in ranks):
            if not self.process.is_alive():
                raise AssertionError(f"the run ended (exit {self.process.exitcode}) before "
                                     f"pausing:\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                self.process.kill()
                raise AssertionError(f"the run never paused:\n{self.output()[-3000:]}")
            time.sleep(0.02)

    def kill(self):
        """SIGKILL, as the kernel's OOM killer or ``kill -9`` would."""
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(PATIENCE_S)
        assert self.process.exitcode == -signal.SIGKILL

    def signal(self, signum):
        os.kill(self.process.pid, signum)

    def wait(self) -> int:
        self.process.join(PATIENCE_S)
        if self.process.exitcode is None:
            self.process.kill()
            raise AssertionError(f"the run did not finish:\n{self.output()[-3000:]}")
        return self.process.exitcode

    def finish(self) -> dict:
        """Wait for a normal end; the final parameters."""
        code = self.wait()
        assert code == 0, f"exit {code}:\n{self.output()[-3000:]}"
        return params(self.out)


def params(out: Path) -> dict:
    return torch.load(Path(out) / "params.pt", weights_only=True)


def plain_python(out: Path, *args) -> subprocess.Popen:
    """The same run as a plain ``python resumable.py`` process."""
    for marker in Path(out).glob("paused-*"):
        marker.unlink()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(SCRIPT), str(out), *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def launch_two(out: Path, *args, script: Path = SCRIPT):
    """The run in two processes, as ``accelerate launch --multi_gpu
    --num_processes 2`` runs it (resumable.py, or ``script``, asks for
    ``Accelerator(cpu=True)``): both ranks forked from the forkserver
    (launching.TwoRanks), handled as the launch's ``Popen``; ``kill()``
    SIGKILLs both ranks at once."""
    import launching

    for marker in Path(out).glob("paused-*"):
        marker.unlink()
    return launching.TwoRanks(script, out, *args)


def accelerate_launch_two(out: Path, *args, script: Path = SCRIPT) -> subprocess.Popen:
    """The same under the real ``accelerate launch``, for a test of what the
    launcher itself reports; in its own session, so that the test can kill
    the launcher and both ranks at once."""
    for marker in Path(out).glob("paused-*"):
        marker.unlink()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", "0", str(script), str(out), *map(str, args)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for_markers(process, *markers: Path) -> None:
    """Until every marker file exists (a run holding at its ``--pause``
    point writes ``paused-<rank>``), polling with a deadline: a process that
    ends first, or a marker that never comes within PATIENCE_S, fails the
    test with a message naming which marker did not appear, and the output."""
    deadline = time.monotonic() + PATIENCE_S
    while not all(m.exists() for m in markers):
        missing = ", ".join(m.name for m in markers if not m.exists())
        if process.poll() is not None:
            raise AssertionError(f"the run exited {process.returncode} before writing {missing}:\n"
                                 f"{process.communicate()[0][-4000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"{missing} never appeared within {PATIENCE_S} s:\n"
                                 f"{process.communicate()[0][-4000:]}")
        time.sleep(0.02)


def same(a: dict, b: dict) -> list[str]:
    """Names of the tensors that differ (bit for bit)."""
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]
