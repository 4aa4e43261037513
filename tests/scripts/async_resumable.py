"""resumable.py with ``Checkpoint(asynchronous=True)``, for
tests/checkpointing/test_async_checkpoint.py.

    python async_resumable.py OUT [resumable.py's options] [--hold K]

``--hold K`` holds the writer process of the checkpoint after update K
between its model's file and its optimizer's (``model.safetensors`` written,
``optimizer.bin`` not yet): it writes OUT/paused-0 (the writer's pid, where)
and sleeps until killed, while training goes on (and waits at its next save,
which waits for this one). See writer_setup.py.
"""

import functools
import sys
from pathlib import Path

import resumable
import writer_setup
from hookloop.plugins import Checkpoint


def main(argv):
    argv = list(argv)
    hold = None
    if "--hold" in argv:
        i = argv.index("--hold")
        hold = int(argv[i + 1])
        del argv[i:i + 2]
    out = Path(argv[0])
    resumable.Checkpoint = functools.partial(Checkpoint, asynchronous=True)
    if hold is not None:
        import os

        writer_setup.use(os.environ, pause=[str(out), f"step-{hold:08d}"])
    resumable.main(argv)


def child(argv, log):
    """Entry point of a forked run (tests/scripts/runner.py's server)."""
    import os

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
