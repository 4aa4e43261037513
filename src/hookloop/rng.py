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
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict[str, Any]:
    """The global python, numpy, torch (and initialised CUDA) RNG states."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    # (torch leaves torch.cuda.is_initialized unannotated)
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put back the global states :func:`capture_rng` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def data_generators(data: Any) -> dict[str, torch.Generator]:
    """The ``torch.Generator`` objects a dataloader draws its shuffle and
    worker seeds from, by attribute path (each object once)."""
    found: dict[str, torch.Generator] = {}

    def add(path: str, gen: object) -> None:
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


def restore_generators(data: Any, states: Mapping[str, Any]) -> None:
    """Put back generator states (``{path: state}``, as :func:`capture_epoch`
    takes them) into ``data``'s generators of the same paths, and the states
    of its own samplers (``"sampler:<role>"`` entries, :func:`sampler_states`)."""
    current = data_generators(data)
    for path, state in states.items():
        if path in current:  # one created lazily later (seedable sampler) is reseeded anyway
            current[path].set_state(state)
    restore_sampler_states(data, states)


# -- samplers of the user's own: their random generators, their Stateful state --------------

#: where the samplers hookloop knows come from: torch's, Accelerate's (its
#: shards, its seedable sampler) and torchdata's (made for its
#: StatefulDataLoader, whose state holds their position): their order comes
#: from the generators :func:`data_generators` finds, or from ``set_epoch``
_KNOWN_SAMPLER_MODULES = ("torch.", "accelerate.", "torchdata.")
#: what a sampler's entry is called among the data's random states
SAMPLER_PREFIX = "sampler:"
#: indices compared when checking that a sampler's state is restorable
_CHECKED_INDICES = 4096


def own_samplers(data: Any) -> dict[str, Any]:
    """The (batch) samplers of ``data`` written by the user, not torch,
    Accelerate or torchdata, by role: ``"sampler"`` (the innermost one,
    which draws the indices), ``"batch_sampler"`` (one that groups them,
    ``"batch_sampler.1"`` ... further out). Accelerate's wrappers are not
    counted, so a role names the same sampler on any number of processes."""
    chain = []
    obj = data
    for _ in range(8):
        inner = next((v for v in (getattr(obj, "batch_sampler", None), getattr(obj, "sampler", None))
                      if v is not None), None)
        if inner is None or inner is obj:
            break
        chain.append(inner)
        obj = inner
    found: dict[str, Any] = {}
    for depth, sampler in enumerate(reversed(chain)):  # innermost first
        if type(sampler).__module__.startswith(_KNOWN_SAMPLER_MODULES):
            continue
        role = "sampler" if depth == 0 else "batch_sampler"
        while role in found:
            role = f"batch_sampler.{len(found)}"
        found[role] = sampler
    return found


def _rng_attributes(sampler: Any) -> dict[str, Any]:
    """The random generators among ``sampler``'s attributes, by name:
    ``torch.Generator``, numpy's ``Generator`` and ``RandomState``,
    ``random.Random``."""
    return {name: value for name, value in vars(sampler).items()
            if isinstance(value, (torch.Generator, np.random.Generator, np.random.RandomState,
                                  random.Random))} if hasattr(sampler, "__dict__") else {}


def _rng_state(gen: Any) -> Any:
    if isinstance(gen, torch.Generator):
        return gen.get_state()
    if isinstance(gen, np.random.Generator):
        return gen.bit_generator.state
    if isinstance(gen, np.random.RandomState):
        return gen.get_state(legacy=False)
    return gen.getstate()


def _set_rng_state(gen: Any, state: Any) -> None:
    if isinstance(gen, torch.Generator):
        gen.set_state(state)
    elif isinstance(gen, np.random.Generator):
        gen.bit_generator.state = state
    elif isinstance(gen, np.random.RandomState):
        gen.set_state(state)
    else:
        gen.setstate(state)


def _is_stateful(sampler: Any) -> bool:
    """torchdata's ``Stateful`` protocol: ``state_dict()`` and ``load_state_dict(state)``."""
    return callable(getattr(sampler, "state_dict", None)) and callable(getattr(sampler, "load_state_dict", None))


def _sampler_state(sampler: Any) -> dict[str, Any]:
    state: dict[str, Any] = {"rngs": {n: _rng_state(g) for n, g in _rng_attributes(sampler).items()}}
    if _is_stateful(sampler):
        state["state_dict"] = sampler.state_dict()
    return state


def _load_sampler_state(sampler: Any, state: Mapping[str, Any]) -> None:
    gens = _rng_attributes(sampler)
    for name, rng_state in state.get("rngs", {}).items():
        if name in gens:
            _set_rng_state(gens[name], rng_state)
    if "state_dict" in state and _is_stateful(sampler):
        sampler.load_state_dict(state["state_dict"])


def sampler_states(data: Any) -> dict[str, Any]:
    """What the user's own samplers of ``data`` (:func:`own_samplers`) keep,
    by ``"sampler:<role>"``: their random generators (attributes of any
    name) and, for torchdata's ``Stateful`` protocol, ``state_dict()``.
    Taken when an epoch's iterator is about to start and at a save;
    :func:`restore_generators` puts them back."""
    return {SAMPLER_PREFIX + role: _sampler_state(s) for role, s in own_samplers(data).items()}


def restore_sampler_states(data: Any, states: Mapping[str, Any]) -> None:
    """Put back what :func:`sampler_states` took: the generators first,
    then ``load_state_dict``."""
    samplers = own_samplers(data)
    for key, state in states.items():
        if key.startswith(SAMPLER_PREFIX) and key[len(SAMPLER_PREFIX):] in samplers:
            _load_sampler_state(samplers[key[len(SAMPLER_PREFIX):]], state)


def unrestorable_samplers(data: Any) -> dict[str, str]:
    """The user's own samplers of ``data`` whose order hookloop cannot
    restore, with why. On a copy of each, brought to the end of a pass (where
    an epoch's state is taken): a pass drawn, what :func:`sampler_states`
    takes put back, a pass drawn again; if the two differ, it keeps state
    hookloop does not see (a counter, a generator inside another object ...).
    One that cannot be copied cannot be checked. The global random states
    are as before; the sampler itself is not touched."""
    import copy

    out: dict[str, str] = {}
    dataset = getattr(data, "dataset", None)
    for role, sampler in own_samplers(data).items():
        name = f"{type(sampler).__qualname__} ({role})"
        try:  # (the dataset it may hold is shared, not copied)
            twin = copy.deepcopy(sampler, {id(dataset): dataset} if dataset is not None else None)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            out[name] = f"it cannot be copied to be checked ({type(exc).__name__}: {exc})"
            continue
        with keep_rng():
            try:  # to the end of its pass: where an epoch's state is taken
                length = len(twin)
            except TypeError:
                length = _CHECKED_INDICES
            for _ in itertools.islice(iter(twin), length):
                pass
            saved, before = _sampler_state(twin), capture_rng()
            first = _indices(twin)
            restore_rng(before)
            _load_sampler_state(twin, saved)
            again = _indices(twin)
        if first != again:
            out[name] = ("a pass started from what hookloop saves of it (its random generators"
                         + (" and state_dict()" if _is_stateful(twin) else "")
                         + ") draws other indices than the pass before: it keeps state hookloop "
                         "does not see")
    return out


def _indices(sampler: Any) -> list[Any]:
    def plain(x: Any) -> Any:
        return x.tolist() if hasattr(x, "tolist") else (list(map(plain, x)) if isinstance(x, (list, tuple)) else x)

    return [plain(i) for i in itertools.islice(iter(sampler), _CHECKED_INDICES)]


@contextlib.contextmanager
def keep_rng(*loaders: Any) -> Iterator[None]:
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


def capture_epoch(data: Any) -> dict[str, Any]:
    """What an epoch's iterator starts from: the global RNG, the data
    generators and the states of the user's own samplers
    (:func:`sampler_states`), taken just before the iterator is created."""
    return {
        "rng": capture_rng(),
        "generators": {**{p: g.get_state() for p, g in data_generators(data).items()},
                       **sampler_states(data)},
    }


@dataclass
class Resume:
    """How to continue a run: the RNG states to put back, and when.

    ``epoch_start`` is what the interrupted epoch's iterator started from
    (None: unknown); ``rng`` is the global RNG when the run stopped;
    ``generators`` the data generators then (from a checkpoint only).

    An ``epoch_start`` with a ``"shuffle"`` entry (one continued on another
    number of processes, or with another loader: :func:`translate_epoch`)
    draws its permutation from that generator state, whatever generator the
    loader's sampler has now (:func:`shuffling_from`)."""

    epoch_start: dict[str, Any] | None
    rng: dict[str, Any]
    generators: dict[str, torch.Tensor] | None = None
    path: Path | None = None
    #: the manifest of the checkpoint it continues, as read (None: a script's folder)
    manifest: dict[str, Any] | None = None

    def restore_now(self, data: Any) -> None:
        """Put the RNG where the run stopped (at an epoch boundary)."""
        restore_rng(self.rng)
        if self.generators:
            restore_generators(data, self.generators)

    def batches(self, accelerator: Any, data: Any, skip: int | None,
                none_if_empty: bool = False) -> Iterable[Any] | None:
        """The rest of the interrupted epoch: the same batches in the same
        order, without loading the ``skip`` seen ones, and the RNG where
        the run stopped when the first of them comes out. ``none_if_empty``:
        None instead of an exhausted iterator when nothing is left (the
        first batch is drawn here to know). ``skip=None``: the loader knows
        where it is itself (a stateful loader whose state was restored), so
        it is only iterated, from the epoch's random states as the others
        (a stream without a state of its own is fast-forwarded by the
        loader, and must draw the same order)."""
        batches: Iterable[Any] = data if skip is None else _skip(accelerator, data, skip)
        if self.epoch_start is None:
            self.restore_now(data)
            if not none_if_empty:
                return batches
            return first_or_none(batches, none_if_empty)
        # redraw the epoch's shuffle: start the iterator from the epoch's RNG
        restore_rng(self.epoch_start["rng"])
        restore_generators(data, self.epoch_start["generators"])
        with shuffling_from(data, self.epoch_start.get("shuffle"), batches):
            rest = first_or_none(batches, none_if_empty)
        restore_rng(self.rng)
        return rest


# -- which generator draws an epoch's order: the same order on another loader -------


def innermost_sampler(data: Any) -> Any:
    """The sampler under a (prepared) loader's batch samplers (Accelerate's
    ``BatchSamplerShard``, a ``BatchSampler``, a ``SkipBatchSampler``).
    Never truth-tests a sampler: a stream's has no length."""
    obj = data
    for _ in range(8):
        inner = next((v for v in (getattr(obj, "batch_sampler", None), getattr(obj, "sampler", None))
                      if v is not None), None)
        if inner is None:
            break
        obj = inner
    return None if obj is data else obj


def _draws_its_own_shuffle(sampler: Any) -> bool:
    """A sampler that shuffles with ``self.generator`` (``RandomSampler``),
    and not one that reseeds it every epoch (Accelerate's seedable sampler,
    whose order is a function of its seed and epoch, on any loader)."""
    from accelerate.data_loader import SeedableRandomSampler

    return hasattr(sampler, "generator") and not isinstance(sampler, SeedableRandomSampler)


def generator_roles(data: Any) -> dict[str, str | None]:
    """Which of ``data``'s generators (:func:`data_generators` paths) draws
    what, as a checkpoint records it (run settings ``sampler_generator``,
    ``loader_generator``): ``"sampler"``, the generator the epoch's
    permutation is drawn with (``"global"``: the sampler has none and draws
    a seed from the global torch RNG, as ``RandomSampler`` does; None: the
    sampler does not shuffle with a generator of its own, or reseeds it
    itself); ``"loader"``, the loader's own generator, from which an
    iterator draws its base seed when it starts (``"global"``: none)."""
    if data is None:
        return {"sampler": None, "loader": None}
    found = data_generators(data)

    def path_of(gen: object) -> str | None:
        return next((p for p, g in found.items() if g is gen), None)

    sampler = innermost_sampler(data)
    role: str | None
    if sampler is None or not _draws_its_own_shuffle(sampler):
        role = None
    else:
        role = "global" if sampler.generator is None else path_of(sampler.generator)
    own = getattr(data, "generator", None)
    return {"sampler": role, "loader": "global" if own is None else path_of(own)}


def shuffle_state(epoch_start: Mapping[str, Any],
                  roles: Mapping[str, str | None]) -> torch.Tensor | None:
    """The state of the generator an epoch's permutation was drawn with,
    just before it was drawn, from what the epoch's iterator started from
    (``epoch_start``) and the roles of the generators of the loader that
    drew it (:func:`generator_roles`); None if unknown. Mirrors torch's
    ``DataLoader``: an iterator first draws its base seed (from the
    loader's generator, else the global RNG), then ``RandomSampler`` draws
    from its generator, or, without one, seeds a new one from the global
    RNG."""
    if epoch_start.get("shuffle") is not None:
        shuffle: torch.Tensor = epoch_start["shuffle"]
        return shuffle
    sampler, loader = roles.get("sampler"), roles.get("loader")
    if sampler is None:
        return None
    if sampler == "global":
        with keep_rng():
            restore_rng(epoch_start["rng"])
            if loader == "global":
                torch.empty((), dtype=torch.int64).random_()  # the iterator's base seed
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
        return torch.Generator().manual_seed(seed).get_state()
    state: torch.Tensor | None = epoch_start["generators"].get(sampler)
    if state is None:
        return None
    if loader == sampler:  # the base seed came first, from the same generator
        gen = torch.Generator()
        gen.set_state(state)
        torch.empty((), dtype=torch.int64).random_(generator=gen)
        state = gen.get_state()
    return state


def translate_generators(states: Mapping[str, Any], roles: Mapping[str, str | None],
                         data: Any) -> dict[str, Any]:
    """Generator states (``{path: state}``) saved from a loader whose
    generators had ``roles``, under the paths of ``data``'s generators of
    the same roles (the loader's own, the sampler's): another number of
    processes names them differently (Accelerate's ``synchronized_generator``
    is the sampler's). States without a counterpart are dropped; those of
    the user's own samplers (named by role already) are kept."""
    now = generator_roles(data)
    out: dict[str, Any] = {k: v for k, v in states.items() if k.startswith(SAMPLER_PREFIX)}
    for role in ("loader", "sampler"):
        saved, here = roles.get(role), now.get(role)
        if (saved is not None and saved != "global" and here is not None and here != "global"
                and saved in states):
            out[here] = states[saved]
    return out


def translate_epoch(epoch_start: Mapping[str, Any] | None, roles: Mapping[str, str | None],
                    data: Any) -> dict[str, Any] | None:
    """An epoch start saved from a loader whose generators had ``roles``
    (another number of processes, another batch size), for ``data``: the
    epoch's global RNG, the loader's own generator (under its path here),
    and ``"shuffle"``, the generator state its permutation is drawn with
    (:func:`shuffle_state`), which :meth:`Resume.batches` gives the sampler
    for that one draw, so that ``data`` draws the same permutation."""
    if epoch_start is None:
        return None
    out: dict[str, Any] = {"rng": epoch_start["rng"], "generators": {}}
    loader = translate_generators(epoch_start["generators"], {"loader": roles.get("loader")}, data)
    sampler_here = generator_roles(data).get("sampler")
    out["generators"] = {p: s for p, s in loader.items() if p != sampler_here}
    shuffle = shuffle_state(epoch_start, roles)
    if shuffle is not None:
        out["shuffle"] = shuffle
    return out


@contextlib.contextmanager
def shuffling_from(data: Any, state: torch.Tensor | None, iterated: Any = None) -> Iterator[None]:
    """While the body draws the first batch of ``iterated`` (``data``, or a
    loader made from it that skips the first batches), ``data``'s sampler
    draws its permutation from a generator in ``state`` (a
    ``torch.Generator`` state; None: as it is).

    A sampler with a generator of its own gets ``state`` into that one,
    which goes on from there for the rest of the run (the permutations of
    later epochs follow, as in the run that saved it); the loader's
    iterator then draws its base seed (the workers' seeds) from a copy of
    it, so that the permutation is drawn from ``state`` itself. A sampler
    without one (one process, the default ``RandomSampler``) is given a
    generator in ``state`` for this epoch only; later epochs draw their
    seed from the global RNG, as it does."""
    sampler = innermost_sampler(data) if state is not None else None
    if state is None or sampler is None or not _draws_its_own_shuffle(sampler):
        yield
        return
    own = sampler.generator
    if own is None:
        drawing = torch.Generator()
        drawing.set_state(state)
        sampler.generator = drawing  # read once, when the sampler's iterator starts
        try:
            yield
        finally:
            sampler.generator = None
        return
    loaders: dict[int, Any] = {}
    for loader in (data, iterated):
        base = getattr(loader, "base_dataloader", loader)  # Accelerate's DataLoaderAdapter wraps one
        if loader is not None and getattr(base, "generator", None) is own:
            loaders[id(base)] = base
    spare = torch.Generator()
    spare.set_state(own.get_state())
    for base in loaders.values():
        base.generator = spare  # the base seed, drawn when the iterator starts
    own.set_state(state)
    try:
        yield
    finally:
        for base in loaders.values():
            base.generator = own


_END = object()


def rest_of_epoch(accelerator: Any, state: Any, data: Any, resume: Resume | None) -> Any:
    """The batches of the current epoch after ``state.step_in_epoch``, in the
    order the epoch drew, or None if none is left of an epoch whose end
    already ran (``state.epoch_ended``). A stateful loader
    (``use_stateful_dataloader``) continues from its own state (restored from
    a checkpoint, or where this process left it); any other is started from
    the random state the epoch started from and its seen batches are skipped
    (a stream is read again up to there); then the random state is put back
    where the run stopped. ``resume``: what a checkpoint restored (None: a
    second ``fit`` in this process)."""
    stateful = getattr(data, "use_stateful_dataloader", False)
    if resume is None:
        resume = Resume(epoch_start=state.epoch_start, rng=capture_rng())
        if stateful:
            data.load_state_dict(data.state_dict())  # where its last iteration was left
    state.epoch_start = resume.epoch_start
    skip = None if stateful else state.step_in_epoch
    return resume.batches(accelerator, data, skip, none_if_empty=state.epoch_ended)


def first_or_none(batches: Iterable[Any], none_if_empty: bool = True) -> Iterator[Any] | None:
    """``batches`` with its first item drawn (to know whether there is one):
    None if empty and ``none_if_empty``."""
    it = iter(batches)
    first = next(it, _END)
    if first is _END:
        return None if none_if_empty else it
    return itertools.chain([first], it)


def _skip(accelerator: Any, data: Any, skip: int) -> Iterable[Any]:
    """``accelerator.skip_first_batches``, which needs a batch sampler, as
    accelerate 1.15 does it on every release hookloop supports (see
    :func:`hookloop.accelerate_fastpath.skip_first_batches`); a map-style
    loader without one (``batch_size=None``) has its first ``skip`` batches
    drawn and dropped instead."""
    from torch.utils.data import IterableDataset

    from .accelerate_fastpath import skip_first_batches

    if getattr(data, "batch_sampler", None) is None and not isinstance(
        getattr(data, "dataset", None), IterableDataset
    ):
        return itertools.islice(iter(data), skip, None)
    skipped: Iterable[Any] = skip_first_batches(accelerator, data, skip)
    return skipped


__all__ = ["Resume", "capture_epoch", "capture_rng", "data_generators", "generator_roles",
           "keep_rng", "restore_generators", "restore_rng", "shuffle_state", "shuffling_from",
           "translate_epoch", "translate_generators"]
