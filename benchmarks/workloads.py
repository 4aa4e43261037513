"""The benchmark's workloads and the loops that train them.

Every loop here trains the same seeded model on the same seeded data, so
that loops which do the same arithmetic end with bitwise-equal parameters:

``plain``      plain PyTorch: no Accelerate, no hookloop.
``hand``       the reference workload's hand-written Accelerate loop: ``prepare``, then per
               batch forward, loss, ``accelerator.backward``,
               ``optimizer.step()``, ``scheduler.step()``,
               ``optimizer.zero_grad()``.
``hookloop*``  ``hookloop.Loop`` on the same objects (see ``VARIANTS``).

Timing is per epoch (one clock read at each epoch's start and end, in both
loops; a device sync first on CUDA), so nothing is added to the per-step path
of any loop. hookloop's clock is a plugin that implements only
``on_epoch_start`` / ``on_epoch_end``: no per-step hook gains an
implementation, so the default per-step path is the one users get.
"""

from __future__ import annotations

import hashlib
import time

import torch
import torch.nn.functional as F

#: what each workload trains on; ``quick`` shrinks it for the smoke test. The
#: first ``warmup`` epochs are not timed (BERT's steps keep speeding up for two).
SIZES = {
    # a step of a few hundred µs on one CPU thread: overhead dominates
    "mlp": dict(batches=100, batch_size=32, epochs=12, warmup=1, quick_batches=8, quick_epochs=2),
    # a realistic step: a 2-layer BERT from a BertConfig, batch 8, 64 tokens
    "bert": dict(batches=8, batch_size=8, epochs=10, warmup=2, quick_batches=2, quick_epochs=2),
    # BERT-base (12 layers, 768 wide), batch 16, 128 tokens: a GPU's workload (gpu_check.sh)
    "bert-base": dict(batches=10, batch_size=16, epochs=4, warmup=1, quick_batches=1, quick_epochs=2),
    # two small MLPs, a generator and a discriminator
    "gan": dict(batches=100, batch_size=32, epochs=12, warmup=1, quick_batches=8, quick_epochs=2),
    # a near-empty step (a 2x2 weight is the model's output): the loops' own cost
    "empty": dict(batches=200, batch_size=2, epochs=12, warmup=2, quick_batches=8, quick_epochs=2),
}

MLP_FEATURES, MLP_HIDDEN, MLP_CLASSES = 32, 64, 4
BERT_SEQ, BERT_VOCAB = 64, 1000
GAN_LATENT, GAN_DATA, GAN_HIDDEN = 16, 32, 64


# -- models and data ------------------------------------------------------------


class Workload:
    """Everything one run needs; built after ``set_seed`` in a fresh process."""

    def __init__(self, name, quick, deterministic=False):
        self.name = name
        size = SIZES[name]
        self.batches = size["quick_batches"] if quick else size["batches"]
        self.batch_size = size["batch_size"]
        self.epochs = size["quick_epochs"] if quick else size["epochs"]
        self.warmup = 1 if quick else size["warmup"]
        n = self.batches * self.batch_size
        if name == "mlp":
            self.models = {"model": _mlp(MLP_FEATURES, MLP_HIDDEN, MLP_CLASSES)}
            dataset = torch.utils.data.TensorDataset(
                torch.randn(n, MLP_FEATURES), torch.randint(0, MLP_CLASSES, (n,))
            )
        elif name == "bert":
            self.models = {"model": _bert(deterministic)}
            dataset = _TokenDataset(n)
        elif name == "bert-base":
            self.models = {"model": _bert(deterministic, base=True)}
            dataset = _TokenDataset(n, seq=128, vocab=30522)
        elif name == "empty":
            self.models = {"model": _Empty()}
            dataset = torch.utils.data.TensorDataset(torch.zeros(n, 1), torch.arange(n) % 2)
        elif name == "gan":
            self.models = {
                "generator": _mlp(GAN_LATENT, GAN_HIDDEN, GAN_DATA),
                "discriminator": _mlp(GAN_DATA, GAN_HIDDEN, 1),
            }
            dataset = torch.randn(n, GAN_DATA) * 0.5 + 1.0  # "real" samples
        else:
            raise ValueError(f"unknown workload {name!r}")
        self.dataloader = torch.utils.data.DataLoader(
            dataset, batch_size=self.batch_size, shuffle=True
        )
        self.optimizers = {
            k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in self.models.items()
        }
        total = self.batches * self.epochs
        self.schedulers = {  # linear decay, as transformers' get_linear_schedule does
            k: torch.optim.lr_scheduler.LambdaLR(o, lambda s: max(0.0, 1 - s / total))
            for k, o in self.optimizers.items()
        }


def _mlp(inputs, hidden, outputs):
    return torch.nn.Sequential(
        torch.nn.Linear(inputs, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, outputs),
    )


class _Empty(torch.nn.Module):
    """Ignores its input and returns its 2x2 weight as the logits of a batch
    of 2: a step is then little more than the loop's own work."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2, 2))

    def forward(self, x):
        return self.weight


def _bert(deterministic=False, base=False):
    from transformers import BertConfig, BertForSequenceClassification

    # on CUDA, fused attention kernels may add up gradients in a varying
    # order; plain matmul-softmax attention does not
    extra = {"attn_implementation": "eager"} if deterministic else {}
    if base:  # BERT-base's shape: BertConfig's defaults
        return BertForSequenceClassification(BertConfig(num_labels=2, **extra))
    config = BertConfig(
        vocab_size=BERT_VOCAB,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
        max_position_embeddings=BERT_SEQ,
        num_labels=2,
        **extra,
    )
    return BertForSequenceClassification(config)


class _TokenDataset(torch.utils.data.Dataset):
    """Random token ids with a padded tail, as a tokenizer would give."""

    def __init__(self, n, seq=BERT_SEQ, vocab=BERT_VOCAB):
        self.ids = torch.randint(1, vocab, (n, seq))
        lengths = torch.randint(seq // 2, seq + 1, (n,))
        self.mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        self.ids = self.ids * self.mask
        self.labels = torch.randint(0, 2, (n,))

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def seed_everything(seed: int) -> None:
    """What ``accelerate.utils.set_seed`` does on one device, without
    importing Accelerate into the plain-PyTorch process."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # every device's generator


def params_digest(models) -> str:
    """SHA-256 of every parameter's bytes, in a fixed order: equal digests
    mean bitwise-equal parameters."""
    h = hashlib.sha256()
    for name in sorted(models):
        for pname, p in models[name].state_dict().items():
            h.update(pname.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# -- the clock ------------------------------------------------------------------


class EpochClock:
    """Seconds per epoch, from one clock read at each epoch's start and end.

    ``kind="cpu"``: the process's CPU time (``time.process_time``). On one
    CPU thread it is the step's own work, and it does not count the time the
    process waits while other programs hold the CPU, so a shared machine's
    load moves it far less than wall time. ``kind="wall"``:
    ``time.perf_counter``, after a device sync on CUDA (CPU time would miss
    the GPU's work)."""

    def __init__(self, device, kind="wall"):
        self.cuda = torch.device(device).type == "cuda"
        if kind not in ("wall", "cpu"):
            raise ValueError(f"clock must be 'wall' or 'cpu', got {kind!r}")
        self.now = time.process_time if kind == "cpu" else time.perf_counter
        self.seconds: list[float] = []
        self._t0 = 0.0

    def start(self):
        if self.cuda:
            torch.cuda.synchronize()
        self._t0 = self.now()

    def stop(self):
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds.append(self.now() - self._t0)


# -- the loops ------------------------------------------------------------------


def supervised_loss(model, batch):
    """The reference workload's per-batch loss: ``outputs.loss`` for a dict batch (the
    model was given labels), else cross-entropy of ``model(inputs)``."""
    if isinstance(batch, dict):
        return model(**batch).loss
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)


def run_plain(work: Workload, clock: EpochClock, device: str):
    """Plain PyTorch, no Accelerate: the floor."""
    device = torch.device(device)
    for m in work.models.values():
        m.to(device)
    if work.name == "gan":
        return _gan_by_hand(work, clock, lambda loss: loss.backward(), device, work.dataloader,
                            *work.models.values(), *work.optimizers.values(),
                            *work.schedulers.values(), to=device)
    model, = work.models.values()
    optimizer, = work.optimizers.values()
    scheduler, = work.schedulers.values()
    for _ in range(work.epochs):
        model.train()
        clock.start()
        for batch in work.dataloader:
            batch = _to(batch, device)
            loss = supervised_loss(model, batch)
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        clock.stop()
    return work.models


def run_hand(work: Workload, clock: EpochClock, accelerator):
    """The reference workload's hand-written Accelerate loop."""
    if work.name == "gan":
        G, D = work.models["generator"], work.models["discriminator"]
        G, D, opt_g, opt_d, dl, sched_g, sched_d = accelerator.prepare(
            G, D, work.optimizers["generator"], work.optimizers["discriminator"],
            work.dataloader, work.schedulers["generator"], work.schedulers["discriminator"],
        )
        _gan_by_hand(work, clock, accelerator.backward, accelerator.device, dl,
                     G, D, opt_g, opt_d, sched_g, sched_d)
        return {k: accelerator.unwrap_model(m) for k, m in (("generator", G), ("discriminator", D))}
    model, optimizer, dataloader, scheduler = accelerator.prepare(
        work.models["model"], work.optimizers["model"], work.dataloader, work.schedulers["model"]
    )
    for _ in range(work.epochs):
        model.train()
        clock.start()
        for batch in dataloader:
            loss = supervised_loss(model, batch)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        clock.stop()
    return {"model": accelerator.unwrap_model(model)}


def _gan_by_hand(work, clock, backward, device, dataloader, G, D, opt_g, opt_d, sched_g, sched_d,
                 to=None):
    """ACCELERATE-NOTES' GAN pattern, with each optimizer's step, scheduler
    step and ``zero_grad`` as in the reference workload: one G forward per batch; the D
    step on ``D(real)`` and ``D(fake.detach())`` with one backward; then the
    G step on a fresh ``D(fake)``. The latent noise comes from a per-process
    ``torch.Generator`` reseeded every step, drawn exactly as
    ``hookloop.strategies.GAN`` draws it, so the two can end bitwise equal."""
    bce = F.binary_cross_entropy_with_logits
    noise = torch.Generator(device=device)
    seed, rank, step = torch.initial_seed(), 0, 0
    for _ in range(work.epochs):
        G.train()
        D.train()
        clock.start()
        for real in dataloader:
            if to is not None:
                real = real.to(to)
            noise.manual_seed(_mix(seed, rank, step))
            z = torch.randn((real.shape[0], GAN_LATENT), generator=noise, device=device)
            fake = G(z)
            opt_d.zero_grad()
            d_real, d_fake = D(real), D(fake.detach())
            d_loss = bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))
            backward(d_loss)
            opt_d.step()
            sched_d.step()
            opt_g.zero_grad()
            d_out = D(fake)
            g_loss = bce(d_out, torch.ones_like(d_out))
            backward(g_loss)
            opt_g.step()
            sched_g.step()
            step += 1
        clock.stop()
    return {"generator": G, "discriminator": D}


_MASK64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    """A copy of ``hookloop.strategies.gan._mix`` (splitmix64 rounds): the
    seed of one step's latent noise. Copied so that the hand-written process
    does not import hookloop."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h >> 1


def _to(batch, device):
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [v.to(device) for v in batch]
    return batch.to(device)


# -- hookloop -------------------------------------------------------------------

#: hookloop variants: the plugins given in code, and environment overrides
VARIANTS = {
    # Loop(model, optimizer, scheduler, train_data): the defaults a user gets
    # (strategy, default loss, the built-in progress, which prints plain lines
    # when stderr is not a terminal, as here)
    "hookloop": {},
    # the same, with hookloop's Accelerate fast path switched off
    "hookloop-nofast": {"env": {"HOOKLOOP_ACCELERATE_FASTPATH": "0"}},
    # Logger(every=50) and the progress bar forced on (written to a pipe)
    "hookloop-log": {"plugins": "logging"},
    # ten no-op plugins, each implementing every hook
    "hookloop-noop10": {"plugins": "noop10"},
    # ablations (step_instructions.py): the defaults less one built-in plugin
    "hookloop-nofinite": {"block": ["finite"]},
    "hookloop-noprogress": {"block": ["progress"]},
}
#: variants of both loops on another Accelerator (benchmarks/gpu_check.sh): ``hand-bf16`` is
#: ``hookloop-bf16``'s twin, its parameters compared with it
ACCELERATOR_OPTIONS = {
    "bf16": {"mixed_precision": "bf16"},
    "fp16": {"mixed_precision": "fp16"},  # (GradScaler: Accelerate's, in both loops)
    "compile": {"dynamo_backend": "inductor"},
}
for _option in ACCELERATOR_OPTIONS:
    VARIANTS[f"hookloop-{_option}"] = {}


def accelerator_options(variant: str) -> dict:
    """The ``Accelerator`` keyword arguments of ``variant`` (``hand-bf16``: bf16)."""
    return ACCELERATOR_OPTIONS.get(variant.rsplit("-", 1)[-1], {}) if "-" in variant else {}


def twin(variant: str) -> str:
    """The hand-written loop ``variant`` is compared with."""
    option = variant.rsplit("-", 1)[-1]
    return f"hand-{option}" if option in ACCELERATOR_OPTIONS else "hand"


def noop_plugin_class():
    """A class whose instances implement every hook with a method that takes
    all of the hook's arguments and does nothing (a plugin's worst case:
    pluggy builds the full argument list for each call)."""
    import inspect

    from hookloop import hookimpl, hookspecs
    from hookloop.manager import hook_names

    namespace = {}
    for hook in hook_names():
        args = ", ".join(inspect.signature(getattr(hookspecs, hook)).parameters)
        exec(f"def {hook}(self, {args}):\n    return None\n", namespace)  # noqa: S102
        namespace[hook] = hookimpl(namespace[hook])
    return type("NoOp", (), {k: v for k, v in namespace.items() if k in hook_names()})


def make_clock_plugin(clock):
    from hookloop import hookimpl

    class Clock:
        """Reads the clock at epoch start and end only."""

        name = "bench-clock"

        @hookimpl
        def on_epoch_start(self):
            clock.start()

        @hookimpl
        def on_epoch_end(self):
            clock.stop()

    return Clock()


def run_hookloop(work: Workload, clock: EpochClock, accelerator, variant: str):
    from hookloop import Loop, Network
    from hookloop.plugins import Logger, ProgressBar

    plugins = [make_clock_plugin(clock)]
    extra = VARIANTS[variant].get("plugins")
    if extra == "logging":
        plugins += [Logger(every=50), ProgressBar(disable=False)]
    elif extra == "noop10":
        NoOp = noop_plugin_class()
        for i in range(10):
            plugin = NoOp()
            plugin.name = f"noop{i}"
            plugins.append(plugin)
    if work.name == "gan":
        from hookloop.strategies import GAN

        loop = Loop(
            networks={
                k: Network(work.models[k], work.optimizers[k], work.schedulers[k])
                for k in ("generator", "discriminator")
            },
            strategy=GAN(latent_dim=GAN_LATENT),
            train_data=work.dataloader,
            plugins=plugins,
            accelerator=accelerator,
        )
    else:
        loop = Loop(
            model=work.models["model"],
            optimizer=work.optimizers["model"],
            scheduler=work.schedulers["model"],
            train_data=work.dataloader,
            plugins=plugins,
            accelerator=accelerator,
            block=VARIANTS[variant].get("block", ()),
        )
    loop.fit(epochs=work.epochs)
    # the plugins that ran (first called first), for the table's note
    names = [n for n in reversed(loop.plugins.names()) if n != "bench-clock"]
    return {k: n.unwrapped for k, n in loop.networks.items()}, names
