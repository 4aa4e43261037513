"""What test_ray.py observes of the README's ``train_func``, as written: an
installed plugin that autoloads (ray_run.py installs it on the workers' path
as a distribution with a ``hookloop`` entry point), since the block's code
is not to be changed.

Every start appends a line to ``$RAY_PROBE_OUT/starts.jsonl`` (rank 0: the
update it starts at, the checkpoint it resumed, the processes); the fit's end
writes ``params.pt`` (rank 0: the final parameters). With ``RAY_PROBE_FAIL=1``
the rank-1 worker dies (``os._exit(1)``) twice, at once, without waiting for
Ray to register what was reported: in the first attempt right after its
first report (in ``after_save_checkpoint``), in the second at the first safe
point two updates after its first report. Each death appends to
``failures.jsonl`` the update and the newest checkpoint published by then.
"""

import json
import os
from pathlib import Path

import torch

from hookloop import hookimpl


class Probe:
    autoload = True  # an installed observer: it acts in every Loop without being named
    changes_training = False  # (no number changes; with RAY_PROBE_FAIL a worker dies)

    def __init__(self):
        self.out = Path(os.environ["RAY_PROBE_OUT"])
        self.fail = os.environ.get("RAY_PROBE_FAIL") == "1"
        self.first_report = self.last_saved = None
        log = self.out / "failures.jsonl"
        self.failures = len(log.read_text().splitlines()) if log.exists() else 0

    @hookimpl
    def on_fit_start(self, loop):
        acc = loop.accelerator
        if acc.is_main_process:
            with open(self.out / "starts.jsonl", "a") as f:
                f.write(json.dumps({"global_step": loop.state.global_step,
                                    "resumed_from": str(loop.resumed_from),
                                    "num_processes": acc.num_processes,
                                    "distributed_type": acc.distributed_type.value}) + "\n")

    def die(self, loop):
        with open(self.out / "failures.jsonl", "a") as f:
            f.write(json.dumps({"global_step": loop.state.global_step, "last_saved": self.last_saved}) + "\n")
        os._exit(1)

    def dies_here(self, loop):
        return (self.fail and loop.accelerator.process_index == 1
                and loop.plugins.get("ray-report").reports >= 1)

    @hookimpl(trylast=True)  # after RayReport's report (an installed plugin's trylast comes after the user's)
    def after_save_checkpoint(self, loop, checkpoint):
        self.last_saved = Path(checkpoint).name
        if self.first_report is None:
            self.first_report = loop.state.global_step
        if self.failures == 0 and self.dies_here(loop):
            self.die(loop)

    @hookimpl  # (before Checkpoint's save at this safe point: it saves trylast)
    def on_safe_point(self, loop):
        if (self.failures == 1 and self.dies_here(loop) and self.first_report is not None
                and loop.state.global_step >= self.first_report + 2):
            self.die(loop)

    @hookimpl
    def on_fit_end(self, loop):
        if loop.accelerator.is_main_process:
            weights = loop.networks["model"].unwrapped.state_dict()
            torch.save({k: v.detach().clone() for k, v in weights.items()}, self.out / "params.pt")
