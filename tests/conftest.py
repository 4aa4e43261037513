import os
import sys
from pathlib import Path

import pytest
import torch

# tests/ (paths.py, handwritten.py) and tests/scripts/ (the multi-process
# scripts' shared modules) import from any folder of tests/
_HERE = Path(__file__).resolve().parent
for _path in (_HERE, _HERE / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

# No test may reach a model hub, nor pick up a plugin installed on the machine.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD", "1")
# One intra-op thread per process, in this one and the ones it starts: the
# tests' tensors are tiny, and the README's command runs two xdist workers on
# two cores, each starting two-process runs; more threads than cores spin and
# wait. (hookloop.testing, loaded first as a pytest plugin, has imported
# torch already: the variable reaches the processes started from here, the
# call this one.)
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session", autouse=True)
def _accelerate_release_said():
    """On an Accelerate release hookloop's fast path was not checked against
    (CI's run on the oldest declared one), the first Loop(...) of a process
    warns once: said here, before the first test, so that no test's own
    warnings depend on which test builds the first Loop."""
    from hookloop import accelerate_fastpath

    warn_if_unverified = getattr(accelerate_fastpath, "warn_if_unverified", None)  # (not in 0.4.0.dev0)
    if warn_if_unverified is not None:
        warn_if_unverified()


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    from hookloop.testing import reset_accelerate

    reset_accelerate()
    yield
    _close_open_loops()
    reset_accelerate()


def _close_open_loops():
    """Close the loops a test left open, as the interpreter does at exit:
    their signal handlers (a Checkpoint plugin's, from Loop(...) on) and
    prepared objects do not leak into the next test."""
    from hookloop.loop import _open_loops

    for loop in list(_open_loops):
        loop.close()
