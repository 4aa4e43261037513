"""The formats a network's state takes on disk, each an object that names its
files, saves and restores them (staging verifies every file alike):

- :class:`Plain`: Accelerate's unsharded files (``model.safetensors``,
  ``optimizer.bin``), written by hookloop from the state dicts (a host copy
  when asynchronous) and read into memory by :mod:`.reading`.
- :class:`FSDP`: what Accelerate's FSDP (1 or 2) ``save_state`` writes:
  ``SHARDED_STATE_DICT``: ``pytorch_model_fsdp_<i>/`` and ``optimizer_<i>/``,
  each a ``torch.distributed.checkpoint`` (DCP) folder; ``FULL_STATE_DICT``:
  ``pytorch_model_fsdp.bin`` and ``optimizer.bin`` from rank 0; read back by
  Accelerate's ``load_fsdp_model`` / ``load_fsdp_optimizer``.
- DeepSpeed and Megatron-LM save themselves (their engines' formats): refused.
- ``dcp``, per network: a model the user sharded (``fully_shard``,
  ``Loop(prepare=False)``), written by hookloop as ``dcp/<network>/`` (a DCP
  folder of ``{"model", "optimizer"}``, and ``scheduler.bin``).

The manifest's ``sharding`` says which (absent: plain), and which rank wrote
which shard. Each rank checksums the shards it wrote, and on resume verifies
them (rank 0 the shared files) before anything is loaded. DCP's files are
read without trusting them: its ``.metadata`` (a pickle) with an unpickler
that knows only DCP's classes, the non-tensor items of its shards with
``weights_only=True`` first.
"""

from __future__ import annotations

import io
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import accelerate as accel
from .errors import CheckpointError, first_line
from .store import TENSORS_FILE, synced_sum

PLAIN, FSDP_, DCP = "plain", "fsdp", "dcp"
#: hookloop's folder of the networks the user sharded
DCP_DIR = "dcp"
#: a shard file and the rank that wrote it: DCP, DeepSpeed's ZeRO, FSDP's LOCAL_STATE_DICT
_OWNED = re.compile(r"(?:^|/)(?:__(\d+)_\d+\.distcp|(?:bf16_)?zero_pp_rank_(\d+)_[^/]*|[^/]*_rank(\d+)\.bin)$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class Plain:
    """Accelerate's unsharded format."""

    name = PLAIN
    #: hookloop writes the files itself from the state dicts (else ``save_state``)
    writes_itself = True
    #: :meth:`restore` restores everything ``load_state`` does, not only the networks
    whole = False

    def manifest(self) -> dict:
        return {"format": self.name}

    def file(self, part: str, i: int) -> str:
        """The file (or folder) of the i-th prepared model, optimizer or scheduler."""
        return {"model": accel.model_file, "optimizer": accel.optimizer_file,
                "scheduler": accel.scheduler_file}[part](i)

    def save(self, loop, tmp: Path) -> list:
        """Every rank: write what ``save_state`` writes; return the files left
        for :mod:`.writer` (the plain format's models and optimizers)."""
        if not self.writes_itself:
            accel.save_state(loop.accelerator, tmp)
            return []
        heavy = accel.heavy_states(loop.accelerator, tmp)
        accel.save_small_files(loop.accelerator, tmp)
        return heavy

    def restore(self, loop, staged, apply) -> None:
        """The models and optimizers, into the accelerator's."""
        for i, model in enumerate(accel.models(loop.accelerator)):
            apply(f"the weights of accelerator model #{i}", accel.model_file(i),
                  lambda m=model, s=staged.models[i]: accel.load_model_state(m, s))
        for i, opt in enumerate(accel.optimizers(loop.accelerator)):
            apply("an optimizer state", accel.optimizer_file(i),
                  lambda o=opt, s=staged.optimizers[i]: o.load_state_dict(s))

    def shapes(self, loop) -> dict:
        """``{DCP folder: (key prefix, {name: shape}, network)}`` of the models
        whose shapes DCP's metadata records."""
        return {}


class FSDP(Plain):
    name, writes_itself = FSDP_, False

    def __init__(self, version: int, state_dict_type: str):
        self.version, self.state_dict_type = version, state_dict_type

    def manifest(self) -> dict:
        return {"format": self.name, "fsdp_version": self.version, "state_dict_type": self.state_dict_type}

    def file(self, part: str, i: int) -> str:
        if part == "scheduler":
            return accel.scheduler_file(i)
        if self.state_dict_type == "FULL_STATE_DICT":
            return accel.numbered("pytorch_model_fsdp", i) if part == "model" else accel.optimizer_file(i)
        return f"pytorch_model_fsdp_{i}" if part == "model" else f"optimizer_{i}"

    def restore(self, loop, staged, apply) -> None:
        from accelerate.utils import load_fsdp_model, load_fsdp_optimizer

        acc, path = loop.accelerator, str(staged.path)
        plugin, models = acc.state.fsdp_plugin, accel.models(acc)
        for i, model in enumerate(models):
            apply(f"the weights of accelerator model #{i}", self.file("model", i),
                  lambda m=model, i=i: load_fsdp_model(plugin, acc, m, path, i))
        if acc.scaler is not None and acc.is_fsdp2 and staged.scaler is not None:
            accel.load_scaler(acc, staged.scaler, lazy_init=True)  # before the optimizer, as Accelerate does
        for i, opt in enumerate(accel.optimizers(acc)):
            apply("an optimizer state", self.file("optimizer", i),
                  lambda o=opt, i=i: load_fsdp_optimizer(plugin, acc, o, models[i], path, i))

    def shapes(self, loop) -> dict:
        # (FSDP1's state dict is a collective: DCP itself refuses another shape on load)
        if self.version != 2 or self.state_dict_type == "FULL_STATE_DICT":
            return {}
        owner = {entry["model"]: name for name, entry in describe_networks(loop).items()}
        return {self.file("model", i): ("model.", tensor_shapes(m), owner.get(self.file("model", i),
                                                                                f"accelerator model #{i}"))
                for i, m in enumerate(accel.models(loop.accelerator))}


def of_accelerator(acc) -> Plain:
    """The format ``acc``'s ``save_state`` writes."""
    kind = accel.kind(acc)
    if kind == "FSDP":
        plugin = acc.state.fsdp_plugin
        return FSDP(int(plugin.fsdp_version), getattr(plugin.state_dict_type, "name", str(plugin.state_dict_type)))
    if kind in accel.SHARDED_TYPES:
        raise CheckpointError(f"hookloop's checkpoints are not written or read under {kind}: its engine saves "
                              "and loads its own (accelerator.save_state / load_state, outside a Checkpoint plugin)")
    fmt = Plain()
    fmt.writes_itself = kind in accel.PLAIN_TYPES
    return fmt


def of_manifest(sharding: dict | None) -> Plain:
    """The format a checkpoint was written in (its manifest's ``sharding``)."""
    fmt = (sharding or {}).get("accelerate") or {"format": PLAIN}
    if fmt["format"] == FSDP_:
        return FSDP(fmt.get("fsdp_version", 1), fmt.get("state_dict_type", ""))
    if fmt["format"] != PLAIN:
        raise CheckpointError(f"this checkpoint is in the {fmt['format']!r} format, which hookloop no longer "
                              "reads: load it with accelerator.load_state")
    return Plain()


# -- a run's networks --------------------------------------------------------------------


def user_sharded(model) -> bool:
    """A model the user sharded: ``fully_shard``, an FSDP1 wrapper, DTensor parameters."""
    from torch.distributed.tensor import DTensor

    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
        if isinstance(model, (FSDPModule, FullyShardedDataParallel)):
            return True
    except ImportError:  # pragma: no cover - torch without FSDP2
        pass
    return any(isinstance(p, DTensor) for p in model.parameters())


def _dcp_entry(name, net, part):
    if not user_sharded(net.model):
        return None
    if not _SAFE_NAME.match(name):
        raise CheckpointError(f"network {name!r}: its model is sharded, and its state is saved in a folder "
                              "named after it: give it a name of letters, digits, '_', '.' and '-'")
    return f"{DCP_DIR}/{name}/" + {"model": "model", "optimizer": "optimizer", "scheduler": "scheduler.bin"}[part]


def describe_networks(loop) -> dict:
    """The file (or folder) of each network's model, optimizer and scheduler
    in this run's format (``dcp/<network>/...`` for a model the user sharded)."""
    return accel.describe(loop, of_accelerator(loop.accelerator).file, unprepared=_dcp_entry)


def describe(loop) -> dict | None:
    """The manifest's ``sharding`` for this run, or None: the plain format."""
    fmt, acc = of_accelerator(loop.accelerator), loop.accelerator
    dcp = [name for name, net in loop.networks.items() if user_sharded(net.model)
           and not any(m is net.model or m is net.unwrapped for m in accel.models(acc))]
    if fmt.name == PLAIN and not dcp:
        return None
    return {"accelerate": fmt.manifest(), "networks": {n: DCP for n in dcp},
            "scheduler_files": len(accel.scheduler_objects(acc))}


def check_resume(loop, doc: dict, where: str) -> None:
    """The checkpoint's format is this run's, and (sharded) so is its number
    of processes; else a :class:`CheckpointError` naming both."""
    saved, now = doc.get("sharding"), describe(loop)

    def show(s):
        return "the plain format" if s is None else f"{s['accelerate']} with networks {s['networks'] or {}}"

    def strip(s):
        return None if s is None else (s.get("accelerate"), s.get("networks"))

    if strip(saved) != strip(now):
        raise CheckpointError(f"{where} was written in {show(saved)}; this run saves {show(now)}: resume it "
                              "with the FSDP / DeepSpeed settings, and the sharding of the networks, that "
                              "it was written with")
    if saved is not None and doc["num_processes"] != loop.accelerator.num_processes:
        raise CheckpointError(f"{where} holds sharded states of {doc['num_processes']} process(es); this run "
                              f"has {loop.accelerator.num_processes}: hookloop resumes a sharded checkpoint "
                              "on the number of processes that wrote it")


def owner(rel: str) -> int | None:
    """The rank that wrote shard file ``rel`` (by its name), or None."""
    match = _OWNED.search(rel)
    return None if match is None else int(next(g for g in match.groups() if g is not None))


# -- the shards ------------------------------------------------------------------------------


def save_sharded(loop, tmp: Path, sharding: dict) -> dict:
    """Every rank, after ``save_state``: write the networks the user sharded,
    then fsync and checksum the shard files this rank wrote:
    ``{rel: (size, crc32)}``."""
    from torch.distributed.checkpoint import state_dict_saver  # dcp.save, as its module exports it

    for name in sharding["networks"]:
        net, folder = loop.networks[name], tmp / DCP_DIR / name
        state_dict_saver.save(_dcp_state(net), checkpoint_id=str(folder))
        if net.scheduler is not None and loop.accelerator.is_main_process:
            torch.save(net.scheduler.state_dict(), folder / "scheduler.bin")
    own = {}
    for file in sorted(tmp.rglob("*")):
        rel = file.relative_to(tmp).as_posix()
        if file.is_file() and owner(rel) == loop.accelerator.process_index:
            own[rel] = synced_sum(file)
    return own


def gather(acc, own: dict, sharding: dict) -> dict:
    """Every rank: each rank's checksummed files, to the main process
    (``known``: ``{rel: (size, crc)}``), and ``sharding.shards`` for the manifest."""
    from accelerate.utils import gather_object

    parts = gather_object([(acc.process_index, own)]) if acc.num_processes > 1 else [(0, own)]
    return {"known": {rel: v for _, files in parts for rel, v in files.items()},
            "manifest": {**sharding, "shards": {str(r): sorted(f) for r, f in parts}}}


def _dcp_state(net) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if net.optimizer is None:
        return {"model": get_model_state_dict(net.model)}
    model_state, optimizer_state = get_state_dict(net.model, net.optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


@dataclass
class Sharded:
    """What staging verified of a sharded checkpoint, for the commit."""

    doc: dict
    #: network -> its DCP scheduler's state
    schedulers: dict = field(default_factory=dict)
    #: DCP folder -> its ``.metadata``, read safely
    metadata: dict = field(default_factory=dict)


def stage_sharded(folder, rank: int) -> Sharded:
    """Verify this rank's share of a sharded checkpoint (a
    :class:`~.stage.Folder`): every DCP ``.metadata`` (read safely), the
    shard files it wrote and (rank 0) every other file the plain staging does
    not read, and the non-tensor items of its shards (``weights_only=True``)."""
    doc = folder.doc
    out = Sharded(doc["sharding"])
    for part in sorted({rel.rsplit("/", 1)[0] for rel in doc["files"] if rel.endswith("/.metadata")}):
        out.metadata[part] = folder.metadata(part)
    for rel in sorted(doc["files"]):
        if (("/" not in rel and (rel == TENSORS_FILE or accel.SMALL_FILE.match(rel) or rel.startswith("hookloop-rank")))
                or (owner(rel) or 0) != rank or rel.endswith("/.metadata")):
            continue  # (read by the rest of staging, each rank its own; or another rank's)
        part = rel.rsplit("/", 1)[0] if "/" in rel else None
        with folder.open(rel, f"a shard of {part}" if part else f"the sharded state file {rel}") as opened:
            if rel.endswith(".distcp") and part in out.metadata:
                _check_items(out.metadata[part], rel, opened, folder.where)
    for name in out.doc["networks"]:
        if (rel := f"{DCP_DIR}/{name}/scheduler.bin") in doc["files"]:
            out.schedulers[name] = folder.torch(rel, f"the scheduler state of network {name!r}")
    return out


def restore_dcp(loop, staged, apply) -> None:
    """The networks the user sharded, from their DCP folders."""
    from torch.distributed.checkpoint import state_dict_loader  # dcp.load, as its module exports it
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    def load(net, folder, scheduler_state):
        state = _dcp_state(net)
        state_dict_loader.load(state, checkpoint_id=str(folder))  # its non-tensor items: verified in staging
        if net.optimizer is not None:
            set_state_dict(net.model, net.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        else:
            set_model_state_dict(net.model, state["model"])
        if net.scheduler is not None and scheduler_state is not None:
            net.scheduler.load_state_dict(scheduler_state)

    for name in staged.sharded.doc["networks"]:
        apply(f"the sharded state of network {name!r}", f"{DCP_DIR}/{name}",
              lambda n=name: load(loop.networks[n], staged.path / DCP_DIR / n, staged.sharded.schedulers.get(n)))


def dcp_shapes(loop, sharded: Sharded) -> list:
    """``(saved shapes, the models' shapes, network, rel)`` of each DCP
    ``.metadata`` whose shapes are compared (what the safetensors headers
    are for the plain format)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    out, expected = [], of_manifest(sharded.doc).shapes(loop)
    for name in sharded.doc["networks"]:
        if not isinstance(loop.networks[name].model, FullyShardedDataParallel):
            expected[f"{DCP_DIR}/{name}"] = ("model.", tensor_shapes(loop.networks[name].model), name)
    for part, (prefix, shapes, network) in expected.items():
        if part in sharded.metadata:
            saved = {k[len(prefix):]: tuple(v.size) for k, v in sharded.metadata[part].state_dict_metadata.items()
                     if k.startswith(prefix) and getattr(v, "size", None) is not None}
            out.append((saved, shapes, network, f"{part}/.metadata"))
    return out


def tensor_shapes(model) -> dict:
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


_ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
            ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
_ALLOWED |= {(m, c) for m in ("pathlib", "pathlib._local")  # (Python 3.13: pathlib._local)
             for c in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata``: its own classes, ``torch.Size``, dtypes, paths; nothing else."""

    def find_class(self, module, name):
        import torch.distributed.checkpoint.metadata as meta

        if module == meta.__name__ and isinstance(getattr(meta, name, None), type):
            return getattr(meta, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}")


def load_metadata(data: bytes, rel: str, where: str):
    """A DCP ``.metadata`` from its bytes, safely (:class:`_MetadataUnpickler`)."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        metadata.state_dict_metadata.items()
        return metadata
    except Exception as exc:  # noqa: BLE001 - garbled, or not DCP's
        raise CheckpointError(f"{where}: cannot read {rel}: it is not the metadata of a "
                              f"torch.distributed.checkpoint folder ({type(exc).__name__}: "
                              f"{first_line(exc)}), and hookloop never unpickles other objects") from None


def _check_items(metadata, rel, opened, where) -> None:
    """The non-tensor items (param groups, numbers) stored in shard ``rel``
    each deserialise with ``weights_only=True`` (DCP reads them with
    ``weights_only=False``)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    name, kinds = rel.rsplit("/", 1)[1], metadata.state_dict_metadata
    for index, info in (metadata.storage_data or {}).items():
        if info.relative_path != name or not isinstance(kinds.get(index.fqn), BytesStorageMetadata):
            continue
        if info.transform_descriptors:
            raise CheckpointError(f"{where}: {rel} stores {index.fqn!r} through storage transforms "
                                  f"({info.transform_descriptors}), which hookloop does not verify")
        accel.torch_load(opened.read_at(info.offset, info.length), rel, where, f"the item {index.fqn!r}")
