"""Two networks, one loop: a generator and a discriminator trained in turn.

::

    loop = Loop(
        networks={"generator": Network(G, opt_g), "discriminator": Network(D, opt_d)},
        strategy=GAN(latent_dim=64),
        train_data=DataLoader(TensorDataset(real_images), batch_size=64, shuffle=True),
        plugins=[GradClip(max_norm=1.0)],
    )
    loop.fit(epochs=20)

``train_data`` gives batches (a ``DataLoader``): a tensor or a dataset given
as it is would be iterated one sample at a time, so ``Loop(...)`` refuses it.

One batch, in order (the pattern that keeps several processes in step, see
ACCELERATE-NOTES "GAN with one Accelerator")::

    z ~ latent sampler (per process, per step)
    fake = G(z)                                    one generator forward
    discriminator step:  compute_loss(D) on D(real), D(fake.detach())
                         backward, after_backward(D), optimizer hooks (D)
    generator step:      compute_loss(G) on a fresh D(fake), D's parameters frozen
                         backward, after_backward(G), optimizer hooks (G)

What ``compute_loss`` receives (``batch`` is always the training batch as
the dataloader gave it):

discriminator, ``network.name == "discriminator"``, ``outputs`` is a dict:
    ``"real"``: ``D(real_samples)`` logits; ``"fake"``: ``D(fake_samples)``
    logits; ``"real_samples"``; ``"fake_samples"`` (detached from the
    generator); ``"latent"``: the latent batch. The discriminator itself is
    ``network.model`` (call it for a gradient penalty: its parameters take
    gradients here; the generator's never do).
generator, ``network.name == "generator"``, ``outputs`` is a dict:
    ``"fake"``: ``D(fake_samples)`` logits, computed after the
    discriminator's update; ``"fake_samples"`` (attached to the generator's
    graph); ``"real_samples"``; ``"latent"``. The discriminator is
    ``loop.networks["discriminator"].model``; while the generator's loss is
    computed and back-propagated its parameters are frozen and its gradient
    sync is off, so nothing reaches the discriminator's gradients.

``training_step`` returns ``StepOutput(outputs={"discriminator": ...,
"generator": ...}, loss={"discriminator": ..., "generator": ...})`` with the
dicts above; on batches where the generator does not train (``n_critic > 1``)
the ``"generator"`` entries are absent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
import torch.utils.data

from ..markers import hookimpl
from .base import StepOutput, Strategy, frozen, loss_and_backward, update

if TYPE_CHECKING:  # names for the annotations only
    from ..network import Network
    from ..protocols import LoopLike

#: ``latent_sampler(n, generator) -> z``: ``generator`` is None only when
#: :meth:`GAN.sample_latent` is called without one
LatentSampler = Callable[[int, "torch.Generator | None"], torch.Tensor]

#: mapping keys tried, in order, for the real sample of a dict batch
REAL_KEYS = ("pixel_values", "images", "image")

_MASK64 = (1 << 64) - 1


class GAN(Strategy):
    """The two-network strategy: ``networks`` must be exactly
    ``{"generator": ..., "discriminator": ...}``.

    :param latent_dim: size of a latent vector (an int), or the shape of one
        latent sample without the batch dimension (a tuple, e.g. ``(64, 1, 1)``
        for a convolutional generator).
    :param n_critic: discriminator updates per generator update. The
        discriminator trains on every batch; the generator on every
        ``n_critic``-th discriminator update (under gradient accumulation, on
        every batch of every ``n_critic``-th accumulation group).
        ``loop.state.global_step`` counts the discriminator's updates: one
        per batch (per accumulation group), whether or not the generator
        also trained on it, so ``fit(max_steps=N)`` means N discriminator
        updates and N / n_critic generator updates.
    :param latent_sampler: ``latent_sampler(n, generator) -> z``, the latent
        batch of ``n`` samples, passed as ``G(z)``. It must draw from
        ``generator`` (a ``torch.Generator`` on the training device), which
        the strategy seeds per process and per step: processes then draw
        different noise, and the same seed repeats the same run. Default:
        standard normal of shape ``(n, *latent_dim)``.
    :param real: where the real sample is in a batch: a mapping key, or a
        callable ``real(batch) -> tensor``. Default: a tensor batch is the
        sample; a ``(images, labels, ...)`` sequence gives its first element;
        a mapping gives the first of ``REAL_KEYS`` it has (``"pixel_values"``,
        ``"images"``, ``"image"``), else its first tensor value.
    :param seed: the base of the latent noise seeds; default
        ``torch.initial_seed()`` at the first fit (what ``set_seed`` /
        ``torch.manual_seed`` set), so seeding the run seeds the noise.

    Mixed precision: ``bf16`` works; ``fp16`` is refused when ``fit`` starts
    (Accelerate keeps one gradient scaler for the two optimizers). ``eval_data``
    needs a plugin implementing ``eval_step``: a GAN has no default metric.
    """

    name = "gan"
    network_names = ("generator", "discriminator")

    def __init__(self, latent_dim: int | Sequence[int], n_critic: int = 1,
                 latent_sampler: LatentSampler | None = None,
                 real: str | int | Callable[[Any], torch.Tensor] | None = None,
                 seed: int | None = None) -> None:
        shape: tuple[int, ...] = (latent_dim,) if isinstance(latent_dim, int) else tuple(latent_dim)
        if not shape or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
            raise ValueError(f"GAN: latent_dim must be a positive int or a shape, got {latent_dim!r}")
        if not isinstance(n_critic, int) or isinstance(n_critic, bool) or n_critic < 1:
            raise ValueError(f"GAN: n_critic must be a positive int, got {n_critic!r}")
        if latent_sampler is not None and not callable(latent_sampler):
            raise TypeError("GAN: latent_sampler must be a callable (n, generator) -> latent batch")
        if real is not None and not (callable(real) or isinstance(real, (str, int))):
            raise TypeError("GAN: real must be a mapping key or a callable batch -> tensor")
        self.latent_shape = shape
        self.n_critic = n_critic
        self.latent_sampler = latent_sampler
        self.real = real
        self.seed = seed
        #: discriminator updates done: decides which batches train the generator
        self.d_updates = 0
        self._noise: torch.Generator | None = None  # on the training device, reseeded each step

    # -- what the loop asks of a strategy ------------------------------------

    def default_plugins(self) -> list[Any]:
        return [GANLoss()]

    def check_networks(self, networks: Mapping[str, Network]) -> None:
        names = set(networks)
        missing = [n for n in self.network_names if n not in names]
        extra = sorted(names - set(self.network_names))
        if missing or extra:
            parts: list[str] = []
            if missing:
                parts.append(f"missing {', '.join(map(repr, missing))}")
            if extra:
                parts.append(f"unexpected {', '.join(map(repr, extra))}")
            raise ValueError(
                f"the GAN strategy trains two networks, 'generator' and 'discriminator': "
                f"{'; '.join(parts)} (got {sorted(names)}). Pass "
                "Loop(networks={'generator': Network(G, opt_g), "
                "'discriminator': Network(D, opt_d)}, strategy=GAN(...))"
            )

    # -- public helpers ------------------------------------------------------

    def sample_latent(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """A latent batch of ``n`` samples drawn from ``generator`` (a
        ``torch.Generator``; on its device), as the training step draws them.
        The sample-grid plugin uses this for its fixed latent vectors."""
        if self.latent_sampler is not None:
            return self.latent_sampler(n, generator)
        device = generator.device if generator is not None else None
        return torch.randn((n, *self.latent_shape), generator=generator, device=device)

    def real_samples(self, batch: Any) -> torch.Tensor:
        """The real sample of a training batch (see the ``real`` option)."""
        real = self.real
        if real is not None:
            x = real(batch) if callable(real) else batch[real]
        elif isinstance(batch, torch.Tensor):
            x = batch
        elif isinstance(batch, Mapping):
            key = next((k for k in REAL_KEYS if k in batch), None)
            if key is None:
                key = next((k for k, v in batch.items() if isinstance(v, torch.Tensor)), None)
            if key is None:
                raise TypeError(
                    f"the GAN strategy found no tensor in a batch with keys {list(batch)}: "
                    "pass GAN(real='key') or GAN(real=callable)"
                )
            x = batch[key]
        elif isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)) and len(batch) >= 1:
            x = batch[0]
        else:
            raise TypeError(
                f"the GAN strategy cannot find the real sample in a batch of type "
                f"{type(batch).__name__}: expected a tensor, an (images, labels) pair or "
                "a mapping; or pass GAN(real='key') or GAN(real=callable)"
            )
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"the real sample taken from the batch is a {type(x).__name__}, not a tensor")
        return x

    def state_dict(self) -> dict[str, Any]:
        """Plain data a checkpoint keeps: the noise seed and the count that
        decides which batches train the generator."""
        return {"seed": self.seed, "d_updates": self.d_updates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.seed = state["seed"]
        self.d_updates = state["d_updates"]

    # -- hooks -----------------------------------------------------------------

    @hookimpl(tryfirst=True)
    def on_loop_start(self, loop: LoopLike) -> None:
        check_batched(loop.train_data)  # at Loop(...), before anything is prepared

    @hookimpl(tryfirst=True)
    def on_fit_start(self, loop: LoopLike) -> None:
        check_batched(loop.train_data)  # also when loop.train_data was replaced since
        accelerator = loop.accelerator
        if accelerator.mixed_precision == "fp16":
            raise ValueError(
                "the GAN strategy does not support mixed_precision='fp16': Accelerate keeps "
                "one gradient scaler for both the generator's and the discriminator's "
                "optimizer. Use mixed_precision='bf16' (or 'no')."
            )
        self._noise_generator(loop)

    @hookimpl(trylast=True)
    def training_step(self, loop: LoopLike, batch: Any) -> StepOutput:
        G, D = loop.networks["generator"], loop.networks["discriminator"]
        accelerator = loop.accelerator
        real = self.real_samples(batch)
        train_g = (self.d_updates + 1) % self.n_critic == 0
        # per process and per batch: ranks draw different noise, a resumed run
        # (same micro_step) draws the same noise again
        noise = self._noise_generator(loop)
        assert self.seed is not None  # _noise_generator set it
        noise.manual_seed(_mix(self.seed, accelerator.process_index, loop.state.micro_step))
        z = self.sample_latent(real.shape[0], noise)
        outputs: dict[str, dict[str, torch.Tensor]] = {}
        losses: dict[str, torch.Tensor] = {}
        # entered once per batch: Accelerate counts one micro-step per entry
        with loop.accumulate(G.model, D.model):
            # one generator forward; its graph is kept only for the generator step
            with torch.set_grad_enabled(train_g):
                fake = G.model(z)

            fake_d = fake.detach()  # the discriminator step never reaches G
            d_out = {
                "real": D.model(real),
                "fake": D.model(fake_d),
                "real_samples": real,
                "fake_samples": fake_d,
                "latent": z,
            }
            losses["discriminator"] = loss_and_backward(loop, D, batch, d_out)
            outputs["discriminator"] = d_out
            update(loop, D)
            if accelerator.sync_gradients:
                self.d_updates += 1

            if train_g:
                # D is frozen and outside DDP's gradient sync while the
                # generator's loss flows through it: no D gradients that
                # could leak into D's next update (under accumulation D's
                # .grad is still being accumulated here), no all-reduce of
                # gradients D does not get
                with frozen(D.unwrapped), accelerator.no_sync(D.model):
                    g_out = {
                        "fake": D.model(fake),  # after D's update
                        "fake_samples": fake,
                        "real_samples": real,
                        "latent": z,
                    }
                    losses["generator"] = loss_and_backward(loop, G, batch, g_out)
                outputs["generator"] = g_out
                update(loop, G)
        return StepOutput(outputs, losses)

    def _noise_generator(self, loop: LoopLike) -> torch.Generator:
        if self.seed is None:
            self.seed = torch.initial_seed()
        if self._noise is None:
            self._noise = torch.Generator(device=loop.accelerator.device)
        return self._noise


class GANLoss:
    """The GAN strategy's default loss: non-saturating BCE with logits
    (Goodfellow et al., 2014).

    discriminator: ``BCE(D(real), 1) + BCE(D(fake), 0)``; generator:
    ``BCE(D(fake), 1)``. ``trylast`` and silent for any other network, so a
    user's ``compute_loss`` plugin (hinge, Wasserstein, a gradient penalty)
    replaces it for the network it answers for.
    """

    name = "loss"
    changes_training = True

    @hookimpl(trylast=True)
    def compute_loss(self, network: Network, outputs: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        if network.name == "discriminator":
            real, fake = outputs["real"], outputs["fake"]
            return F.binary_cross_entropy_with_logits(
                real, torch.ones_like(real)
            ) + F.binary_cross_entropy_with_logits(fake, torch.zeros_like(fake))
        if network.name == "generator":
            fake = outputs["fake"]
            return F.binary_cross_entropy_with_logits(fake, torch.ones_like(fake))
        return None


def check_batched(data: Any, what: str = "train_data") -> None:
    """Refuse data that iterates one sample at a time: a tensor (its rows) or
    a map-style ``torch.utils.data.Dataset`` (its examples). The GAN would
    train on each sample alone, without a batch dimension, and say nothing."""
    if isinstance(data, torch.Tensor):
        given, items = f"a tensor of shape {tuple(data.shape)}", "rows"
        fix = "DataLoader(TensorDataset(tensor), batch_size=..., shuffle=True)"
    elif isinstance(data, torch.utils.data.Dataset) and not isinstance(data, torch.utils.data.IterableDataset):
        try:
            given = f"a {type(data).__name__} of {len(data)} examples"  # type: ignore[arg-type]  # no __len__: the TypeError below
        except TypeError:
            given = f"a {type(data).__name__}"
        items = "examples"
        fix = "DataLoader(dataset, batch_size=..., shuffle=True)"
    else:
        return
    raise TypeError(
        f"{what} is {given}: the GAN strategy would iterate its {items} one by one, each "
        f"a step of its own without a batch dimension. Pass {fix} (torch.utils.data)"
    )


def _mix(*values: int) -> int:
    """A 63-bit seed from several ints (splitmix64 rounds): neighbouring
    steps and ranks get unrelated seeds."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h >> 1
