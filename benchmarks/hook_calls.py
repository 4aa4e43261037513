"""The cost of hook dispatch per training step, per plugin, in one process.

    python benchmarks/hook_calls.py

overhead.py measures whole steps, where a plugin's fraction of a µs is lost in
the noise of a ~400 µs step. This calls the hooks one supervised step calls
(the same hooks, the same arguments, in the same order), through ``loop.hook``
and through pluggy's own callers, with 0 and 10 no-op plugins that implement
every hook, and reports µs per step and µs per plugin per step (best of 7
timeit runs). The strategy and the default plugins are unregistered: this is
the dispatch alone.
"""

from __future__ import annotations

import os
import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD", "1")


def per_step_calls(hook, loop, network, batch, outputs, loss):
    """The twelve hook calls of one supervised step (no accumulation)."""
    hook.before_step(loop=loop, batch=batch)
    hook.training_step(loop=loop, batch=batch)
    hook.compute_loss(loop=loop, network=network, batch=batch, outputs=outputs)
    hook.before_backward(loop=loop, network=network, loss=loss)
    hook.after_backward(loop=loop, network=network)
    hook.before_optimizer_step(loop=loop, network=network)
    hook.after_optimizer_step(loop=loop, network=network)
    hook.before_scheduler_step(loop=loop, network=network)
    hook.after_scheduler_step(loop=loop, network=network)
    hook.before_zero_grad(loop=loop, network=network)
    hook.after_zero_grad(loop=loop, network=network)
    hook.after_step(loop=loop, batch=batch, outputs=outputs, loss=loss)


def build(n_plugins):
    from hookloop import Loop

    import workloads as W

    NoOp = W.noop_plugin_class()
    plugins = []
    for i in range(n_plugins):
        plugin = NoOp()
        plugin.name = f"noop{i}"
        plugins.append(plugin)
    model = torch.nn.Linear(2, 2)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 2)), batch_size=2)
    loop = Loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                train_data=data, plugins=plugins)
    for name in loop.plugins.names():  # the strategy and the defaults: dispatch alone
        if not name.startswith("noop"):
            loop.plugins.unregister(name)
    return loop


def measure(loop, relay) -> float:
    network = loop.networks["model"]
    batch, outputs, loss = (torch.zeros(2, 2),), torch.zeros(2, 2), torch.zeros(())
    n = 20000
    best = min(timeit.repeat(lambda: per_step_calls(relay, loop, network, batch, outputs, loss),
                             number=n, repeat=7))
    return best / n * 1e6


def main() -> int:
    torch.set_num_threads(1)
    rows = []
    for n in (0, 10):
        loop = build(n)
        rows.append((n, measure(loop, loop.hook), measure(loop, loop.plugins.pm.hook)))
    (_, h0, p0), (_, h10, p10) = rows
    print("| dispatch per supervised step | 0 no-op plugins | 10 no-op plugins | per plugin |")
    print("|---|---:|---:|---:|")
    print(f"| hookloop (`loop.hook`) | {h0:.2f} µs | {h10:.2f} µs | {(h10 - h0) / 10:.2f} µs |")
    print(f"| pluggy's own callers | {p0:.2f} µs | {p10:.2f} µs | {(p10 - p0) / 10:.2f} µs |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
