"""A supervised demo: an MLP learns scikit-learn's 8x8 digits in seconds.

    hookloop demo digits [--epochs 10] [--out hookloop-runs/digits]

The log goes to ``./hookloop-runs/digits/train.jsonl`` (``--out``).

Everything beyond the hand-written Accelerate loop is a plugin: gradient
clipping, logging (console + JSON lines), the progress bar.
"""

import argparse
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop
from hookloop.plugins import GradClip, Logger
from hookloop.examples.demo_support import default_out
from hookloop.trackers import JSONLinesTracker


def digits_tensors(seed=0, test_fraction=0.2):
    """The 1,797 digits scikit-learn ships (no download), scaled to [0, 1],
    split with a fixed seed."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hookloop demo digits", description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=default_out("digits"),
                        help=f"where the JSON-lines log goes (default ./{default_out('digits')})")
    args = parser.parse_args(argv)

    out = Path(args.out)
    accelerator = Accelerator(log_with=[JSONLinesTracker("train", out)])
    set_seed(args.seed)
    (x_train, y_train), (x_test, y_test) = digits_tensors(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(128, 10)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    train = DataLoader(TensorDataset(x_train, y_train), batch_size=args.batch_size, shuffle=True)
    test = DataLoader(TensorDataset(x_test, y_test), batch_size=256)

    loop = Loop(
        model=model, optimizer=optimizer, train_data=train, eval_data=test,
        plugins=[GradClip(max_norm=1.0), Logger(every=20, console=False, config=vars(args))],
        accelerator=accelerator,
    )
    start = time.perf_counter()
    metrics = loop.fit(epochs=args.epochs)
    loop.print(
        f"held-out accuracy {metrics['eval_accuracy']:.3f} on {len(x_test)} digits "
        f"after {args.epochs} epochs ({time.perf_counter() - start:.1f} s); "
        f"log: {out / 'train.jsonl'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
