"""A resume, in one pass: find the checkpoint (:func:`find`: ``latest`` read
once, every fallback decided there, the main process's view deciding for
every process), read its manifest once, check it against the loop, read and
verify each file once (:func:`~.stage.stage`), check what was read, commit
(:func:`commit`), or nothing; and a new run from a checkpoint's weights
(:func:`load_weights`)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, NamedTuple


from ..rng import Resume, capture_rng
from . import accelerate as accel
from . import elastic, formats
from .codec import stateful_plugins
from .collective import every_rank
from .errors import CheckpointError, NotACheckpointName, first_line
from .finite import first_bad
from .lock import refuse_live_run
from .manifest import peek, read_manifest
from .saving import adopt_run, trusted_pickles
from .stage import (Folder, Staged, check_optimizers, check_resume, check_shapes, custom_states, read_rank_file,
                    refuse_misfit, stage, weights_report)
from .store import LATEST, STATE_FILE, list_checkpoints, read_latest

#: what every rank must be told when some cannot see the checkpoint
_SHARED = ("A checkpoint folder must be visible to every process: a shared file system, or copy "
           "it to each machine")


def resolve(resume_from, root) -> Path | None:
    return find(resume_from, root)[0]


def find(resume_from, root, stacklevel: int = 3) -> tuple[Path | None, Staged | None]:
    """The checkpoint ``resume_from`` names, and what was read and verified
    while finding it (for ``load(..., staged=...)``; None for a checkpoint's
    path, returned unread).

    ``"latest"``: the checkpoint ``root/latest`` names; if it cannot be loaded
    (a temporary folder's name, missing, truncated, a checksum mismatch, not
    deserialisable, not finite), the newest loadable one in ``root``, with a
    warning naming what failed; None if nothing was ever saved there. A root
    given as a path resolves the same way, but finding nothing is an error.
    ``root`` may be a list (the default run folders, newest first): one whose
    checkpoint folders are all unreadable is skipped, with a warning.

    With several processes they agree: the main process's view decides which
    checkpoint it is, every rank reads it from its own view, and they skip the
    same ones; a checkpoint some rank cannot see is a :class:`CheckpointError`
    on every rank naming the ranks: never some resuming, some starting afresh.
    """
    roots = list(root) if isinstance(root, (list, tuple)) else [root]
    for i, one in enumerate(roots if resume_from == "latest" else roots[:1]):
        found = _find_in(resume_from, one, stacklevel + 1, last=i == len(roots) - 1)
        if found is not None:
            return found
    return None, None


def _find_in(resume_from, root, stacklevel: int, last: bool):
    refuse_live_run(resume_from, root)  # a live run's root: refused before anything is read
    lenient = resume_from == "latest"
    views, error = _views(resume_from, root, lenient)  # (every rank's, exchanged once)
    if error is not None:
        raise error  # this rank's own (read_latest of a root it sees)
    if failed := next((v["error"] for v in views if v["error"]), None):
        raise CheckpointError(failed)
    mine, main = views[accel.process_index()], views[0]
    if main["kind"] == "path":
        _agree_on_path(views, resume_from)
        return Path(mine["path"]), None
    root = Path(mine["root"])
    name, candidates = main["latest"], main["names"]
    order = ([name] if name is not None else []) + [c for c in reversed(candidates) if c != name]
    if not order:
        _agree_on_nothing(views, resume_from)
    if mine["warning"]:  # a .tmp- or .trash- folder ...: the newest usable instead
        warnings.warn(f"hookloop: {mine['warning']}; resuming from the newest usable checkpoint "
                      "instead", RuntimeWarning, stacklevel=stacklevel)
    problems: list[str] = []
    for candidate in order:
        blind = [r for r, v in enumerate(views) if candidate in candidates and candidate not in v["names"]]
        if blind:
            raise CheckpointError(_blind_message(views, blind, candidate, resume_from))
        staged = None
        with every_rank(raise_error=False) as outcome:  # every process skips the same checkpoints
            staged = stage(root / candidate, read_manifest(root / candidate))
        if outcome.error is None:
            if len(problems) > 1 or (problems and name is None):
                warnings.warn(f"hookloop: resuming from {root / candidate}; newer checkpoints are not "
                              "usable: " + "; ".join(problems[1 if name is not None else 0:]),
                              RuntimeWarning, stacklevel=stacklevel)
            return root / candidate, staged
        if name is not None and not problems and len(order) > 1:
            warnings.warn(f"hookloop: {root / LATEST} names {name!r}, which is not usable "
                          f"({outcome.error}); resuming from the newest usable checkpoint instead",
                          RuntimeWarning, stacklevel=stacklevel)
        problems.append(outcome.error)
    if lenient and name is None and not candidates:
        return None if not last else (None, None)
    if lenient and not last and name is None and not any(_readable(root / c) for c in candidates):
        warnings.warn(f"hookloop: skipping run folder {root}: none of its checkpoint folders is "
                      f"readable ({'; '.join(problems[-3:])})", RuntimeWarning, stacklevel=stacklevel)
        return None
    raise CheckpointError(f"resume_from={str(resume_from)!r}: no usable checkpoint in {root} "
                          f"(found {', '.join(candidates) or 'none'})" + "".join(f"; {p}" for p in problems))


def _readable(path) -> bool:
    try:
        peek(path)
    except CheckpointError:
        return False
    return True


def _views(resume_from, root, lenient: bool) -> tuple[list[dict], CheckpointError | None]:
    """Every rank's view of ``resume_from`` (one ``gather_object``), and this
    rank's own error reading it: ``kind`` (``"root"`` or ``"path"``), the
    path (``exists``, a ``manifest``), ``root``, what ``latest`` holds, the
    checkpoint ``names``, a ``warning`` (``latest`` names no checkpoint)."""
    view: dict[str, Any] = {"kind": "root", "path": None, "exists": False, "manifest": False, "root": None,
                            "latest": None, "names": [], "warning": None, "error": None}
    error = None
    root = Path(root if lenient else os.fspath(resume_from)).expanduser()
    if not lenient:
        view.update(path=str(root), exists=root.exists(), manifest=(root / STATE_FILE).exists())
        if not (root.is_dir() and not view["manifest"] and ((root / LATEST).exists() or list_checkpoints(root))):
            view["kind"] = "path"
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


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _agree_on_path(views: list[dict], resume_from) -> None:
    """Every rank sees the checkpoint ``resume_from`` names as the main does."""
    seen = [(v["exists"], v["manifest"]) for v in views]
    if len(set(seen)) == 1:
        return
    best = max(seen)
    blind = [r for r, s in enumerate(seen) if s != best]
    raise CheckpointError(
        f"resume_from={str(resume_from)!r}: {_ranks(blind)} cannot see {'it' if best[1] else 'its folder'}"
        + "".join(f" (rank {r} looks for {views[r]['path']!r})" for r in blind
                  if views[r]["path"] != views[0]["path"])
        + f", which {_ranks([r for r in range(len(views)) if r not in blind])} see"
        + f"{'s' if len(views) - len(blind) == 1 else ''}. {_SHARED}. Nothing was loaded"
    )


def _agree_on_nothing(views: list[dict], resume_from) -> None:
    """The main process sees no checkpoint: a fresh start only if no rank does."""
    seeing = [r for r, v in enumerate(views) if v["names"] or v["latest"]]
    if seeing:
        raise CheckpointError(
            f"resume_from={str(resume_from)!r}: rank 0 sees no checkpoint in {views[0]['root']!r}, but "
            + "; ".join(f"rank {r} sees {', '.join(views[r]['names'][-3:]) or views[r]['latest']} in "
                        f"{views[r]['root']!r}" for r in seeing)
            + f": the processes would not start alike (some from scratch, some resumed). {_SHARED}. "
            "Nothing was loaded")


def _blind_message(views: list[dict], blind: list[int], name: str, resume_from) -> str:
    elsewhere = "".join(f"; rank {r} looks in {views[r]['root']!r}" for r in blind
                        if views[r]["root"] != views[0]["root"])
    return (f"resume_from={str(resume_from)!r}: {_ranks(blind)} cannot see checkpoint "
            f"{str(Path(views[0]['root']) / name)!r}, which rank 0 resumes from ({len(views)} processes"
            f"{elsewhere}). {_SHARED}. Nothing was loaded")



# -- loading ---------------------------------------------------------------------------


def load(loop, path, *, strict: bool = True, trust_pickles=None, staged: Staged | None = None) -> Resume:
    """Restore ``loop`` from the checkpoint at ``path`` (every process), all
    or nothing: the manifest checked against the loop (networks, optimizer and
    scheduler classes, the run settings that decide the data order and the
    step count, stateful plugins), every file read and verified, shapes and
    optimizer states checked to fit; only then are the networks, random
    states, run state and plugin states replaced (a plugin's
    ``load_state_dict_early(state, loop)`` before any optimizer state). Every
    failure is a :class:`CheckpointError` naming the culprit, the loop
    untouched; ``strict=False``: plugin and run-setting mismatches only warn.

    :param trust_pickles: ``custom_checkpoint_<i>.pkl`` files that may be
        unpickled; default: the loop's ``Checkpoint`` plugins' ``trust_pickles``.
    :param staged: what :func:`find` read of ``path`` (not read again).
    """
    acc, path = loop.accelerator, Path(path)
    if staged is not None and (staged.process_index != acc.process_index
                               or os.path.realpath(staged.path) != os.path.realpath(path)):
        staged = None  # staged for another process or another checkpoint: read again
    doc = read_manifest(path) if staged is None else staged.doc
    where, networks = f"checkpoint {str(path)!r}", formats.describe_networks(loop)
    messages, plan = check_resume(loop, path, doc, networks, strict)
    try:  # on a scratch state: fails before any change
        scratch = type(loop.state)()
        scratch.load_state_dict(doc["loop"])
        scratch.load_run_dict(doc.get("run") or {})
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{where}: the run state in {STATE_FILE} is not valid: "
                              f"{type(exc).__name__}: {exc}") from exc
    trusted = set(trusted_pickles(loop) if trust_pickles is None else trust_pickles)
    parts = None
    with every_rank(acc):  # every process fails together, none waits
        if staged is None:
            staged = stage(path, doc, acc.process_index)
        check_shapes(loop, staged, networks, where)
        custom = custom_states(staged, trusted, where)
        if plan.elastic:  # the other saved ranks' positions and loop.log values
            folder = Folder(path, doc)
            parts = {r: read_rank_file(folder, r) for r in elastic.needed_ranks(staged, plan)}
            parts[staged.source_rank] = (staged.epoch_start, staged.generators, staged.logged)
    restore_early(loop, staged, networks, where)
    elastic.scale_schedulers(loop, staged, plan)
    commit(loop, staged, custom, where)  # (a rank the checkpoint lacks: derived random states)
    rng = capture_rng()
    state = loop.state  # the run state, whole: position, run, this process's epoch
    state.load_state_dict(doc["loop"])
    state.load_run_dict(doc.get("run") or {})
    state.epoch_start, generators, logged = elastic.continue_epoch(loop, staged, plan, parts, messages)
    state.logged.load_state_dict(logged)
    adopt_run(loop, path, doc)
    current = dict(stateful_plugins(loop))
    for name, plugin_state in staged.plugin_states.items():
        if name in current:
            try:
                current[name].load_state_dict(plugin_state)
            except Exception as exc:
                raise CheckpointError(f"{where}: plugin {name!r} could not load its state: "
                                      f"{type(exc).__name__}: {exc}") from exc
    for message in messages:
        warnings.warn(f"hookloop: {message}", RuntimeWarning, stacklevel=3)
    loop.print(f"hookloop: resumed from {path} (epoch {state.epoch}, update {state.global_step})")
    return Resume(epoch_start=state.epoch_start, rng=rng, generators=generators, path=path, manifest=doc)


def commit(loop, staged: Staged, custom: list, where: str) -> None:
    """The staged states into the loop's objects, as ``accelerator.load_state``
    does (same objects, order, values): the networks by their format (a
    sharded format's collectives first), then the rest; every process agrees
    afterwards whether it failed anywhere (never around the collectives: a
    rank failing before one would leave the others waiting in it)."""
    acc = loop.accelerator

    def apply(what, rel, fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - checked before; name the file if it still fails
            raise CheckpointError(f"{where}: restoring {what} from {rel} failed after it was "
                                  f"checked: {type(exc).__name__}: {exc}") from exc

    with every_rank(acc, catch=(Exception, _collective_failure()),
                    describe=lambda e: e if isinstance(e, CheckpointError) else CheckpointError(
                        f"{where}: restoring it failed on process {acc.process_index}: {first_line(e)}")):
        accel.before_load(acc, staged.path, with_models=staged.sharded is None)
        formats.of_manifest(staged.doc.get("sharding")).restore(loop, staged, apply)
        if staged.sharded is not None:
            formats.restore_dcp(loop, staged, apply)
        accel.restore_rest(acc, staged, custom, apply)


def _collective_failure() -> type:
    """What ``torch.distributed.checkpoint`` raises on every rank when one
    failed (a ``BaseException``, not an ``Exception``)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def restore_early(loop, staged: Staged, networks: dict, where: str) -> None:
    """``load_state_dict_early(state, loop)`` of the plugins that have one, then
    the optimizer states checked against the param groups; added groups taken
    out again on a failure."""
    acc = loop.accelerator
    optimizers = [getattr(o, "optimizer", o) for o in accel.optimizers(acc)]
    before = [list(o.param_groups) for o in optimizers]
    current = dict(stateful_plugins(loop))
    with every_rank(acc):
        try:
            for name, state in staged.plugin_states.items():
                early = getattr(current.get(name), "load_state_dict_early", None)
                if callable(early):
                    try:
                        early(state, loop)
                    except Exception as exc:  # noqa: BLE001
                        raise CheckpointError(f"{where}: plugin {name!r} could not restore early "
                                              f"(load_state_dict_early): {type(exc).__name__}: {exc}") from exc
            check_optimizers(loop, staged, networks, where)
        except CheckpointError:
            for optimizer, groups in zip(optimizers, before):
                optimizer.param_groups[:] = groups  # undo added param groups
            raise


# -- a new run from a checkpoint's weights ---------------------------------------------


def load_weights(loop, path, *, staged: Staged | None = None, strict: bool = True):
    """Every network's weights from checkpoint ``path``, and nothing else
    (``Loop.load_checkpoint(path, weights_only=True)``), on any number of
    processes and run settings: from a hookloop checkpoint by network name,
    from a folder of Accelerate's plain format by the models' order. All
    processes fail together, with nothing changed. Returns ``path``.

    ``strict=False``: every tensor whose name and shape fit is loaded, the
    others stay as they are (a new classifier head); returns a
    :class:`WeightsLoaded` naming, per network, what was missing, unexpected
    or of another shape, also said in a warning."""
    acc, path = loop.accelerator, Path(path)
    where = f"checkpoint {str(path)!r}"
    if accel.kind(acc) in accel.SHARDED_TYPES:
        raise CheckpointError(f"{where}: load_checkpoint(weights_only=True) reads whole models, and "
                              f"this run's models are sharded ({accel.kind(acc)}): resume it with "
                              "load_checkpoint(path) on the same number of processes instead")
    now = formats.describe_networks(loop)  # network -> {"model": its file in this run, ...}
    if sharded := [name for name, entry in now.items() if str(entry["model"]).startswith(f"{formats.DCP_DIR}/")]:
        raise CheckpointError(f"{where}: load_checkpoint(weights_only=True) reads whole models, and "
                              f"this run's network(s) {', '.join(map(repr, sharded))} are sharded "
                              "(fully_shard): resume with load_checkpoint(path) on the same number of "
                              "processes instead")
    models = accel.models(acc)
    index = {accel.model_file(i): i for i in range(len(models))}
    states, reports = {}, {}
    with every_rank(acc):  # every process fails together, none waits
        if staged is not None and os.path.realpath(staged.path) == os.path.realpath(path):
            read = {name: staged.models[index[now[name]["model"]]] for name in now}
        else:
            read = _weights_of(path, where, now, index)
        for name, state in read.items():
            model = models[index[now[name]["model"]]]
            expected = model.state_dict()
            state = accel.in_model_names(state, expected)  # (a compiled model's names, or its eager model's)
            report = reports[name] = weights_report(state, expected)
            if strict:
                refuse_misfit(report, state, name, where)
            else:
                state = {k: v for k, v in state.items() if k in expected and k not in report["mismatched"]}
            found = first_bad([(k, t) for k, t in state.items() if t.is_floating_point()])
            if found is not None:
                raise CheckpointError(f"{where}: the weights of network {name!r} are not finite (tensor "
                                      f"{found[0]!r}: {found[1]})")
            states[name] = (model, state)
    for name, (model, state) in states.items():
        try:
            accel.load_model_state(model, state, strict=strict)
        except Exception as exc:  # noqa: BLE001 - checked before; name the network if it still fails
            raise CheckpointError(f"{where}: restoring the weights of network {name!r} failed after "
                                  f"they were checked: {type(exc).__name__}: {exc}") from exc
    if strict:
        return path
    loaded = WeightsLoaded(path, *({n: r[k] for n, r in reports.items()} for k in ("missing", "unexpected",
                                                                                    "mismatched")))
    if loaded.differences() and acc.is_main_process:
        warnings.warn(f"hookloop: {loaded.differences()}", RuntimeWarning, stacklevel=3)
    return loaded


class WeightsLoaded(NamedTuple):
    """What ``load_checkpoint(path, weights_only=True, strict=False)`` loaded:
    the checkpoint, and per network the tensor names not loaded: ``missing``
    (the model's, not in the checkpoint), ``unexpected`` (the checkpoint's,
    not in the model), ``mismatched`` (``name: (checkpoint shape, model
    shape)``); those of the model keep the values they had."""

    path: Path
    missing: dict
    unexpected: dict
    mismatched: dict

    def differences(self) -> str:
        """What did not fit, in words ('' if everything did)."""
        said = []
        for network in self.missing:
            parts = [f"{what}: {', '.join(names)}" for what, names in (
                ("not in the checkpoint (left as they were)", self.missing[network]),
                ("in the checkpoint, not in the model", self.unexpected[network]),
                ("another shape in the checkpoint (left as they were)",
                 [f"{k} {a} in the checkpoint, {b} in the model" for k, (a, b) in self.mismatched[network].items()]),
            ) if names]
            if parts:
                said.append(f"network {network!r}: " + "; ".join(parts))
        return f"loaded what fits of {self.path}: " + " / ".join(said) if said else ""


def _weights_of(path: Path, where: str, now: dict, index: dict) -> dict:
    """Each network's weights in checkpoint ``path``, by its name (or, in a
    folder of Accelerate's plain format, by the models' order)."""
    if not os.path.lexists(path / STATE_FILE) and accel.written_by_save_state(path):
        folder = Folder(path)
        files = [i for i in range(len(folder.names) + 1)
                 if folder.has(accel.model_file(i)) or folder.has(accel.legacy_model_file(i))]
        if files != sorted(index[entry["model"]] for entry in now.values()):
            raise CheckpointError(
                f"{where} (written by accelerator.save_state) holds {len(files)} model(s) "
                f"({', '.join(folder.model_file(i) for i in files) or 'none'}); this loop has "
                f"{len(now)} ({', '.join(f'{n!r}' for n in now)}): their weights are matched by "
                "the order in which the models were prepared")
        rels = {n: folder.model_file(index[e["model"]]) for n, e in now.items()}
    else:
        doc = read_manifest(path)
        saved, folder = doc["networks"], Folder(path, doc)
        if not isinstance(saved, dict) or sorted(saved) != sorted(now):
            names = sorted(saved) if isinstance(saved, dict) else saved
            raise CheckpointError(f"{where} holds the weights of networks {names}; this loop has "
                                  f"{sorted(now)}: load_checkpoint(weights_only=True) loads every "
                                  "network by its name")
        count, rels = (doc.get("accelerate") or {}).get("models", 0), {}
        for name in now:
            rel = (saved[name] or {}).get("model") if isinstance(saved[name], dict) else None
            i = next((i for i in range(count) if rel == accel.model_file(i)), None)
            if rel is None or i is None:
                raise CheckpointError(f"{where}: network {name!r} has no weights in it")
            rels[name] = folder.model_file(i)
    return {name: folder.tensors(rel, f"the weights of network {name!r}") for name, rel in rels.items()}
