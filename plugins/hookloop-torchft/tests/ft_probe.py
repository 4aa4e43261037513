"""What test_torchft.py observes of the README's ``train.py``, as written: an
installed plugin that autoloads (the test installs it on the groups' path as
a distribution with a ``hookloop`` entry point), since the block's code is
not to be changed.

``$FT_PROBE_OUT/records.jsonl``: one line per batch (the update, the position
in the epoch and the examples of the batch, the groups taking part, the
updates discarded so far, the time, the rank). ``FT_PROBE_SLEEP``: seconds
to sleep after each update until the file ``FT_PROBE_PACED_UNTIL`` exists
(so that this group still trains when a killed one comes back: it may take
seconds to start; the test writes the file once it is back), then full speed.
``FT_PROBE_KILL_AT=K``: rank 1 SIGKILLs itself after update K, once (a
``killed`` file next to the records remembers it across a restart).
"""

import json
import os
import signal
import time
from pathlib import Path

from hookloop import hookimpl


class Probe:
    autoload = True  # an installed observer: it acts in every Loop without being named
    changes_training = False  # (no number changes; it only sleeps, or kills its process)

    def __init__(self):
        self.file = Path(os.environ["FT_PROBE_OUT"]) / "records.jsonl"
        self.sleep = float(os.environ.get("FT_PROBE_SLEEP", "0"))
        self.paced_until = Path(os.environ.get("FT_PROBE_PACED_UNTIL") or os.devnull)
        kill_at = os.environ.get("FT_PROBE_KILL_AT")
        self.kill_at = int(kill_at) if kill_at else None
        self.inputs = None

    @hookimpl
    def on_fit_start(self, loop):
        self.inputs = loop.train_data.dataset.tensors[0]  # to tell which examples a batch holds

    @hookimpl
    def after_step(self, loop, batch):
        indices = [int((self.inputs == row).all(1).nonzero()[0]) for row in batch[0]]
        participants = loop.plugins.get("fault-tolerant").manager.num_participants()
        with open(self.file, "a") as f:
            f.write(json.dumps({"global_step": loop.state.global_step, "epoch": loop.state.epoch,
                                "step_in_epoch": loop.state.step_in_epoch, "indices": indices,
                                "participants": participants,
                                "discarded": loop.discarded_updates, "time": time.time(),
                                "rank": loop.accelerator.process_index}) + "\n")
        marker = self.file.parent / "killed"
        if loop.accelerator.process_index == 1 and loop.state.global_step == self.kill_at and not marker.exists():
            marker.write_text(str(self.kill_at))
            os.kill(os.getpid(), signal.SIGKILL)  # (under torchrun --max-restarts: the group restarts)
        if self.sleep:
            if self.paced_until.exists():
                self.sleep = 0.0
            else:
                time.sleep(self.sleep)
