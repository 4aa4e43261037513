"""What Accelerate's per-step wrappers cost by themselves, and what hookloop's
fast path (hookloop.accelerate_fastpath) leaves of it. One process, 1 thread,
best of 7 timeit runs, on a 2x2 linear model so that the wrapped work is tiny.

    python benchmarks/accelerate_calls.py
"""

from __future__ import annotations

import inspect
import sys
import timeit
import warnings

import torch


def main() -> int:
    torch.set_num_threads(1)
    # the scheduler steps without a real optimizer step here: not a user's mistake
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
    from accelerate import Accelerator
    from accelerate.utils import is_lomo_available

    from hookloop.accelerate_fastpath import FastPath

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    raw = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the calls change nothing
    raw_sched = torch.optim.lr_scheduler.LambdaLR(raw, lambda s: 1.0)
    model, optimizer, scheduler = accelerator.prepare(model, raw, raw_sched)
    fast = FastPath(accelerator)
    x = torch.ones(1, 2)
    g = dict(locals(), inspect=inspect, is_lomo_available=is_lomo_available)

    def t(stmt, n=5000):
        return min(timeit.repeat(stmt, globals=g, number=n, repeat=7)) / n * 1e6

    rows = [
        ("optimizer.step() + zero_grad()", "optimizer.step(); optimizer.zero_grad()",
         "raw.step(); raw.zero_grad()", "fast.step(optimizer); fast.zero_grad(optimizer)"),
        ("backward(loss)", "accelerator.backward(model(x).sum())", "model(x).sum().backward()",
         "fast.backward(model(x).sum())"),
        ("scheduler.step()", "scheduler.step()", "raw_sched.step()", None),
    ]
    print("| call | Accelerate | plain PyTorch | hookloop fast path |")
    print("|---|---:|---:|---:|")
    for label, acc, plain, hook in rows:
        cells = [f"{t(acc):.1f} µs", f"{t(plain):.1f} µs",
                 f"{t(hook):.1f} µs" if hook else "(Accelerate's)"]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("\nwhere Accelerate's extra time goes, per call:")
    print(f"  is_lomo_available() (importlib find_spec; twice per optimizer.step): "
          f"{t('is_lomo_available()'):.1f} µs")
    print(f"  inspect.signature(optimizer.zero_grad) (once per zero_grad): "
          f"{t('inspect.signature(raw.zero_grad)'):.1f} µs")
    print(f"  loss / gradient_accumulation_steps (= 1) in backward: "
          f"{t('model(x).sum() / 1') - t('model(x).sum()'):.1f} µs, plus its backward node")
    return 0


if __name__ == "__main__":
    sys.exit(main())
