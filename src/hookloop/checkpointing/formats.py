"""Which format a network's state takes, and how each is written, verified
and read.

- ``plain``: Accelerate's unsharded files (``model.safetensors``,
  ``optimizer.bin``): :mod:`.staging` reads them into memory, :mod:`.accelerate`
  commits them. Nothing here runs for it (the manifest has no ``sharding``).
- ``fsdp``: Accelerate's FSDP (1 or 2), written by ``save_state``
  (``save_fsdp_model`` / ``save_fsdp_optimizer``): ``SHARDED_STATE_DICT``:
  ``pytorch_model_fsdp_<i>/`` and ``optimizer_<i>/``, each a
  ``torch.distributed.checkpoint`` (DCP) folder (``.metadata``, ``__<rank>_0.distcp``);
  ``FULL_STATE_DICT``: ``pytorch_model_fsdp.bin`` and ``optimizer.bin`` from rank 0.
  Read back by Accelerate's ``load_fsdp_model`` / ``load_fsdp_optimizer``.
- ``deepspeed``: the engine's ``save_checkpoint(dir, "pytorch_model")``:
  ``pytorch_model/`` (``mp_rank_00_model_states.pt``,
  ``zero_pp_rank_<rank>_mp_rank_00_optim_states.pt`` ...), ``latest``,
  ``zero_to_fp32.py``; read back by the engine's ``load_checkpoint``.
- ``dcp``: a model the user sharded (``fully_shard``, ``Loop(prepare=False)``):
  hookloop writes ``dcp/<network>/``, one DCP folder of ``{"model", "optimizer"}``
  (``get_state_dict`` / ``dcp.save``, every rank its shards) and
  ``dcp/<network>/scheduler.bin`` (the main process, ``torch.save``); read back
  with ``dcp.load`` and ``set_state_dict``.

Every file of every format is in the manifest with its size and CRC-32, and
``sharding.shards`` says which rank wrote which shard file. Each rank
checksums the shard files it wrote (in parallel), and on resume verifies them
(and rank 0 the shared ones) before anything is loaded: all ranks agree, so
one bad file refuses the checkpoint everywhere. DCP's own files are read
without trusting them (:mod:`.dcp_metadata`).
"""

from __future__ import annotations

from typing import Any
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import accelerate as accel
from . import dcp_metadata
from .dcp_metadata import load_metadata  # noqa: F401 - importable from here
from .errors import CheckpointError
from .layout import TENSORS_FILE
from .manifest import crc32_file, verified

PLAIN, FSDP, DEEPSPEED, MEGATRON, DCP = "plain", "fsdp", "deepspeed", "megatron", "dcp"
#: hookloop's folder of the networks the user sharded
DCP_DIR = "dcp"
#: a shard file and the rank that wrote it: DCP, DeepSpeed's ZeRO, FSDP's LOCAL_STATE_DICT
_OWNED = re.compile(r"(?:^|/)(?:__(\d+)_\d+\.distcp|(?:bf16_)?zero_pp_rank_(\d+)_[^/]*|[^/]*_rank(\d+)\.bin)$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


# -- which format ----------------------------------------------------------------------


def user_sharded(model) -> bool:
    """A model the user sharded: ``fully_shard`` (FSDP2), an FSDP1 wrapper,
    or DTensor parameters."""
    from torch.distributed.tensor import DTensor

    wrappers: tuple[type, ...] = ()
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
        wrappers = (FSDPModule, FullyShardedDataParallel)
    except ImportError:  # pragma: no cover - torch without FSDP2
        pass
    if isinstance(model, wrappers):
        return True
    return any(isinstance(p, DTensor) for p in model.parameters())


def accelerate_format(acc) -> dict:
    """``{"format": plain|fsdp|deepspeed|megatron}`` of what ``save_state``
    writes for the prepared models (with FSDP: its version and state dict type)."""
    kind = getattr(acc.distributed_type, "name", "")
    if kind == "FSDP":
        plugin = acc.state.fsdp_plugin
        sdt = getattr(plugin.state_dict_type, "name", str(plugin.state_dict_type))
        return {"format": FSDP, "fsdp_version": int(plugin.fsdp_version), "state_dict_type": sdt}
    return {"format": {"DEEPSPEED": DEEPSPEED, "MEGATRON_LM": MEGATRON}.get(kind, PLAIN)}


def _prepared(acc, net) -> bool:
    return any(m is net.model or m is net.unwrapped for m in acc._models)


def _dcp_entry(name, net, part):
    if not user_sharded(net.model):
        return None
    if not _SAFE_NAME.match(name):
        raise CheckpointError(f"network {name!r}: its model is sharded, and its state is saved in "
                              f"a folder named after it: give it a name of letters, digits, '_', "
                              "'.' and '-'")
    return f"{DCP_DIR}/{name}/" + {"model": "model", "optimizer": "optimizer",
                                   "scheduler": "scheduler.bin"}[part]


def fsdp_file(fmt: dict, part: str, i: int) -> str:
    """The file (or DCP folder) Accelerate's FSDP ``save_state`` writes for
    the i-th prepared model or optimizer."""
    suffix = f"_{i}" if i else ""
    if fmt["state_dict_type"] == "FULL_STATE_DICT":
        return f"pytorch_model_fsdp{suffix}.bin" if part == "model" else accel.optimizer_file(i)
    return f"pytorch_model_fsdp_{i}" if part == "model" else f"optimizer_{i}"


def deepspeed_tag(i: int) -> str:
    """The folder (checkpoint tag) of the i-th DeepSpeed engine: model and optimizer."""
    return f"pytorch_model{'_' + str(i) if i else ''}"


def describe_networks(loop) -> dict:
    """:func:`~.accelerate.describe_networks` in this run's format: the file
    (or folder) of each network's model, optimizer and scheduler; a model
    the user sharded (``dcp/<network>/model``, ``.../optimizer``: the keys of
    its DCP folder) instead of a refusal."""
    fmt = accelerate_format(loop.accelerator)
    files = None
    if fmt["format"] == FSDP:
        def files(part, i):
            return accel.scheduler_file(i) if part == "scheduler" else fsdp_file(fmt, part, i)
    elif fmt["format"] == DEEPSPEED:
        def files(part, i):
            return accel.scheduler_file(i) if part == "scheduler" else deepspeed_tag(i)
    return accel.describe_networks(loop, files=files, unprepared=_dcp_entry)


def describe(loop) -> dict | None:
    """The manifest's ``sharding`` for this run, or None: the plain format."""
    acc = loop.accelerator
    fmt = accelerate_format(acc)
    dcp = {name: DCP for name, net in loop.networks.items()
           if not _prepared(acc, net) and user_sharded(net.model)}
    if fmt["format"] == PLAIN and not dcp:
        return None
    return {"accelerate": fmt, "networks": dcp, "scheduler_files": len(accel.scheduler_objects(acc))}


def check_resume(loop, doc: dict, where: str) -> None:
    """The checkpoint's format is this run's, and (sharded) so is its number
    of processes; else a :class:`CheckpointError` naming both."""
    saved, now = doc.get("sharding"), describe(loop)
    strip = (lambda s: None if s is None else {k: s[k] for k in ("accelerate", "networks")})
    if strip(saved) != strip(now):
        def show(s):
            return "the plain format" if s is None else f"{s['accelerate']} with networks {s['networks'] or {}}"
        raise CheckpointError(f"{where} was written in {show(saved)}; this run saves {show(now)}: "
                              "resume it with the FSDP / DeepSpeed settings, and the sharding of "
                              "the networks, that it was written with")
    if saved is not None and doc["num_processes"] != loop.accelerator.num_processes:
        raise CheckpointError(
            f"{where} holds sharded states of {doc['num_processes']} process(es); this run has "
            f"{loop.accelerator.num_processes}: hookloop resumes a sharded checkpoint on the number "
            "of processes that wrote it")


def owner(rel: str) -> int | None:
    """The rank that wrote shard file ``rel`` (by its name), or None."""
    match = _OWNED.search(rel)
    return None if match is None else int(next(g for g in match.groups() if g is not None))


# -- saving ------------------------------------------------------------------------------


def save(loop, tmp: Path, sharding: dict) -> dict:
    """Every rank, after ``save_state``: write the networks the user sharded
    (``dcp/<network>/``), then fsync and checksum the shard files this rank
    wrote. Returns ``{rel: (size, crc32)}`` of those files."""
    from torch.distributed.checkpoint import state_dict_saver  # dcp.save, as its module exports it
    from torch.distributed.checkpoint.state_dict import get_state_dict, get_model_state_dict

    from . import layout

    acc = loop.accelerator
    for name in sharding["networks"]:
        net = loop.networks[name]
        folder = tmp / DCP_DIR / name
        if net.optimizer is not None:
            model_state, optimizer_state = get_state_dict(net.model, net.optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
        else:
            state = {"model": get_model_state_dict(net.model)}
        state_dict_saver.save(state, checkpoint_id=str(folder))
        if net.scheduler is not None and acc.is_main_process:
            torch.save(net.scheduler.state_dict(), folder / "scheduler.bin")
    own = {}
    for file in sorted(tmp.rglob("*")):
        rel = file.relative_to(tmp).as_posix()
        if file.is_file() and owner(rel) == acc.process_index:
            layout.fsync_file(file)
            own[rel] = (file.stat().st_size, crc32_file(file))
    return own


def gather(acc, own: dict, sharding: dict) -> dict:
    """Every rank: each rank's checksummed files, to the main process
    (``known``: ``{rel: (size, crc)}``), and ``sharding.shards`` (rank ->
    its files) for the manifest."""
    from accelerate.utils import gather_object

    parts = gather_object([(acc.process_index, own)]) if acc.num_processes > 1 else [(0, own)]
    known: dict[str, Any] = {}
    shards: dict[str, Any] = {}
    for rank, files in parts:
        known.update(files)
        shards[str(rank)] = sorted(files)
    return {"known": known, "manifest": {**sharding, "shards": shards}}


# -- verifying -------------------------------------------------------------------------


@dataclass
class Sharded:
    """What staging verified of a sharded checkpoint, for :func:`commit`."""

    doc: dict
    #: network -> its DCP scheduler's state
    schedulers: dict = field(default_factory=dict)

    @property
    def accelerate(self) -> str:
        return self.doc["accelerate"]["format"]


def _read_elsewhere(rel: str) -> bool:
    """Files the rest of staging reads (each rank its own per-rank files)."""
    if "/" in rel:
        return False
    return (rel in (TENSORS_FILE, accel.SCALER_FILE) or bool(accel.LOADER_FILE.match(rel))
            or rel.startswith(("random_states_", "hookloop-rank", "scheduler", "custom_checkpoint_")))


def _folders(doc: dict) -> list[str]:
    """The DCP folders of a checkpoint (those with a ``.metadata``)."""
    return sorted({rel.rsplit("/", 1)[0] for rel in doc["files"] if rel.endswith("/.metadata")})


def _metadata(path: Path, doc: dict, folder: str, where: str):
    rel = f"{folder}/.metadata"
    with verified(path, rel, doc, where, "the metadata of a sharded state") as opened:
        return dcp_metadata.load_metadata(opened.read(), rel, where)


def stage(path: Path, doc: dict, rank: int, where: str) -> Sharded:
    """Verify this rank's share of a sharded checkpoint, each file's size and
    CRC-32: the shard files it wrote, and (rank 0) every other file the plain
    staging does not read; every DCP ``.metadata`` (read safely) and the
    non-tensor items of its shards (``weights_only=True``). Raises
    :class:`CheckpointError` naming the file. (Shapes: :func:`check_shapes`.)"""
    sharding = doc["sharding"]
    out = Sharded(sharding)
    metadata = {folder: _metadata(path, doc, folder, where) for folder in _folders(doc)}
    for rel in sorted(doc["files"]):
        writer = owner(rel)
        if _read_elsewhere(rel) or (0 if writer is None else writer) != rank:
            continue
        folder = rel.rsplit("/", 1)[0] if "/" in rel else None
        what = f"a shard of {folder}" if folder else f"the sharded state file {rel}"
        with verified(path, rel, doc, where, what) as opened:
            if folder in metadata and rel.endswith(".distcp"):
                dcp_metadata.check_bytes(metadata[folder], rel, opened, where)
    for name in sharding["networks"]:
        rel = f"{DCP_DIR}/{name}/scheduler.bin"
        if rel in doc["files"]:
            with verified(path, rel, doc, where, f"the scheduler state of network {name!r}") as opened:
                out.schedulers[name] = accel.torch_load(opened.source(), rel, where, "a scheduler state")
    return out


def check_shapes(loop, path: Path, doc: dict, where: str) -> None:
    """Every rank, before anything is read in full: the tensor names and
    shapes in each DCP ``.metadata`` against the model's (what the
    safetensors header check is for the plain format)."""
    for folder, (prefix, expected, network) in _expected_shapes(loop, doc["sharding"]).items():
        if f"{folder}/.metadata" in doc["files"]:
            dcp_metadata.compare(_metadata(path, doc, folder, where), prefix, expected, network, where,
                     f"{folder}/.metadata")


def _expected_shapes(loop, sharding) -> dict:
    """``{DCP folder: (key prefix, {name: shape}, network)}`` of the models
    whose state dict holds DTensors (FSDP2, or DCP of ``fully_shard``): read
    locally, no communication. FSDP1's are not compared (its state dict is a
    collective): DCP itself refuses another shape on load."""
    acc = loop.accelerator
    fmt = sharding["accelerate"]
    out = {}
    now = describe_networks(loop)
    owner_of = {entry["model"]: name for name, entry in now.items()}
    if fmt["format"] == FSDP and fmt.get("fsdp_version") == 2 and fmt["state_dict_type"] != "FULL_STATE_DICT":
        for i, model in enumerate(acc._models):
            folder = fsdp_file(fmt, "model", i)
            out[folder] = ("model.", dcp_metadata.shapes(model), owner_of.get(folder, f"accelerator model #{i}"))
    for name in sharding["networks"]:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = loop.networks[name].model
        if not isinstance(model, FullyShardedDataParallel):
            out[f"{DCP_DIR}/{name}"] = ("model.", dcp_metadata.shapes(model), name)
    return out


# -- loading ---------------------------------------------------------------------------


def commit(loop, staged, custom: list, where: str) -> None:
    """:func:`~.accelerate.commit`, with the models and optimizers of a
    sharded format restored by that format's own reader."""
    sharded = getattr(staged, "sharded", None)
    if sharded is None:
        return accel.commit(loop, staged, custom, where)
    acc = loop.accelerator
    if sharded.accelerate == MEGATRON:  # verified; Megatron-LM's own layout, loaded by Accelerate
        try:
            acc.load_state(str(staged.path))
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{where}: accelerator.load_state failed after the files were "
                                  f"checked: {type(exc).__name__}: {exc}") from exc
        return
    return accel.commit(loop, staged, custom, where,
                        networks=lambda apply: _restore(loop, staged, sharded, apply))


def _restore(loop, staged, sharded: Sharded, apply) -> None:
    acc = loop.accelerator
    path = str(staged.path)
    fmt = sharded.doc["accelerate"]
    label = {entry["model"]: f"the weights of network {name!r}"
             for name, entry in describe_networks(loop).items()}
    if fmt["format"] == FSDP:
        from accelerate.utils import load_fsdp_model, load_fsdp_optimizer

        plugin = acc.state.fsdp_plugin
        for i, model in enumerate(acc._models):
            rel = fsdp_file(fmt, "model", i)
            apply(label.get(rel, f"accelerator model #{i}"), rel,
                  lambda m=model, i=i: load_fsdp_model(plugin, acc, m, path, i))
        if acc.scaler is not None and acc.is_fsdp2 and staged.scaler is not None:
            acc.scaler.load_state_dict(staged.scaler)  # before the optimizer, as Accelerate does
            acc.scaler._lazy_init_scale_growth_tracker(acc.scaler._device)
        for i, opt in enumerate(acc._optimizers):
            apply("an optimizer state", fsdp_file(fmt, "optimizer", i),
                  lambda o=opt, i=i: load_fsdp_optimizer(plugin, acc, o, acc._models[i], path, i))
    elif fmt["format"] == DEEPSPEED:
        for i, model in enumerate(acc._models):
            tag = deepspeed_tag(i)
            apply(label.get(tag, f"accelerator model #{i}"), tag,
                  lambda m=model, t=tag: m.load_checkpoint(path, t))
    for name in sharded.doc["networks"]:
        apply(f"the sharded state of network {name!r}", f"{DCP_DIR}/{name}",
              lambda n=name: _load_dcp(loop.networks[n], staged.path / DCP_DIR / n,
                                       sharded.schedulers.get(n)))


def _load_dcp(net, folder: Path, scheduler_state) -> None:
    from torch.distributed.checkpoint import state_dict_loader  # dcp.load, as its module exports it
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if net.optimizer is not None:
        model_state, optimizer_state = get_state_dict(net.model, net.optimizer)
        state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    else:
        state = {"model": get_model_state_dict(net.model)}
    state_dict_loader.load(state, checkpoint_id=str(folder))  # its non-tensor items: verified in stage()
    if net.optimizer is not None:
        set_state_dict(net.model, net.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
    else:
        set_model_state_dict(net.model, state["model"])
    if net.scheduler is not None and scheduler_state is not None:
        net.scheduler.load_state_dict(scheduler_state)
