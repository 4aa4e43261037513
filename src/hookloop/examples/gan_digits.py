"""hookloop's first demo: a GAN learns to draw 8x8 digits, on a laptop CPU.

    hookloop demo                       # or: hookloop demo gan --epochs 20
    python -m hookloop.examples.gan_digits --help

Two small MLPs, a generator and a discriminator, trained in turn by one
:class:`hookloop.Loop` with the :class:`hookloop.strategies.GAN` strategy on
scikit-learn's 1,797 real digits (shipped with scikit-learn, no download).
Everything around the training step is a plugin, composed here in code:

- ``GradClip``: clips each network's gradients, the generator's and the
  discriminator's, with the same plugin;
- ``Logger``: both losses, learning rates and gradient norms to a JSON-lines
  file (``hookloop.trackers.JSONLinesTracker`` through Accelerate's trackers);
- ``ProgressBar``;
- ``SampleGrid``: a PNG grid of samples from the same latent vectors after
  every epoch, so the epochs can be compared by eye;
- ``DigitQuality`` (defined below): every few epochs, how good the digits
  are, judged by a classifier trained on the real ones
  (:mod:`hookloop.examples.digits_quality`).

At the end it prints the quality next to an untrained generator's, and
where the pictures and the log are (under ``./hookloop-runs/gan``, ``--out``).
The Fréchet distances say how many samples they measure: the progress lines
use 1,000 generated digits, the final table ``--samples`` (1,797), and the
distance's estimate reads higher on fewer samples. About a minute on 2 CPU
cores.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, Network, hookimpl
from hookloop.examples.demo_support import default_out
from hookloop.examples.digits_quality import DigitJudge, load_real_digits
from hookloop.plugins import GradClip, Logger, ProgressBar, SampleGrid
from hookloop.strategies import GAN
from hookloop.trackers import JSONLinesTracker

RUN_NAME = "gan-digits"
SCALE = 6  # screen pixels per digit pixel in the PNG grids


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hookloop demo gan",
        description="Train a small GAN on scikit-learn's 8x8 digits and show its samples.",
    )
    p.add_argument("--epochs", type=int, default=200, help="passes over the 1,797 digits (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=default_out("gan"),
                   help=f"output directory (default ./{default_out('gan')})")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--latent-dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256, help="width of both MLPs' hidden layers")
    p.add_argument("--dropout", type=float, default=0.3,
                   help="dropout in the discriminator: with 1,797 digits it would otherwise memorise them")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate, decayed linearly to 0")
    p.add_argument("--max-norm", type=float, default=5.0, help="gradient clipping, each network")
    p.add_argument("--log-every", type=int, default=20, help="log the losses every N steps")
    p.add_argument("--quality-every", type=int, default=20, help="judge the samples every N epochs (0: only at the end)")
    p.add_argument("--samples", type=int, default=1797, help="generated digits the final quality is measured on")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: these matrices are too small to share)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-decay", action="store_true", help="keep the learning rate constant")
    return p


def mlp(sizes, out_activation=None, dropout=0.0):
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.LeakyReLU(0.2))
            if dropout:
                layers.append(torch.nn.Dropout(dropout))
    if out_activation is not None:
        layers.append(out_activation)
    return torch.nn.Sequential(*layers)


def generate(model, strategy, n, seed):
    """``n`` digits from ``model`` for latent vectors drawn with ``seed``."""
    z = strategy.sample_latent(n, torch.Generator().manual_seed(seed))
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model(z.to(next(model.parameters()).device)).float().cpu()
    model.train(was_training)
    return out


class DigitQuality:
    """Every ``every`` epochs, judge the generator's digits and add
    ``frechet`` and ``coverage`` to the epoch's metrics (the Logger, given
    after this plugin, logs them). Main process only."""

    name = "digit-quality"

    def __init__(self, judge, every=20, n=1000, seed=1):
        self.judge, self.every, self.n, self.seed = judge, every, n, seed

    @hookimpl
    def on_epoch_end(self, loop, epoch, metrics):
        if not self.every or (epoch + 1) % self.every or not loop.accelerator.is_main_process:
            return
        G = loop.networks["generator"].unwrapped
        q = self.judge.quality(generate(G, loop.strategy, self.n, self.seed))
        metrics.update(frechet=q["frechet"], coverage=q["coverage"])
        _write(f"after {epoch + 1:3d} epochs: Fréchet distance ({self.n} samples) {q['frechet']:7.1f}, "
               f"digits covered {q['coverage']:2d}/10")


def _write(line):
    from tqdm.auto import tqdm

    tqdm.write(line)  # keeps a progress bar intact


def _clean(out: Path):
    """Remove what an earlier run of this demo wrote (the log appends)."""
    for path in [out / "logs" / f"{RUN_NAME}.jsonl", out / "quality.json",
                 *(out / "samples").glob("epoch-*.png")]:
        if path.exists():
            path.unlink()


def run(argv=None) -> dict:
    """Train and judge; return the quality report (also in ``OUT/quality.json``)."""
    args = build_parser().parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args) -> dict:
    out = Path(args.out)
    accelerator = Accelerator(
        log_with=[JSONLinesTracker(RUN_NAME, out / "logs")], project_dir=str(out)
    )
    main_process = accelerator.is_main_process
    if main_process:
        _clean(out)
    set_seed(args.seed)

    images, _ = load_real_digits()  # (1797, 64) in [-1, 1]
    data = DataLoader(TensorDataset(images), batch_size=args.batch_size, shuffle=True, drop_last=True)
    G = mlp([args.latent_dim, args.hidden, args.hidden, 64], torch.nn.Tanh())
    D = mlp([64, args.hidden, args.hidden, 1], dropout=args.dropout)
    untrained = copy.deepcopy(G)
    betas = (0.5, 0.999)  # the usual GAN Adam (Radford et al., 2015)
    strategy = GAN(latent_dim=args.latent_dim)
    judge = DigitJudge(seed=args.seed) if main_process else None  # only the main process judges
    quality = DigitQuality(judge, every=args.quality_every)
    samples = SampleGrid(out / "samples", n=100, nrow=10, image_shape=(8, 8), seed=args.seed, scale=SCALE)
    networks = {}
    total = args.epochs * len(data)  # optimizer steps; len(data) before sharding, see ACCELERATE-NOTES
    for name, model in (("generator", G), ("discriminator", D)):
        opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=betas)
        # a linear decay to 0 settles the two players' oscillation at the end
        decay = None if args.no_decay else torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: max(0.0, 1 - step / total))
        networks[name] = Network(model, opt, decay)
    loop = Loop(
        networks=networks,
        strategy=strategy,
        train_data=data,
        plugins=[
            GradClip(max_norm=args.max_norm),
            quality,
            Logger(every=args.log_every, console=False, project_name=RUN_NAME, config=vars(args)),
            ProgressBar(every=10, disable=True if args.no_progress else None),
            samples,
        ],
        accelerator=accelerator,
    )
    start = time.perf_counter()
    loop.fit(epochs=args.epochs)
    seconds = time.perf_counter() - start

    report = {}
    if judge is not None:  # made on the main process only: the one that reports
        trained = judge.quality(generate(G, strategy, args.samples, args.seed + 1))
        before = judge.quality(generate(untrained, strategy, args.samples, args.seed + 1))
        real = judge.quality(images)
        report = {
            "epochs": args.epochs,
            "steps": loop.state.global_step,
            "train_seconds": round(seconds, 1),
            "judge_accuracy": judge.accuracy,
            "trained": trained,
            "untrained": before,
            "real": {**real, "frechet": judge.real_floor},
            "samples": [str(p) for p in samples.paths],
            "log": str(out / "logs" / f"{RUN_NAME}.jsonl"),
            # how many digits each Fréchet distance compares: it reads higher on fewer
            "frechet_samples": {"generated": args.samples, "real": len(images),
                                "real_halves": [len(images) // 2, len(images) - len(images) // 2],
                                "progress": quality.n},
        }
        if samples.paths:
            report["progress"] = str(progress_strip(samples.paths, out / "progress.png", SCALE))
        (out / "quality.json").write_text(json.dumps(report, indent=2))
        _summary(report, out)
    loop.close()
    return report


def progress_strip(paths, dest, scale, rows=11):
    """One picture of the whole run: the top row of ``rows`` evenly spaced
    epoch grids (8x8 digits, 1 pixel of padding, each pixel ``scale`` wide),
    stacked from the untrained generator (top) to the last epoch (bottom)."""
    from PIL import Image

    picks = sorted({round(i * (len(paths) - 1) / max(rows - 1, 1)) for i in range(rows)})
    grids = [Image.open(paths[i]) for i in picks]
    height = (1 + 8) * scale  # the padding above the row, and the row
    strip = Image.new(grids[0].mode, (grids[0].width, height * len(grids) + scale), 128)
    for i, grid in enumerate(grids):
        strip.paste(grid.crop((0, 0, grid.width, height)), (0, i * height))
    strip.save(dest)
    return dest


def _summary(r, out):
    t, u, real, n = r["trained"], r["untrained"], r["real"], r["frechet_samples"]
    rows = [("trained generator", t), ("untrained generator", u), ("real digits (half vs half)", real)]
    counted = f"({n['generated']} samples)"
    lines = [
        "",
        f"Trained {r['epochs']} epochs ({r['steps']} steps per network) in {r['train_seconds']:.0f} s.",
        f"Quality, judged by a digit classifier trained on the real digits "
        f"({100 * r['judge_accuracy']:.1f}% accuracy on real digits it did not see):",
        f"  {'':<27}{'Fréchet distance':>17}{'digits covered':>16}{'recognisable':>14}",
        f"  {'':<27}{counted:>17}",
    ]
    for label, q in rows:
        lines.append(f"  {label:<27}{q['frechet']:>17.1f}{q['coverage']:>13d}/10{100 * q['recognisable']:>13.0f}%")
    paths = r["samples"]
    lines += [
        f"  (Fréchet distance in the judge's features, lower is closer: {n['generated']} generated "
        f"digits against",
        f"   the {n['real']} real ones; real digits: {n['real_halves'][0]} against "
        f"{n['real_halves'][1]} (the floor). The \"after N epochs\"",
        f"   lines judge {n['progress']} samples, and fewer samples read higher. Covered: digits "
        f"that are",
        "   recognisably at least 2% of the samples)",
        "",
        f"Pictures: {paths[0]} ... {os.path.basename(paths[-1])} (one grid per epoch, same latent vectors)"
        if paths else "Pictures: none",
        f"          {r['progress']} (top rows of 11 grids, first to last epoch: the run at a glance)"
        if "progress" in r else "",
        f"Log:      {r['log']} (JSON lines: losses, learning rates, gradient norms)",
        f"Quality:  {out / 'quality.json'}",
    ]
    print("\n".join(lines))


def main(argv=None) -> int:
    """``hookloop demo gan [options]``."""
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
