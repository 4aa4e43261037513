"""Random states: capture and restore them, keep them across a side trip
(evaluation, the sanity check), and replay an interrupted epoch.

Nothing here knows checkpoints: :mod:`hookloop.checkpointing` stores what
:func:`capture_epoch` returns and hands it back to a :class:`Resume`; the
loop uses :func:`keep_rng` and :class:`Resume` directly.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


def capture_rng() -> dict:
    """The global python, numpy, torch (and initialised CUDA) RNG states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """Put back the global states :func:`capture_rng` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def data_generators(data) -> dict:
    """The ``torch.Generator`` objects a dataloader draws its shuffle and
    worker seeds from, by attribute path (each object once)."""
    found: dict = {}

    def add(path, gen):
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found.values()):
            found[path] = gen

    add("synchronized_generator", getattr(data, "synchronized_generator", None))
    add("generator", getattr(data, "generator", None))
    for path in ("sampler", "batch_sampler", "batch_sampler.sampler",
                 "batch_sampler.batch_sampler", "batch_sampler.batch_sampler.sampler", "dataset"):
        obj = data
        for part in path.split("."):
            obj = getattr(obj, part, None)
        add(path + ".generator", getattr(obj, "generator", None))
    return found


def restore_generators(data, states: dict) -> None:
    """Put back generator states (``{path: state}``, as :func:`capture_epoch`
    takes them) into ``data``'s generators of the same paths."""
    current = data_generators(data)
    for path, state in states.items():
        if path in current:  # one created lazily later (seedable sampler) is reseeded anyway
            current[path].set_state(state)


@contextlib.contextmanager
def keep_rng(*loaders):
    """Run the body, then put the global python, numpy, torch (and CUDA)
    random states back as they were, and the generators of the data
    ``loaders`` given (None ones are skipped), however the body ends."""
    rng = capture_rng()
    generators = [(data, {p: g.get_state() for p, g in data_generators(data).items()})
                  for data in loaders if data is not None]
    try:
        yield
    finally:
        restore_rng(rng)
        for data, states in generators:
            restore_generators(data, states)


def capture_epoch(data) -> dict:
    """What an epoch's iterator starts from: the global RNG and the data
    generators, taken just before the iterator is created."""
    return {
        "rng": capture_rng(),
        "generators": {p: g.get_state() for p, g in data_generators(data).items()},
    }


@dataclass
class Resume:
    """How to continue a run: the RNG states to put back, and when.

    ``epoch_start`` is what the interrupted epoch's iterator started from
    (None: unknown); ``rng`` is the global RNG when the run stopped;
    ``generators`` the data generators then (from a checkpoint only)."""

    epoch_start: dict | None
    rng: dict
    generators: dict | None = None
    path: Path | None = None

    def restore_now(self, data) -> None:
        """Put the RNG where the run stopped (at an epoch boundary)."""
        restore_rng(self.rng)
        if self.generators:
            restore_generators(data, self.generators)

    def batches(self, accelerator, data, skip: int | None, none_if_empty: bool = False):
        """The rest of the interrupted epoch: the same batches in the same
        order, without loading the ``skip`` seen ones, and the RNG where
        the run stopped when the first of them comes out. ``none_if_empty``:
        None instead of an exhausted iterator when nothing is left (the
        first batch is drawn here to know). ``skip=None``: the loader knows
        where it is itself (a stateful loader whose state was restored), so
        it is only iterated, from the epoch's random states as the others
        (a stream without a state of its own is fast-forwarded by the
        loader, and must draw the same order)."""
        batches = data if skip is None else _skip(accelerator, data, skip)
        if self.epoch_start is None:
            self.restore_now(data)
            if not none_if_empty:
                return batches
            return first_or_none(batches, none_if_empty)
        # redraw the epoch's shuffle: start the iterator from the epoch's RNG
        restore_rng(self.epoch_start["rng"])
        restore_generators(data, self.epoch_start["generators"])
        batches = first_or_none(batches, none_if_empty)
        restore_rng(self.rng)
        return batches


_END = object()


def first_or_none(batches, none_if_empty: bool = True):
    """``batches`` with its first item drawn (to know whether there is one):
    None if empty and ``none_if_empty``."""
    it = iter(batches)
    first = next(it, _END)
    if first is _END:
        return None if none_if_empty else it
    return itertools.chain([first], it)


def _skip(accelerator, data, skip):
    """``accelerator.skip_first_batches``, which needs a batch sampler; a
    map-style loader without one (``batch_size=None``) has its first
    ``skip`` batches drawn and dropped instead."""
    from torch.utils.data import IterableDataset

    if getattr(data, "batch_sampler", None) is None and not isinstance(
        getattr(data, "dataset", None), IterableDataset
    ):
        return itertools.islice(iter(data), skip, None)
    return accelerator.skip_first_batches(data, skip)


__all__ = ["Resume", "capture_epoch", "capture_rng", "data_generators", "keep_rng",
           "restore_generators", "restore_rng"]
