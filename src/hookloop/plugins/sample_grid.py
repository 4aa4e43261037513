"""A PNG grid of a generator's samples, from the same latent vectors every time."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..markers import hookimpl

if TYPE_CHECKING:  # names for the annotations only
    from PIL import Image

    from ..protocols import LoopLike


class SampleGrid:
    """Write ``epoch-000.png`` before training and ``epoch-NNN.png`` after
    every ``every``-th epoch: the generator's images for fixed latent vectors,
    so that grids of different epochs can be compared by eye.

    The latent vectors are drawn once, from ``torch.Generator().manual_seed(seed)``
    through the strategy's ``sample_latent`` (the GAN strategy's sampler), or
    given as ``latent``. The generator runs in eval mode, without gradients,
    unwrapped (no collective): only the main process draws and writes.

    :param directory: where the PNG files go (created).
    :param n: how many samples (default 64: an 8x8 grid).
    :param nrow: images per row (default ``ceil(sqrt(n))``).
    :param latent: fixed latent batch to use instead of drawing one.
    :param image_shape: reshape each sample to this, e.g. ``(8, 8)`` or
        ``(1, 28, 28)``; default: ``(C, H, W)`` / ``(H, W)`` samples as they
        are, flat square vectors as ``(side, side)``.
    :param value_range: the generator's output range, mapped to black..white.
    :param scale: each pixel becomes a ``scale`` x ``scale`` block.
    :param network: the name of the network that generates.
    :param to_trackers: also send each grid (unscaled) to the accelerator's
        trackers that take images (:meth:`Loop.log_images`: TensorBoard,
        W&B, ...), under the plugin's name (``samples``), at the update it
        was drawn at.

    ``paths`` lists the files written, in order. Needs Pillow
    (``pip install hookloop[demo]``).
    """

    name = "samples"
    changes_training = False  # renders from fixed latents, every random state put back

    def __init__(self, directory: str | os.PathLike[str] = "samples", n: int = 64,
                 nrow: int | None = None, latent: torch.Tensor | None = None, seed: int = 0,
                 image_shape: Sequence[int] | None = None,
                 value_range: tuple[float, float] = (-1.0, 1.0), scale: int = 4, every: int = 1,
                 network: str = "generator", to_trackers: bool = False) -> None:
        try:
            from PIL import Image
        except ImportError as exc:  # an optional dependency: say which
            raise ImportError("SampleGrid writes PNG files with Pillow: pip install pillow") from exc
        self._image = Image
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"SampleGrid: every must be a positive int, got {every!r}")
        self.directory = os.fspath(directory)
        self.n = n if latent is None else len(latent)
        self.nrow = nrow or math.ceil(math.sqrt(self.n))
        self.latent = latent
        self.seed = seed
        self.image_shape = tuple(image_shape) if image_shape is not None else None
        self.low, self.high = value_range
        self.scale = scale
        self.every = every
        self.network = network
        self.to_trackers = to_trackers
        self.paths: list[str] = []

    @hookimpl
    def on_fit_start(self, loop: LoopLike) -> None:
        if loop.state.epoch == 0 and loop.state.step_in_epoch == 0:
            self.write(loop, "epoch-000.png")

    @hookimpl
    def on_epoch_end(self, loop: LoopLike, epoch: int) -> None:
        if (epoch + 1) % self.every == 0:
            self.write(loop, f"epoch-{epoch + 1:03d}.png")

    def write(self, loop: LoopLike, filename: str) -> str | None:
        """Render the grid and save it as ``directory/filename`` (main
        process only; returns the path there, ``None`` elsewhere)."""
        if not loop.accelerator.is_main_process:
            return None
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, filename)
        grid = self.grid(loop)
        self._picture(grid).save(path)
        self.paths.append(path)
        if self.to_trackers:
            loop.log_images({loop.plugins.name_of(self) or self.name: grid})
        return path

    def samples(self, loop: LoopLike) -> torch.Tensor:
        """The generator's output for the fixed latent vectors, on the CPU."""
        network = loop.networks[self.network]
        model = network.unwrapped
        if self.latent is None:
            sample = getattr(loop.strategy, "sample_latent", None)
            if sample is None:
                raise ValueError(
                    f"SampleGrid: strategy {loop.strategy.name!r} has no sample_latent(): "
                    "pass latent=... (a fixed latent batch)"
                )
            self.latent = sample(self.n, torch.Generator().manual_seed(self.seed))
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                out: torch.Tensor = model(self.latent.to(device))
        finally:
            model.train(was_training)
        return out.detach().float().cpu()

    def render(self, loop: LoopLike) -> Image.Image:
        """The grid as a PIL image (grey or RGB), each pixel ``scale`` x ``scale``."""
        return self._picture(self.grid(loop))

    def grid(self, loop: LoopLike) -> torch.Tensor:
        """The grid as a ``(C, H, W)`` ``uint8`` tensor, one pixel per value."""
        x = self.samples(loop)
        if self.image_shape is not None:
            x = x.reshape(len(x), *self.image_shape)
        elif x.ndim == 2:
            side = math.isqrt(x.shape[1])
            if side * side != x.shape[1]:
                raise ValueError(
                    f"SampleGrid: samples have {x.shape[1]} values, not a square image: "
                    "pass image_shape=(C, H, W) or (H, W)"
                )
            x = x.reshape(len(x), side, side)
        if x.ndim == 3:  # (n, H, W): grey
            x = x.unsqueeze(1)
        x = ((x - self.low) / (self.high - self.low)).clamp(0, 1)
        n, c, h, w = x.shape
        if c not in (1, 3):
            raise ValueError(f"SampleGrid: images need 1 or 3 channels, got {c}")
        rows = math.ceil(n / self.nrow)
        pad = 1
        grid = torch.full((c, rows * (h + pad) + pad, self.nrow * (w + pad) + pad), 0.5)
        for i in range(n):
            r, col = divmod(i, self.nrow)
            top, left = pad + r * (h + pad), pad + col * (w + pad)
            grid[:, top:top + h, left:left + w] = x[i]
        return (grid * 255).round().to(torch.uint8)

    def _picture(self, grid: torch.Tensor) -> Image.Image:
        pixels = grid.permute(1, 2, 0).numpy()
        image = self._image.fromarray(np.ascontiguousarray(pixels.squeeze(-1) if grid.shape[0] == 1 else pixels))
        if self.scale != 1:
            size = (image.width * self.scale, image.height * self.scale)
            image = image.resize(size, self._image.Resampling.NEAREST)
        return image
