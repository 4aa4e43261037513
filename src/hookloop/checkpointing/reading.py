"""Reading a checkpoint into memory, each file opened once and verified as it
is read, nothing in the loop changed yet: the one reader of Accelerate's files
(:class:`Folder`, :func:`read_accelerate`) for a hookloop checkpoint
(:func:`stage`), a script's ``save_state`` folder (:func:`stage_script`) and
the weights of either (:func:`read_weights`).

A hookloop checkpoint's files are checked against its manifest: the size when
opened, then the CRC-32 over a memory map of the same descriptor, before
anything parses it (the pages are read from storage once: the weights are
tensors over that memory, an optimizer's state is read through the same
descriptor from the page cache), and checked finite unless the manifest records that
the save checked them (its checksums then prove they are what was checked:
nothing is checked twice). One thread, in reading order: a load takes no
core from training or another process. A script's folder has
no manifest: its files are read bounded by their size, confined to the
folder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from . import accelerate as accel
from . import formats, manifest, safe_read
from .codec import check_rng, from_data, parse_rank_file
from .errors import CheckpointError, first_line
from .finite import check_staged_finite
from .layout import RANK_FILE, STATE_FILE, TENSORS_FILE


@dataclass
class Staged:
    """One process's view of a checkpoint, read, verified and deserialised
    into memory: nothing in the loop changed yet."""

    path: Path
    doc: dict
    process_index: int
    models: list = field(default_factory=list)
    optimizers: list = field(default_factory=list)
    schedulers: list = field(default_factory=list)
    rng: dict = field(default_factory=dict)
    scaler: dict | None = None
    extra: dict = field(default_factory=dict)  # other Accelerate files (sampler, stateful loader): bytes
    custom: dict = field(default_factory=dict)  # custom_checkpoint_<i>.pkl -> ("data", state) | ("pickle", bytes)
    epoch_start: dict | None = None
    generators: dict = field(default_factory=dict)
    plugin_states: dict = field(default_factory=dict)
    #: this process's loop.log(on_epoch=True) values of the epoch so far
    logged: dict = field(default_factory=dict)
    #: whose per-process files were read: this process's, or rank 0's for a
    #: rank the checkpoint has none of (it was written by fewer processes)
    source_rank: int = 0
    #: a sharded format's verified share (:func:`~.formats.stage_sharded`); None: plain
    sharded: formats.Sharded | None = None


class Folder:
    """The files of one checkpoint folder, each opened once: checked against
    the manifest ``doc`` (size, CRC-32), or without one (a script's folder)
    bounded by the size it has."""

    def __init__(self, path, doc: dict | None = None):
        self.path, self.doc, self.where = Path(path), doc, f"checkpoint {str(path)!r}"
        if doc is None:
            safe_read.check_folder(self.path)
        self.names = set(doc["files"]) if doc is not None else {
            p.name for p in self.path.iterdir() if p.is_file() or p.is_symlink()}
        self._metadata: dict = {}

    def has(self, rel: str) -> bool:
        return rel in self.names

    def _open(self, rel: str, what: str) -> tuple[safe_read.Opened, int | None]:
        """``rel`` opened once, its size checked; the CRC-32 it must have (None: none recorded)."""
        if self.doc is None:
            if rel not in self.names:
                raise CheckpointError(f"{self.where} holds no {what} ({rel})")
            file = self.path / rel
            return safe_read.open_checked(file, self.path, limit=safe_read.file_size(file, self.path, what),
                                          what=what), None
        return manifest.verified(self.path, rel, self.doc, self.where, what)

    def _check(self, rel: str, what: str, expected: int | None, now: int) -> None:
        if expected is not None and now != expected:
            raise manifest.checksum_error(self.where, what, rel, now, expected)

    def open(self, rel: str, what: str) -> safe_read.Opened:
        """``rel`` opened once, its size and CRC-32 (over a memory map) checked."""
        opened, crc = self._open(rel, what)
        if crc is not None:
            try:
                self._check(rel, what, crc, safe_read.crc32_of(opened.mmap(private=False)))
            except CheckpointError:
                opened.close()
                raise
        return opened

    def torch(self, rel: str, what: str):
        """``torch.load`` of ``rel``, checksummed as it reads it (each byte once:
        :class:`~.safe_read.ChecksummingReader`); a file that does not match its
        checksum is that error, whatever the unpickler made of it."""
        opened, crc = self._open(rel, what)
        with opened:
            if crc is None:
                return accel.torch_load(opened, rel, self.where, what)
            reader = safe_read.ChecksummingReader(opened)
            try:
                state = accel.torch_load(reader, rel, self.where, what)
            except CheckpointError:
                self._check(rel, what, crc, reader.checksum())  # (corrupt on disk: say so)
                raise
            self._check(rel, what, crc, reader.checksum())
            return state

    def tensors(self, rel: str, what: str) -> dict:
        with self.open(rel, what) as opened:
            if rel.endswith(".safetensors"):
                return accel.safetensors_load(opened, rel, self.where, what)
            state = accel.torch_load(opened, rel, self.where, what)  # pytorch_model.bin
        if not isinstance(state, dict):
            raise CheckpointError(f"{self.where}: cannot read {what} from {rel}: not a state dict")
        return state

    def bytes(self, rel: str, what: str) -> bytes:
        opened, crc = self._open(rel, what)
        with opened:
            data = opened.read()
        self._check(rel, what, crc, safe_read.crc32(data))
        return data

    def metadata(self, part: str):
        """The DCP ``.metadata`` of folder ``part``, read once, safely."""
        if part not in self._metadata:
            rel = f"{part}/.metadata"
            data = self.bytes(rel, "the metadata of a sharded state")
            self._metadata[part] = formats.load_metadata(data, rel, self.where)
        return self._metadata[part]

    def model_file(self, i: int) -> str:
        rel, legacy = accel.model_file(i), accel.legacy_model_file(i)
        return legacy if not self.has(rel) and self.has(legacy) else rel


def read_accelerate(folder: Folder, staged: Staged, counts: dict, label: dict, models: bool = True) -> Staged:
    """Accelerate's files of ``folder`` that ``staged``'s process needs, into
    it: the models and optimizers (``models``: the plain format's),
    ``counts["schedulers"]`` schedulers, the random states of
    ``staged.source_rank``, the scaler, the loader files and the registered
    objects' states. ``label``: file -> what it holds."""
    where = folder.where
    staged.models = [folder.tensors(rel, label.get(rel, f"the weights of accelerator model #{i}"))
                     for i in range(counts["models"] if models else 0) for rel in [folder.model_file(i)]]
    for i in range(counts["optimizers"] if models else 0):
        rel = accel.optimizer_file(i)
        what = label.get(rel, f"the state of accelerator optimizer #{i}")
        state = folder.torch(rel, what)
        if not (isinstance(state, dict) and isinstance(state.get("state"), dict)
                and isinstance(state.get("param_groups"), list)):
            raise CheckpointError(f"{where}: cannot read {what} from {rel}: it is not an optimizer state_dict "
                                  "(no 'state' and 'param_groups')")
        staged.optimizers.append(state)
    checked = folder.doc is not None and folder.doc.get("crc32") and (folder.doc.get("checks") or {}).get("finite")
    if not checked:  # (a script's folder, or a checkpoint whose save did not check)
        check_staged_finite(staged.models, staged.optimizers, where)
    staged.schedulers = [folder.torch(rel, label.get(rel, f"the state of accelerator scheduler #{i}"))
                         for i in range(counts["schedulers"]) for rel in [accel.scheduler_file(i)]]
    rel, what = accel.rng_file(staged.source_rank), f"the random states of process {staged.source_rank}"
    rng = staged.rng = folder.torch(rel, what)
    try:
        check_rng(rng["random_state"], rng["numpy_random_seed"], rng["torch_manual_seed"])
    except Exception as exc:  # noqa: BLE001 - any invalid content
        raise CheckpointError(f"{where}: cannot read {what} from {rel}: they are not valid random states "
                              f"({type(exc).__name__}: {first_line(exc)})") from exc
    if folder.has(accel.SCALER_FILE):
        staged.scaler = folder.torch(accel.SCALER_FILE, "the gradient scaler state")
    staged.extra = {rel: folder.bytes(rel, "a data loader state") for rel in sorted(folder.names)
                    if accel.LOADER_FILE.match(rel)}
    for i in range(counts.get("custom_objects", 0)):
        rel = accel.custom_file(i)
        what = f"the state of object #{i} registered with accelerator.register_for_checkpointing"
        data = folder.bytes(rel, what)
        try:
            staged.custom[rel] = ("data", accel.torch_load(data, rel, where, what))
        except CheckpointError:
            staged.custom[rel] = ("pickle", data)  # (refused at the load, unless trusted by name)
    return staged


def labels(networks: dict) -> dict:
    """file -> what it holds, from ``{network: {model, optimizer, scheduler}}``."""
    return {entry[part]: f"the weights of network {name!r}" if part == "model"
            else f"the {part} state of network {name!r}"
            for name, entry in networks.items() if isinstance(entry, dict)
            for part in ("model", "optimizer", "scheduler") if entry.get(part)}


def stage(path, doc: dict | None = None, process_index: int | None = None) -> Staged:
    """Read every file of hookloop checkpoint ``path`` that process
    ``process_index`` needs into memory, each verified as it is read and
    deserialised (safetensors, or ``torch.load(weights_only=True)``), its
    random states tried on scratch generators, its weights and optimizer
    state checked finite; a :class:`CheckpointError` naming the file
    otherwise. Changes nothing. ``doc``: its manifest, already read."""
    path = Path(path)
    doc = manifest.read_manifest(path) if doc is None else doc
    folder = Folder(path, doc)
    rank = accel.process_index() if process_index is None else process_index
    try:
        # a rank the checkpoint has no files of (it was written by fewer processes) reads rank 0's
        staged = Staged(path, doc, rank, source_rank=rank if rank < doc["num_processes"] else 0)
        sharding = doc.get("sharding")
        staged.sharded = formats.stage_sharded(folder, rank) if sharding is not None else None
        plain = sharding is None or sharding["accelerate"]["format"] == formats.PLAIN
        counts = {**doc["accelerate"], **({"schedulers": sharding["scheduler_files"]} if sharding and not plain
                                          else {})}
        read_accelerate(folder, staged, counts, labels(doc["networks"]), models=plain)
        staged.epoch_start, staged.generators, staged.logged = read_rank_file(folder, staged.source_rank)
        tensors = folder.tensors(TENSORS_FILE, "the plugin states") if folder.has(TENSORS_FILE) else {}
        for name, state in doc["plugins"].items():
            try:
                staged.plugin_states[name] = from_data(state, tensors)
            except (KeyError, TypeError, AttributeError, ValueError) as exc:
                raise CheckpointError(f"{folder.where}: the state of plugin {name!r} refers to tensors that "
                                      f"{TENSORS_FILE} does not hold ({type(exc).__name__}: {exc})") from exc
        return staged
    except CheckpointError:
        raise
    except (TypeError, KeyError, AttributeError, IndexError, RecursionError, ValueError) as exc:
        # a manifest of the right format and checksum whose content is not what
        # hookloop writes (a hostile or hand-made one): not a crash of the loop
        raise CheckpointError(f"checkpoint {str(path)!r}: its {STATE_FILE} is not hookloop's "
                              f"({type(exc).__name__}: {first_line(exc)})") from None


def read_rank_file(folder: Folder, rank: int) -> tuple:
    """``(epoch_start, generators, logged)`` of process ``rank``'s rank file."""
    rel, what = RANK_FILE.format(rank=rank), f"the data position of process {rank}"
    data = folder.bytes(rel, what)
    try:
        return parse_rank_file(data)
    except Exception as exc:  # noqa: BLE001 - garbled in any way
        raise CheckpointError(f"{folder.where}: cannot read {what} from {rel}: {type(exc).__name__}: "
                              f"{first_line(exc)}") from exc


def _held(folder: Folder, pattern: str) -> list[int]:
    """The numbers ``i`` of the files of ``folder`` named by ``pattern``
    (``model_<i>.safetensors`` ...: the first is 0)."""
    return sorted({int(next((g for g in m.groups() if g is not None), 0))
                   for name in folder.names if (m := re.match(pattern, name))})


def stage_script(loop, folder: Folder, strict: bool) -> tuple[Staged, list[str]]:
    """This process's files of a script's ``save_state`` folder read, checked
    against the loop (tensor names and shapes, how many of each object) and
    deserialised, nothing changed yet; and warnings (``strict=False``: files
    this loop has no object for)."""
    acc, where, notes = loop.accelerator, folder.where, []
    if formats.describe(loop) is not None:
        raise CheckpointError(f"{where}: continuing an accelerator.save_state folder is supported for "
                              f"unsharded runs; this one saves {formats.of_accelerator(acc).name}: load it "
                              "with accelerator.load_state, then build the Loop with prepare=False")
    networks, plain = formats.describe_networks(loop), formats.Plain()
    have = {"model": len(accel.models(acc)), "optimizer": len(accel.optimizers(acc)),
            "scheduler": len(accel.scheduler_objects(acc))}
    for part, pattern in (("model", r"^(?:model(?:_(\d+))?\.safetensors|pytorch_model(?:_(\d+))?\.bin)$"),
                          ("optimizer", r"^optimizer(?:_(\d+))?\.bin$"), ("scheduler", r"^scheduler(?:_(\d+))?\.bin$")):
        numbers = _held(folder, pattern)
        if [i for i in numbers if i >= have[part]]:
            name = folder.model_file if part == "model" else (lambda i, p=part: plain.file(p, i))
            msg = (f"{where} holds {len(numbers)} {part}(s) ({', '.join(map(name, numbers))}); this loop has "
                   f"{have[part]}")
            if strict:
                raise CheckpointError(msg + ": build the Loop with the script's models, optimizers and "
                                            "schedulers, in the order it prepared them")
            notes.append(msg + ": the others are not loaded")
    rank, written_by = acc.process_index, _held(folder, r"^random_states_(\d+)\.pkl$")
    if not folder.has(accel.rng_file(rank)):
        raise CheckpointError(f"{where} holds no random states of process {rank} ({accel.rng_file(rank)}): it "
                              f"was written by {len(written_by)} process(es), this run has {acc.num_processes}: "
                              "continue it on as many processes as wrote it")
    if len(written_by) != acc.num_processes:
        msg = (f"{where} was written by {len(written_by)} process(es), this run has {acc.num_processes}: the "
               "data is cut otherwise, and the position is the script's, not the same examples")
        if strict:
            raise CheckpointError(msg + "; continue it on as many processes (or strict=False)")
        notes.append(msg)
    label = labels(networks)
    for i in range(have["model"]):
        if not (folder.has(accel.model_file(i)) or folder.has(accel.legacy_model_file(i))):
            what = label.get(accel.model_file(i), f"the weights of accelerator model #{i}")
            raise CheckpointError(f"{where} holds no {what} ({accel.model_file(i)} or {accel.legacy_model_file(i)})")
    counts = {"models": have["model"], "optimizers": have["optimizer"], "schedulers": have["scheduler"],
              "custom_objects": len(accel.custom_objects(acc))}
    staged = read_accelerate(folder, Staged(folder.path, {"accelerate": accel.counts(acc), "files": {}}, rank,
                                            source_rank=rank), counts, label)
    staged.models = match_models(staged.models, accel.models(acc), networks, where)
    if staged.scaler is None and acc.scaler is not None:
        notes.append(f"{where} holds no {accel.SCALER_FILE}: the gradient scaler starts fresh")
    unclaimed = [accel.custom_file(i) for i in _held(folder, r"^custom_checkpoint_(\d+)\.pkl$")
                 if i >= counts["custom_objects"]]
    if unclaimed:
        notes.append(f"{where}: {', '.join(unclaimed)} (objects the script registered with "
                     "accelerator.register_for_checkpointing) not loaded: no object of this loop's "
                     "accelerator is registered to receive them")
    return staged, notes


def read_weights(folder: Folder, networks: dict) -> dict:
    """Each network's weights (``networks``: name -> its model's file), verified."""
    return {name: folder.tensors(rel, f"the weights of network {name!r}") for name, rel in networks.items()}


def match_weights(state: dict, model, network: str, where: str) -> dict:
    """``state``, a checkpoint's weights for ``model``, under the tensor names
    ``model`` uses (a compiled model's or its eager model's, whichever the
    checkpoint has: :func:`~.accelerate.in_model_names`), its names and
    shapes checked against the model's (:func:`compare_shapes`). What is
    loaded into ``model`` is what this returns."""
    expected = model.state_dict()
    state = accel.in_model_names(state, expected)
    compare_shapes({k: tuple(v.shape) for k, v in state.items()}, expected, network, where)
    return state


def fitting_weights(state: dict, model) -> tuple[dict, dict]:
    """What of ``state`` (a checkpoint's weights) fits ``model``: the
    tensors of the model's names (:func:`match_weights`' renaming) and
    shapes, and ``{"missing", "unexpected", "mismatched"}``: the model's
    tensors the checkpoint lacks (a tied tensor's second name aside), the
    checkpoint's the model lacks, and ``name: (checkpoint shape, model
    shape)`` of those whose shapes differ (``load_state_dict(strict=False)``
    and transformers' ``ignore_mismatched_sizes=True``)."""
    expected = model.state_dict()
    state = accel.in_model_names(state, expected)
    mismatched = {k: (list(v.shape), list(expected[k].shape)) for k, v in state.items()
                  if k in expected and tuple(v.shape) != tuple(expected[k].shape)}
    fits = {k: v for k, v in state.items() if k in expected and k not in mismatched}
    loaded = {expected[k].data_ptr() for k in fits}  # (safetensors keeps one name of tied tensors)
    report = {"missing": [k for k, t in expected.items() if k not in state and t.data_ptr() not in loaded],
              "unexpected": [k for k in state if k not in expected], "mismatched": mismatched}
    return fits, report


def match_models(states: list, models: list, networks: dict, where: str) -> list:
    """The staged weights of the accelerator's ``models`` (in order), each
    through :func:`match_weights`; ``networks``: the run's files of each
    network (:func:`~.formats.describe_networks`), to name them."""
    owner = {entry["model"]: name for name, entry in networks.items()}
    return [match_weights(state, model, owner.get(accel.model_file(i), f"accelerator model #{i}"), where)
            for i, (state, model) in enumerate(zip(states, models))]


def compare_shapes(saved: dict, expected: dict, network: str, where: str, rel: str = "") -> None:
    """``saved`` (tensor name -> shape) against ``expected`` (a model's
    ``state_dict()``, or name -> shape): the same names (a tied tensor's second
    name may be missing) and shapes, or a :class:`CheckpointError` naming the tensor."""
    now = {k: tuple(v.shape) if hasattr(v, "shape") else tuple(v) for k, v in expected.items()}
    there = f"the checkpoint ({rel})" if rel else "the checkpoint"

    def show(key):
        return key[len("module."):] if key.startswith("module.") else key

    for key, shape in saved.items():
        if key not in now:
            raise CheckpointError(f"{where}: network {network!r} has a tensor {show(key)!r} (shape "
                                  f"{list(shape)}) in {there} that this model does not have: a model of "
                                  "another architecture?")
        if now[key] != tuple(shape):
            raise CheckpointError(f"{where}: network {network!r} tensor {show(key)!r} has shape {list(shape)} "
                                  f"in {there} but {list(now[key])} in this model")
    saved_ptrs = {expected[k].data_ptr() for k in saved if hasattr(expected[k], "data_ptr")}
    for key, tensor in expected.items():  # (safetensors drops the second name of a tied tensor)
        if key not in saved and not (hasattr(tensor, "data_ptr") and tensor.data_ptr() in saved_ptrs):
            raise CheckpointError(f"{where}: network {network!r} tensor {show(key)!r} is not in {there}: a "
                                  "model of another architecture?")
