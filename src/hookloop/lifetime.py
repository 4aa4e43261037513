"""The loops open in this process: every one is closed at interpreter exit
(its plugins' ``on_loop_end``, its prepared objects released), then the
process group is destroyed. Several gloo processes with a DDP-wrapped model
otherwise abort in about 1 run in 3 while the interpreter tears down
("terminate called without an active exception"); ``Loop.close`` alone keeps
the group, for a second loop in the same script."""

from __future__ import annotations

import atexit
import weakref

import torch

_open_loops: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _close_open_loops():
    if not _open_loops:
        return
    for loop in list(_open_loops):
        try:
            loop.close()
        except Exception:  # noqa: BLE001
            pass
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        try:  # at exit only: Loop.close keeps the group for later loops
            torch.distributed.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


