"""Checkpoint roots that are not one folder for every process, as on machines
that each have their own disk (tests/checkpointing/test_shared_folders.py).
Run under ``accelerate launch --multi_gpu --num_processes 2`` on CPU:

    python unshared_folders.py OUT save
        every rank saves into OUT/disk<rank>/checkpoints: the first save
        fails on both ranks;
    python unshared_folders.py OUT resume
        both ranks train and save into OUT/shared/checkpoints; then a new
        Loop(resume_from="latest") where rank 1's root is an empty
        OUT/disk1/checkpoints (fails on both), one where rank 0's is
        (fails on both), and one after rank 1 copied the shared root to
        its own disk (resumes on both).

Each rank writes OUT/<phase>-<rank>.json: the error's type and message, or
where it resumed from.
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop
from hookloop.loop import _open_loops
from hookloop.plugins import Checkpoint

out, mode = Path(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
accelerator = Accelerator(cpu=True)
rank = accelerator.process_index
assert accelerator.num_processes == 2, accelerator.num_processes


def loop(root, **kwargs):
    set_seed(0)
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    model = torch.nn.Linear(4, 2)
    return Loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                train_data=DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True),
                plugins=[Checkpoint(dir=root, every_steps=2)], accelerator=accelerator,
                block=["progress"], **kwargs)


def phase(name, run):
    try:
        result = {"ok": run()}
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        result = {"error": type(exc).__name__, "message": str(exc)}
    (out / f"{name}-{rank}.json").write_text(json.dumps(result))
    for left in list(_open_loops):  # a Loop(resume_from=...) that raised: its prepared objects
        left.close()
    accelerator.wait_for_everyone()  # (a rank that hung would never get here)


def resume(root):
    def run():
        resumed = loop(root, resume_from="latest")
        try:
            return str(resumed.resumed_from)
        finally:
            resumed.close()
    return run


def fit(root):
    def run():
        trained = loop(root)
        try:
            trained.fit(epochs=1)
            return trained.state.global_step
        finally:
            trained.close()
    return run


if mode == "save":
    phase("save", fit(out / f"disk{rank}" / "checkpoints"))
else:
    shared = out / "shared" / "checkpoints"
    phase("train", fit(shared))
    own = out / f"disk{rank}" / "checkpoints"
    phase("rank1-blind", resume(own if rank == 1 else shared))
    phase("rank0-blind", resume(own if rank == 0 else shared))
    if rank == 1:
        shutil.copytree(shared, out / "copy" / "checkpoints")
    accelerator.wait_for_everyone()
    phase("copied", resume(out / "copy" / "checkpoints" if rank == 1 else shared))
