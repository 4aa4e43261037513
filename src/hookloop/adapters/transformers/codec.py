"""The adapter's checkpointed state as plain data, and back: the
``TrainerState`` with the ``ExportableState`` callbacks' (and the
``TrainerControl``'s) state under ``stateful_callbacks``, as the Trainer
writes ``trainer_state.json``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from .values import number


def encode(tc, state, objects) -> dict:
    """``state`` (a ``TrainerState``) as plain data, with the state of the
    ``ExportableState`` ones of ``objects`` (the callbacks, then the
    control) under ``stateful_callbacks``."""
    data = dataclasses.asdict(state)
    data["stateful_callbacks"] = callback_states(tc, objects)
    return plain_data(data)


def decode(tc, saved: Mapping, objects):
    """The ``TrainerState`` that :func:`encode` gave ``saved`` for (fields
    this ``transformers`` does not know dropped, a best checkpoint that is
    gone forgotten); the ``ExportableState`` ones of ``objects`` get their
    saved state back, in place."""
    known = {f.name for f in dataclasses.fields(tc.TrainerState)}
    state = tc.TrainerState(**{k: v for k, v in saved.items() if k in known})
    if state.best_model_checkpoint is not None and not Path(state.best_model_checkpoint).is_dir():
        state.best_model_checkpoint = None
    seen: dict = {}
    for cb in objects:
        if not isinstance(cb, tc.ExportableState):
            continue
        name = type(cb).__name__
        entry = state.stateful_callbacks.get(name)
        if isinstance(entry, list):
            i = seen[name] = seen.get(name, -1) + 1
            entry = entry[i] if i < len(entry) else None
        if not isinstance(entry, Mapping):
            continue
        for key, value in (entry.get("args") or {}).items():
            if hasattr(cb, key):
                setattr(cb, key, value)
        for key, value in (entry.get("attributes") or {}).items():
            setattr(cb, key, value)
    return state


def callback_states(tc, objects) -> dict:
    """``TrainerState.stateful_callbacks``, as ``Trainer._save_checkpoint``
    fills it: by class name, a list for several of one class."""
    out: dict = {}
    for cb in objects:
        if not isinstance(cb, tc.ExportableState):
            continue
        name, state = type(cb).__name__, cb.state()
        if name in out:
            if not isinstance(out[name], list):
                out[name] = [out[name]]
            out[name].append(state)
        else:
            out[name] = state
    return out


def plain_data(obj):
    """Numbers as Python numbers (numpy scalars, 0-d tensors from callbacks)."""
    if isinstance(obj, Mapping):
        return {k: plain_data(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain_data(v) for v in obj)
    return number(obj)
