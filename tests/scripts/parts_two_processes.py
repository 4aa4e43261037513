"""Train the guide's "Several modules, one optimizer" example (docs/plugins.md:
one Network whose model is a ModuleDict with a dispatching forward, one
optimizer over both parts) in two processes and report whether the ranks agree.

Launched by tests/loop/test_networks.py with
``accelerate launch --multi_gpu --num_processes 2 parts_two_processes.py OUT.json``.
Writes (main process) a JSON report: the number of processes, the class of
``network.model`` (the DDP wrapper), whether the parameters are identical on
both ranks, whether the ranks trained on different batches, whether the
weights moved, and how often the one optimizer stepped.
"""

import json
import re
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, Network, hookimpl

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def guide_definitions():
    """The example's imports and classes (Parts, Cycle), as the guide has them."""
    body = GUIDE.read_text().split("\n## Several modules, one optimizer\n", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"```python\n(.*?)```", body, flags=re.S)[-1]
    namespace = {}
    exec(compile(code.split("\ntorch.manual_seed(0)\n", 1)[0], "docs/plugins.md:parts", "exec"), namespace)
    return namespace


class Watch:
    name = "watch"

    def __init__(self):
        self.steps = 0
        self.first_batch = None

    @hookimpl
    def before_step(self, batch):
        if self.first_batch is None:
            self.first_batch = batch[0].detach().clone()

    @hookimpl
    def after_optimizer_step(self):
        self.steps += 1


def main():
    out = sys.argv[1]
    guide = guide_definitions()
    accelerator = Accelerator(cpu=True)  # without cpu=True --multi_gpu on a CPU runs two single processes
    set_seed(0)
    a = torch.randn(128, 4)
    b = a @ torch.randn(4, 4)
    generators = guide["Parts"]({"g_ab": torch.nn.Linear(4, 4), "g_ba": torch.nn.Linear(4, 4)})
    before = torch.cat([p.detach().reshape(-1) for p in generators.parameters()])
    watch = Watch()
    loop = Loop(networks={"generators": Network(generators, torch.optim.Adam(generators.parameters(), lr=1e-2))},
                strategy=guide["Cycle"](), plugins=[watch], accelerator=accelerator, block=["progress"],
                train_data=DataLoader(TensorDataset(a, b), batch_size=16, shuffle=True))
    wrapper = type(loop.networks["generators"].model).__name__
    loop.fit(epochs=2)

    def rows(t):  # one row per rank
        return accelerator.gather(t.detach().reshape(1, -1))

    flat = torch.cat([p.detach().reshape(-1) for p in loop.networks["generators"].unwrapped.parameters()])
    params, batches = rows(flat), rows(watch.first_batch)
    report = {
        "num_processes": accelerator.num_processes,
        "model": wrapper,
        "identical": bool(torch.equal(params[0], params[-1])),
        "batches_differ": not torch.equal(batches[0], batches[-1]),
        "moved": not torch.equal(flat, before),
        "steps": watch.steps,
    }
    if accelerator.is_main_process:
        Path(out).write_text(json.dumps(report))
    loop.close()


if __name__ == "__main__":
    main()
