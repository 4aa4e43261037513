"""Train a small GAN in two processes and report whether the ranks agree.

Launched by tests/test_gan.py::test_two_processes with
``accelerate launch --multi_gpu --num_processes 2 ... gan_two_processes.py OUT.json``.
Writes (main process) a JSON report: the number of processes, whether each
network's parameters are identical on both ranks, whether the ranks drew
different latent noise, and how often each network's optimizer stepped.
"""

import argparse
import json

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, Network, hookimpl
from hookloop.plugins import GradClip
from hookloop.strategies import GAN


class Watch:
    """Counts optimizer steps per network and keeps the first latent batch."""

    name = "watch"

    def __init__(self):
        self.steps = {"generator": 0, "discriminator": 0}
        self.first_latent = None

    @hookimpl
    def after_optimizer_step(self, network):
        self.steps[network.name] += 1

    @hookimpl
    def after_step(self, outputs):
        if self.first_latent is None:
            self.first_latent = outputs["discriminator"]["latent"].detach().clone()


def mlp(i, o):
    return torch.nn.Sequential(torch.nn.Linear(i, 32), torch.nn.LeakyReLU(0.2), torch.nn.Linear(32, o))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--n-critic", type=int, default=1)
    args = parser.parse_args()

    # cpu=True: without it `--multi_gpu` on a CPU machine silently runs
    # two independent single processes
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accum)
    set_seed(0)  # the same on both ranks: the strategy must still vary the noise
    angles = torch.rand(256) * 6.2832
    data = torch.stack([angles.cos(), angles.sin()], 1) * 2 + 0.05 * torch.randn(256, 2)
    G, D = mlp(4, 2), mlp(2, 1)
    watch = Watch()
    loop = Loop(
        networks={
            "generator": Network(G, torch.optim.Adam(G.parameters(), lr=1e-3)),
            "discriminator": Network(D, torch.optim.Adam(D.parameters(), lr=1e-3)),
        },
        strategy=GAN(latent_dim=4, n_critic=args.n_critic),
        train_data=DataLoader(TensorDataset(data), batch_size=16, shuffle=True),
        plugins=[GradClip(max_norm=1.0), watch],
        accelerator=accelerator,
        block=["progress"],
    )
    loop.fit(epochs=2)

    def rows(t):  # one row per rank
        return accelerator.gather(t.detach().reshape(1, -1))

    report = {"num_processes": accelerator.num_processes, "steps": watch.steps}
    for name, network in loop.networks.items():
        flat = torch.cat([p.reshape(-1) for p in network.unwrapped.parameters()])
        r = rows(flat)
        report[f"{name}_identical"] = bool(torch.equal(r[0], r[-1]))
    z = rows(watch.first_latent)
    report["latents_differ"] = not torch.equal(z[0], z[-1])
    report["global_step"] = loop.state.global_step
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump(report, f)
    loop.close()


if __name__ == "__main__":
    main()
