"""Finding and loading a checkpoint: which one ``resume_from`` names
(:func:`find`, :func:`resolve`), and :func:`load`, all or nothing: checked
against the loop, staged and verified (:mod:`.staging`), optimizer states
checked to fit, and only then committed.
"""

from __future__ import annotations

from typing import Any
import os
import warnings
from pathlib import Path

import torch

from ..rng import Resume, capture_rng
from . import accelerate as accel
from . import elastic, formats
from .codec import stateful_plugins
from .collective import every_rank
from .compat import check_resume
from .errors import CheckpointError, first_line
from .layout import LATEST, STATE_FILE, NotACheckpointName, list_checkpoints, read_latest
from .lock import refuse_live_run
from .manifest import read_manifest
from .policy import checkpoint_plugins
from .runs import adopt_run
from .staging import Staged, stage

#: torch optimizer state entries that have their parameter's shape
_PER_PARAMETER = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                  "grad_avg", "acc_delta", "exp_inf", "prev", "sum", "ax", "mu_product_buffer"}
#: param-group entries newer torch versions added (absent from older checkpoints: fine)
_OPTIONAL_GROUP_KEYS = {"params", "foreach", "maximize", "capturable", "differentiable", "fused",
                        "decoupled_weight_decay", "initial_lr", "param_names"}


def resolve(resume_from, root) -> Path | None:
    """The checkpoint directory ``resume_from`` names.

    ``"latest"``: the checkpoint ``root/latest`` names; if it cannot be
    loaded (missing, truncated, a checksum mismatch, a file that does not
    deserialise, non-finite values), the newest loadable one in ``root``,
    with a warning naming the file that failed; ``None`` if nothing was ever
    saved there (a first run). A checkpoint root given as a path resolves the
    same way, except that finding nothing is an error. Any other path is
    returned as it is (:func:`load` checks it, and raises naming the file).

    Finding the newest *loadable* checkpoint reads it: every file is read
    once, its checksum verified and its content deserialised into memory
    (:func:`find` also returns what it read, for :func:`load`). With
    several processes every one calls this, and they agree: the main
    process's view of the root (or path) decides which checkpoint it is,
    every rank stages that one from its own view, and they skip the same
    checkpoints (one that fails on any process is skipped by all). A
    checkpoint the main process sees and another rank does not (a root that
    is not on a shared file system), or checkpoints another rank sees where
    the main sees none, is a :class:`CheckpointError` on every rank naming
    the ranks and the path: never some ranks resuming while others start
    from scratch.
    """
    return _find(resume_from, root)[0]


def find(resume_from, root) -> tuple[Path | None, Staged | None]:
    """:func:`resolve`, and what was staged while finding the checkpoint
    (None when ``resume_from`` is a checkpoint's path, returned unread): pass
    it to ``load(..., staged=...)`` so that the checkpoint is not read twice."""
    return _find(resume_from, root)


#: what every rank must be told when some cannot see the checkpoint
_SHARED = ("A checkpoint folder must be visible to every process: a shared file system, or copy "
           "it to each machine")


def _find(resume_from, root, stacklevel: int = 4):
    # (warnings name the caller of the caller of resolve() or find())
    refuse_live_run(resume_from, root)  # a live run's root: refused before anything is read
    lenient = resume_from == "latest"
    # every rank's view of what resume_from names, exchanged once: the main
    # process's view decides, and every rank checks it sees the same
    views, error = _views(resume_from, root, lenient)
    rank = accel.process_index()
    if error is not None:
        raise error  # this rank's own (read_latest of a root it sees)
    failed = next((v["error"] for v in views if v["error"]), None)
    if failed:
        raise CheckpointError(failed)
    mine, main = views[rank], views[0]
    if main["kind"] == "path":
        _agree_on_path(views, resume_from)
        return Path(mine["path"]), None
    root = Path(mine["root"])
    if mine["warning"]:  # a .tmp- or .trash- folder ...: the newest usable instead
        warnings.warn(f"hookloop: {mine['warning']}; resuming from the newest usable checkpoint "
                      "instead", RuntimeWarning, stacklevel=stacklevel)
    name, candidates = main["latest"], main["names"]
    order = [name] if name is not None else []
    order += [c for c in reversed(candidates) if c != name]
    if not order:
        _agree_on_nothing(views, resume_from)
    problems: list[str] = []
    for candidate in order:
        blind = [r for r, v in enumerate(views) if candidate in candidates and candidate not in v["names"]]
        if blind:
            raise CheckpointError(_blind_message(views, blind, candidate, resume_from))
        staged = None
        with every_rank(raise_error=False) as outcome:  # every process skips the same checkpoints
            staged = stage(root / candidate)
        error = outcome.error
        if error is None:
            if len(problems) > 1 or (problems and name is None):
                warnings.warn(
                    f"hookloop: resuming from {root / candidate}; newer checkpoints are not usable: "
                    + "; ".join(problems[1 if name is not None else 0:]),
                    RuntimeWarning,
                    stacklevel=stacklevel,
                )
            return root / candidate, staged
        if name is not None and not problems and len(order) > 1:
            warnings.warn(
                f"hookloop: {root / LATEST} names {name!r}, which is not usable ({error}); "
                "resuming from the newest usable checkpoint instead",
                RuntimeWarning,
                stacklevel=stacklevel,
            )
        problems.append(error)
    if lenient and name is None and not candidates:
        return None, None
    raise CheckpointError(
        f"resume_from={str(resume_from)!r}: no usable checkpoint in {root} "
        f"(found {', '.join(candidates) or 'none'})"
        + "".join(f"; {p}" for p in problems)
    )


def _views(resume_from, root, lenient: bool) -> tuple[list[dict], CheckpointError | None]:
    """Every rank's view of ``resume_from`` (one ``gather_object``; none with
    one process), and this rank's own error reading it, if any. A view:
    ``kind`` (``"root"``: a checkpoint root, ``"path"``: anything else),
    ``path`` (with its ``exists`` and ``manifest``), ``root``, the name
    ``latest`` holds, the checkpoint ``names`` in the root, a ``warning``
    (``latest`` names no checkpoint) and an ``error`` message."""
    view: dict[str, Any] = {"kind": "root", "path": None, "exists": False, "manifest": False, "root": None,
            "latest": None, "names": [], "warning": None, "error": None}
    error = None
    if lenient:
        root = Path(root)
    else:
        path = Path(os.fspath(resume_from)).expanduser()
        view.update(path=str(path), exists=path.exists(), manifest=(path / STATE_FILE).exists())
        looks_like_root = (
            path.is_dir() and not view["manifest"]
            and ((path / LATEST).exists() or list_checkpoints(path))
        )
        if not looks_like_root:
            view["kind"] = "path"
        root = path
    view["root"] = str(root)
    if view["kind"] == "root":
        try:
            view["latest"] = read_latest(root)
        except NotACheckpointName as exc:
            view["warning"] = str(exc)
        except CheckpointError as exc:
            error, view["error"] = exc, str(exc)
        view["names"] = [c.name for c in list_checkpoints(root)]
    if accel.process_count() == 1:
        return [view], error
    from accelerate.utils import gather_object

    return gather_object([view]), error


def _where(view) -> str:
    return repr(view["root"])


def _agree_on_path(views: list[dict], resume_from) -> None:
    """``resume_from`` names a checkpoint (by the main process's view): every
    rank must see it as the main does (the folder, its manifest), so that
    :func:`load` fails or succeeds on all of them alike."""
    seen = [(v["exists"], v["manifest"]) for v in views]
    if len(set(seen)) == 1:
        return
    best = max(seen)
    blind = [r for r, s in enumerate(seen) if s != best]
    what = "it" if best[1] else "its folder"
    raise CheckpointError(
        f"resume_from={str(resume_from)!r}: {_ranks(blind)} cannot see {what}"
        + "".join(f" (rank {r} looks for {views[r]['path']!r})" for r in blind
                  if views[r]["path"] != views[0]["path"])
        + f", which {_ranks([r for r in range(len(views)) if r not in blind])} see"
        + f"{'s' if len(views) - len(blind) == 1 else ''}. {_SHARED}. Nothing was loaded"
    )


def _agree_on_nothing(views: list[dict], resume_from) -> None:
    """The main process sees no checkpoint in its root: a fresh start only
    if no rank sees one in its own."""
    seeing = [r for r, v in enumerate(views) if v["names"] or v["latest"]]
    if not seeing:
        return
    raise CheckpointError(
        f"resume_from={str(resume_from)!r}: rank 0 sees no checkpoint in {_where(views[0])}, but "
        + "; ".join(f"rank {r} sees {', '.join(views[r]['names'][-3:]) or views[r]['latest']} in "
                    f"{_where(views[r])}" for r in seeing)
        + f": the processes would not start alike (some from scratch, some resumed). {_SHARED}. "
        "Nothing was loaded"
    )


def _blind_message(views: list[dict], blind: list[int], name: str, resume_from) -> str:
    path = Path(views[0]["root"]) / name
    elsewhere = "".join(f"; rank {r} looks in {_where(views[r])}" for r in blind
                        if views[r]["root"] != views[0]["root"])
    return (f"resume_from={str(resume_from)!r}: {_ranks(blind)} cannot see checkpoint "
            f"{str(path)!r}, which rank 0 resumes from ({len(views)} processes{elsewhere}). "
            f"{_SHARED}. Nothing was loaded")


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def load(loop, path, *, strict: bool = True, trust_pickles=None, staged: Staged | None = None) -> Resume:
    """Restore ``loop`` from the checkpoint at ``path`` (every process).

    All or nothing: first the manifest is checked against the loop (the
    networks, tensor shapes, optimizer and scheduler classes, the run
    settings that decide the data order and step count, stateful
    plugins), then every file is read into memory and verified
    (:func:`stage`: sizes, checksums, deserialisation with
    ``weights_only=True``, random states, finiteness), and optimizer states
    are checked to fit their optimizers; only then are models, optimizers,
    schedulers, random states, the loop position and plugin states
    replaced. Every failure is a :class:`CheckpointError` naming the file
    (or setting, or plugin), with the loop untouched. ``strict=False``:
    plugin and run-setting mismatches only warn.

    Plugins restore after the networks (``load_state_dict``); a plugin with
    a ``load_state_dict_early(state, loop)`` method also gets its state
    before any network, optimizer or scheduler state is loaded, e.g. to add
    back the param group it added during training (if the optimizer state
    still does not fit, the param groups it added are taken out again and
    the error names the network and the checkpoint).

    Another number of processes, batch size or accumulation: :mod:`.elastic`.

    :param trust_pickles: names of ``custom_checkpoint_<i>.pkl`` files
        (objects given to ``accelerator.register_for_checkpointing``) that
        may be unpickled although they are not plain data; default: the
        ``trust_pickles`` of the loop's ``Checkpoint`` plugins. Unpickling
        runs whatever code the file names: trust only files you wrote.
    :param staged: what :func:`find` staged for ``path`` (not read again);
        None: read it here.
    """
    acc = loop.accelerator
    path = Path(path)
    if staged is not None and (staged.process_index != acc.process_index
                               or os.path.realpath(staged.path) != os.path.realpath(path)):
        staged = None  # staged for another process or another checkpoint: read again
    doc = read_manifest(path)
    where = f"checkpoint {str(path)!r}"
    messages, plan = check_resume(loop, path, doc, strict)
    try:  # on a scratch state: fails before any change
        scratch = type(loop.state)()
        scratch.load_state_dict(doc["loop"])
        scratch.load_run_dict(doc.get("run") or {})
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{where}: the run state in {STATE_FILE} is not valid: "
                              f"{type(exc).__name__}: {exc}") from exc
    if trust_pickles is None:
        trust_pickles = {name for plugin in checkpoint_plugins(loop)
                         for name in getattr(plugin, "trust_pickles", ())}
    trusted = set(trust_pickles)
    custom = []
    with every_rank(acc):  # every process fails together, none waits
        if staged is None:
            staged = stage(path, doc, acc.process_index)
        custom = _custom_states(staged, trusted, where)
        _check_optimizers(loop, staged, where, groups=False)
        parts = elastic.rank_parts(path, doc, staged, plan, where) if plan.elastic else None

    # plugins that must act before the optimizer state (add a param group)
    optimizers = [getattr(o, "optimizer", o) for o in accel.optimizers(acc)]
    before = [list(o.param_groups) for o in optimizers]
    with every_rank(acc):
        try:
            _restore_early(loop, staged, where)
            _check_optimizers(loop, staged, where, groups=True)
        except CheckpointError:
            for optimizer, groups in zip(optimizers, before):
                optimizer.param_groups[:] = groups  # undo added param groups
            raise

    elastic.scale_schedulers(loop, staged, plan)
    formats.commit(loop, staged, custom, where)  # (a rank the checkpoint lacks: derived random states)
    rng = capture_rng()
    state = loop.state  # the run state, whole: position, run, this process's epoch
    state.load_state_dict(doc["loop"])
    state.load_run_dict(doc.get("run") or {})
    epoch_start, generators, logged = elastic.continue_epoch(loop, staged, plan, parts, messages)
    state.epoch_start = epoch_start
    state.logged.load_state_dict(logged)
    adopt_run(loop, path, doc)
    current = dict(stateful_plugins(loop))
    for name, state in staged.plugin_states.items():
        if name not in current:
            continue
        try:
            current[name].load_state_dict(state)
        except Exception as exc:
            raise CheckpointError(
                f"{where}: plugin {name!r} could not load its state: {type(exc).__name__}: {exc}"
            ) from exc
    for message in messages:
        warnings.warn(f"hookloop: {message}", RuntimeWarning, stacklevel=3)
    loop.print(f"hookloop: resumed from {path} (epoch {loop.state.epoch}, "  # main process only
               f"update {loop.state.global_step})")
    return Resume(epoch_start=epoch_start, rng=rng, generators=generators, path=path)


def _restore_early(loop, staged: Staged, where: str) -> None:
    """``load_state_dict_early(state, loop)`` of the plugins that have one."""
    current = dict(stateful_plugins(loop))
    for name, state in staged.plugin_states.items():
        early = getattr(current.get(name), "load_state_dict_early", None)
        if callable(early):
            try:
                early(state, loop)
            except Exception as exc:  # noqa: BLE001
                raise CheckpointError(f"{where}: plugin {name!r} could not restore early "
                                      f"(load_state_dict_early): {type(exc).__name__}: {exc}") from exc


def _custom_states(staged: Staged, trusted: set, where: str) -> list:
    """The states of the objects registered with Accelerate: plain data, or
    (trusted by name) unpickled; any other pickle is refused."""
    import io

    out = []
    for rel, (kind, payload) in staged.custom.items():
        if kind == "data":
            out.append(payload)
        elif rel in trusted:
            try:
                out.append(torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False))
            except Exception as exc:  # noqa: BLE001
                raise CheckpointError(f"{where}: cannot unpickle {rel} (trusted by name): "
                                      f"{type(exc).__name__}: {first_line(exc)}") from exc
        else:
            raise CheckpointError(
                f"{where}: {rel}, the state of an object registered with "
                "accelerator.register_for_checkpointing, is a pickle that does not load as plain "
                "data (tensors, numbers, strings, lists, dicts): unpickling it could run any code, "
                "so it is not loaded. If you wrote this checkpoint yourself, trust the file by "
                f"name: Checkpoint(trust_pickles=[{rel!r}]) (or checkpointing.load(..., "
                f"trust_pickles=[{rel!r}])). Better: make the object a plugin with "
                "state_dict/load_state_dict, which hookloop stores as data"
            )
    return out


def _check_optimizers(loop, staged: Staged, where: str, groups: bool) -> None:
    """Does each saved optimizer state fit its optimizer? ``groups``: the
    param groups (after early plugin restores); else the rest."""
    acc = loop.accelerator
    names = {}
    for name, entry in formats.describe_networks(loop).items():
        if entry.get("optimizer"):
            names[entry["optimizer"]] = name
    known_classes = bool(staged.doc.get("classes"))
    for i, opt in enumerate(accel.optimizers(acc)[:len(staged.optimizers)]):  # sharded: none
        rel = accel.optimizer_file(i)
        network = names.get(rel, f"#{i}")
        inner = getattr(opt, "optimizer", opt)
        cls = type(inner).__name__
        state = staged.optimizers[i]
        saved_groups, now_groups = state["param_groups"], inner.param_groups
        if groups:
            _check_groups(state, now_groups, where, network, rel, cls)
        elif not known_classes:  # a 0.1 checkpoint: tell other optimizers apart by their groups
            for saved, now in zip(saved_groups, now_groups):
                missing = set(now) - set(saved) - _OPTIONAL_GROUP_KEYS
                if missing:
                    raise CheckpointError(
                        f"{where}: network {network!r}: {rel} was written by another optimizer "
                        f"than this network's {cls}: its param groups lack "
                        f"{', '.join(map(repr, sorted(missing)))}"
                    )


def _check_groups(state: dict, now_groups, where, network, rel, cls) -> None:
    saved_groups = state["param_groups"]
    saved_sizes = [len(g.get("params", ())) for g in saved_groups]
    now_sizes = [len(g["params"]) for g in now_groups]
    if saved_sizes != now_sizes:
        raise CheckpointError(
            f"{where}: network {network!r}: {rel} holds {len(saved_sizes)} param group(s) of "
            f"{saved_sizes} parameters; this network's {cls} has {len(now_sizes)} of "
            f"{now_sizes}. A plugin that adds a param group during training (unfreezing a "
            "backbone) must add it again before the optimizer state is restored: give it a "
            "load_state_dict_early(state, loop) method (docs/checkpoints.md, Plugin state)"
        )
    params = [p for g in now_groups for p in g["params"]]
    ids = [k for g in saved_groups for k in g["params"]]
    for n, (key, param) in enumerate(zip(ids, params)):
        entry = state["state"].get(key)
        for name, value in (entry.items() if isinstance(entry, dict) else ()):
            if (name in _PER_PARAMETER and isinstance(value, torch.Tensor)
                    and tuple(value.shape) != tuple(param.shape)):
                raise CheckpointError(
                    f"{where}: network {network!r}: {rel} has optimizer state {name!r} of "
                    f"shape {list(value.shape)} for parameter #{n}, which has shape "
                    f"{list(param.shape)}: the parameters are in another order or of "
                    "another model"
                )
