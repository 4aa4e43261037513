"""Reading a checkpoint into memory and checking that it fits the loop, each
file opened once, nothing in the loop changed yet.

- Before any file is read, on the manifest: the format, the networks, the
  optimizer and scheduler classes, the objects prepared on the accelerator,
  the run settings that decide the data order and the step count
  (:func:`run_settings`; :mod:`.elastic` plans another cut of the global
  batch) and the stateful plugins (:func:`check_resume`).
- Reading (:class:`Folder`, :func:`stage`): each file's size checked when it
  is opened, its CRC-32 over a memory map of that descriptor, then parsed by
  its library (safetensors, ``torch.load(weights_only=True)``), checked finite
  unless the manifest records that the save checked it; a script's
  ``save_state`` folder, which has no manifest, bounded by its files' sizes
  (:func:`stage_script`).
- On what was read: tensor names and shapes against the models
  (:func:`weights_report`, the one comparison), the optimizer states against
  the optimizers, the registered objects' states.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..batches import length_of, loader_batch_size
from ..rng import generator_roles, innermost_sampler
from . import accelerate as accel
from . import elastic, formats, manifest, store
from .codec import check_rng, from_data, parse_rank_file, stateful_plugins
from .errors import CheckpointError, first_line
from .finite import check_staged_finite
from .store import RANK_FILE, STATE_FILE, TENSORS_FILE

#: torch optimizer state entries that have their parameter's shape
_PER_PARAMETER = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                  "grad_avg", "acc_delta", "exp_inf", "prev", "sum", "ax", "mu_product_buffer"}


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
            store.check_folder(self.path)
        self.names = set(doc["files"]) if doc is not None else {
            p.name for p in self.path.iterdir() if p.is_file() or p.is_symlink()}
        self._metadata: dict = {}

    def has(self, rel: str) -> bool:
        return rel in self.names

    def open(self, rel: str, what: str) -> store.Opened:
        """``rel`` opened once, its size and CRC-32 checked (a script's: bounded)."""
        if self.doc is not None:
            return manifest.verified(self.path, rel, self.doc, self.where, what)
        if rel not in self.names:
            raise CheckpointError(f"{self.where} holds no {what} ({rel})")
        file = self.path / rel
        return store.open_checked(file, self.path, limit=store.file_size(file, self.path, what), what=what)

    def torch(self, rel: str, what: str):
        with self.open(rel, what) as opened:
            return accel.torch_load(opened, rel, self.where, what)

    def safetensors(self, rel: str, what: str) -> tuple[dict, dict]:
        with self.open(rel, what) as opened:
            return accel.safetensors_load(opened, rel, self.where, what)

    def tensors(self, rel: str, what: str) -> dict:
        if rel.endswith(".safetensors"):
            return self.safetensors(rel, what)[0]
        state = self.torch(rel, what)  # pytorch_model.bin
        if not isinstance(state, dict):
            raise CheckpointError(f"{self.where}: cannot read {what} from {rel}: not a state dict")
        return state

    def bytes(self, rel: str, what: str) -> bytes:
        with self.open(rel, what) as opened:
            return opened.read()

    def metadata(self, part: str):
        """The DCP ``.metadata`` of folder ``part``, read once, safely."""
        if part not in self._metadata:
            rel = f"{part}/.metadata"
            self._metadata[part] = formats.load_metadata(self.bytes(rel, "the metadata of a sharded state"),
                                                         rel, self.where)
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
    if not (folder.doc is not None and (folder.doc.get("checks") or {}).get("finite")):
        check_staged_finite(staged.models, staged.optimizers, where)  # (a script's folder, or an unchecked save)
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
    ``process_index`` needs into memory, each verified before it is
    deserialised, its random states tried on scratch generators, its weights
    and optimizer state checked finite; a :class:`CheckpointError` naming the
    file otherwise. Changes nothing. ``doc``: its manifest, already read."""
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
    tensors, meta = folder.safetensors(rel, what)
    try:
        return parse_rank_file(tensors, meta)
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


# -- does it fit: the manifest ------------------------------------------------------------


def run_settings(loop) -> dict:
    """What decides the data order and the step count of ``loop``'s run, as
    recorded in every checkpoint (``settings``) and compared on resume.
    None: unknown (not compared)."""
    acc, data = loop.accelerator, loop.train_data
    config = getattr(acc, "dataloader_config", None)
    out = {
        "num_processes": acc.num_processes,
        # as the Loop was built: a plugin may change it during a run (an
        # accumulation schedule), and a resume is compared before any fit starts
        "gradient_accumulation_steps": getattr(loop, "configured_accumulation", acc.gradient_accumulation_steps),
        "batches_per_epoch": length_of(data),
        "batch_size": loader_batch_size(data),
        "dataset_length": length_of(getattr(data, "dataset", None)),
        "sampler": None if (sampler := innermost_sampler(data)) is None else type(sampler).__name__,
        "drop_last": getattr(data, "drop_last", None),
    }
    for key in ("use_seedable_sampler", "data_seed", "split_batches", "even_batches", "dispatch_batches"):
        value = getattr(config, key, None)
        out[key] = value if isinstance(value, (bool, int, str)) else None
    # the cut of the global batch, and where the epoch is in its global order
    size = out["batch_size"]
    per_batch = None if size is None else size if out["split_batches"] is True else size * acc.num_processes
    out["examples_per_batch"] = per_batch
    out["global_batch_size"] = per_batch * out["gradient_accumulation_steps"] if per_batch is not None else None
    out["examples_in_epoch"] = loop.state.step_in_epoch * per_batch if per_batch is not None else None
    roles = generator_roles(data)  # which generator draws the shuffle (another loader redraws it)
    out["sampler_generator"], out["loader_generator"] = roles["sampler"], roles["loader"]
    return out


def check_resume(loop, path, doc: dict, networks: dict, strict: bool) -> tuple[list[str], elastic.Plan]:
    """Everything that must match before a file is read (``networks``: the
    run's files of each network, :func:`~.formats.describe_networks`), and
    where the checkpoint continues (:class:`~.elastic.Plan`). Returns the
    warnings to give (non-strict mismatches, a mapped position) and the plan."""
    where = f"checkpoint {str(path)!r}"
    formats.check_resume(loop, doc, where)  # the same format (and, sharded, processes)
    acc, saved = loop.accelerator, doc["networks"]
    if list(saved) != list(loop.networks):
        raise CheckpointError(f"{where} holds networks {list(saved)}; this loop has {list(loop.networks)}")
    for name, entry in networks.items():
        for part in ("model", "optimizer", "scheduler"):
            if (entry[part] is None) != (saved[name].get(part) is None):
                here, there = ("the checkpoint", "this loop") if entry[part] is None else ("this loop",
                                                                                           "the checkpoint")
                raise CheckpointError(f"{where}: network {name!r} has a {part} in {here} but not in {there}")
    if accel.counts(acc) != doc["accelerate"]:
        raise CheckpointError(f"{where} was written with {doc['accelerate']} objects prepared on the "
                              f"accelerator; this run has {accel.counts(acc)}")
    classes = doc.get("classes") or {}
    for name, net in loop.networks.items():
        for part in ("optimizer", "scheduler"):
            file = networks[name][part]
            if file is None or file not in classes or classes[file] == (now := accel.class_name(getattr(net, part))):
                continue
            raise CheckpointError(
                f"{where}: network {name!r}: {file} holds the state of a {classes[file].rsplit('.', 1)[-1]} "
                f"{part} ({classes[file]}), but this network's {part} is a {now.rsplit('.', 1)[-1]} ({now}): the "
                f"state of one does not fit the other. Resume with the {part} the checkpoint was written with")
    plan = elastic.plan(loop, path, doc, run_settings(loop), strict)
    return plan.messages + _check_plugins(loop, doc, where, strict), plan


def _check_plugins(loop, doc: dict, where: str, strict: bool) -> list[str]:
    messages = []
    saved, current = set(doc["plugins"]), dict(stateful_plugins(loop))
    only_saved, only_now = sorted(saved - set(current)), sorted(set(current) - saved)
    if only_saved:
        msg = (f"{where} holds the state of plugin(s) {', '.join(map(repr, only_saved))}, which "
               f"this loop does not run (stateful plugins now: {', '.join(map(repr, current)) or 'none'})")
        if strict:
            raise CheckpointError(msg + ": add them, or pass strict=False to drop their state")
        messages.append(msg + ": their state is not restored")
    if only_now:
        msg = (f"plugin(s) {', '.join(map(repr, only_now))} have state (state_dict/load_state_dict) "
               f"but {where} has none for them (it was written without them)")
        if strict:
            raise CheckpointError(msg + ": pass strict=False to start them fresh")
        messages.append(msg + ": they start fresh")
    return messages


# -- does it fit: what was read --------------------------------------------------------------


def weights_report(saved: dict, expected: dict) -> dict:
    """``saved`` (tensor name -> tensor or shape) against ``expected`` (a
    model's ``state_dict()``, or name -> shape): ``unexpected`` (in
    ``saved`` only), ``mismatched`` (``name: (saved shape, expected shape)``)
    and ``missing`` (in ``expected`` only; the second name of a tied tensor,
    which safetensors stores once, is not missing)."""
    def shape(v):
        return list(v.shape) if hasattr(v, "shape") else list(v)

    report: dict = {"unexpected": [], "mismatched": {}, "missing": []}
    for key, value in saved.items():
        if key not in expected:
            report["unexpected"].append(key)
        elif shape(value) != shape(expected[key]):
            report["mismatched"][key] = (shape(value), shape(expected[key]))
    loaded = {expected[k].data_ptr() for k in saved if k in expected and hasattr(expected[k], "data_ptr")}
    report["missing"] = [k for k, t in expected.items()
                         if k not in saved and not (hasattr(t, "data_ptr") and t.data_ptr() in loaded)]
    return report


def refuse_misfit(report: dict, saved: dict, network: str, where: str, rel: str = "") -> None:
    """A :class:`CheckpointError` naming the first tensor of ``report``
    (:func:`weights_report`) that does not fit, if any."""
    there = f"the checkpoint ({rel})" if rel else "the checkpoint"

    def show(key):
        return key.removeprefix("module.")

    for key in saved:
        if key in report["unexpected"]:
            shape = list(getattr(saved[key], "shape", saved[key]))
            raise CheckpointError(f"{where}: network {network!r} has a tensor {show(key)!r} (shape {shape}) in "
                                  f"{there} that this model does not have: a model of another architecture?")
        if key in report["mismatched"]:
            was, now = report["mismatched"][key]
            raise CheckpointError(f"{where}: network {network!r} tensor {show(key)!r} has shape {was} in {there} "
                                  f"but {now} in this model")
    if report["missing"]:
        raise CheckpointError(f"{where}: network {network!r} tensor {show(report['missing'][0])!r} is not in "
                              f"{there}: a model of another architecture?")


def match_weights(state: dict, model, network: str, where: str) -> dict:
    """``state``, a checkpoint's weights for ``model``, under the tensor names
    ``model`` uses (a compiled model's or its eager model's, whichever the
    checkpoint has), checked to fit it name by name and shape by shape."""
    expected = model.state_dict()
    state = accel.in_model_names(state, expected)
    refuse_misfit(weights_report(state, expected), state, network, where)
    return state


def match_models(states: list, models: list, networks: dict, where: str) -> list:
    """The staged weights of the accelerator's ``models`` (in order), each
    through :func:`match_weights`; ``networks``: the run's files of each."""
    owner = {entry["model"]: name for name, entry in networks.items()}
    return [match_weights(state, model, owner.get(accel.model_file(i), f"accelerator model #{i}"), where)
            for i, (state, model) in enumerate(zip(states, models))]


def check_shapes(loop, staged: Staged, networks: dict, where: str) -> None:
    """The tensor names and shapes of the staged models (or, sharded, in
    DCP's metadata) against the loop's; the staged weights put under the
    names of the models they are restored into."""
    for saved, shapes, network, rel in formats.dcp_shapes(loop, staged.sharded) if staged.sharded else ():
        refuse_misfit(weights_report(saved, shapes), saved, network, where, rel)
    staged.models = match_models(staged.models, accel.models(loop.accelerator), networks, where)


def check_optimizers(loop, staged: Staged, networks: dict, where: str) -> None:
    """Each saved optimizer state fits its optimizer: its param groups and
    per-parameter shapes (after the plugins' early restores)."""
    names = {entry["optimizer"]: name for name, entry in networks.items() if entry.get("optimizer")}
    for i, opt in enumerate(accel.optimizers(loop.accelerator)[:len(staged.optimizers)]):  # sharded: none
        rel, inner = accel.optimizer_file(i), getattr(opt, "optimizer", opt)
        network, state, cls = names.get(rel, f"#{i}"), staged.optimizers[i], type(inner).__name__
        saved_sizes = [len(g.get("params", ())) for g in state["param_groups"]]
        now_sizes = [len(g["params"]) for g in inner.param_groups]
        if saved_sizes != now_sizes:
            raise CheckpointError(
                f"{where}: network {network!r}: {rel} holds {len(saved_sizes)} param group(s) of {saved_sizes} "
                f"parameters; this network's {cls} has {len(now_sizes)} of {now_sizes}. A plugin that adds a param "
                "group during training (unfreezing a backbone) must add it again before the optimizer state is "
                "restored: give it a load_state_dict_early(state, loop) method (docs/checkpoints.md, Plugin state)")
        ids = [k for g in state["param_groups"] for k in g["params"]]
        for n, (key, param) in enumerate(zip(ids, [p for g in inner.param_groups for p in g["params"]])):
            entry = state["state"].get(key)
            for name, value in (entry.items() if isinstance(entry, dict) else ()):
                if name in _PER_PARAMETER and isinstance(value, torch.Tensor) and value.shape != param.shape:
                    raise CheckpointError(
                        f"{where}: network {network!r}: {rel} has optimizer state {name!r} of shape "
                        f"{list(value.shape)} for parameter #{n}, which has shape {list(param.shape)}: the "
                        "parameters are in another order or of another model")


def custom_states(staged: Staged, trusted: set, where: str) -> list:
    """The registered objects' states: plain data, or (trusted by name) unpickled."""
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
                f"{where}: {rel}, the state of an object registered with accelerator.register_for_checkpointing, "
                "is a pickle that does not load as plain data (tensors, numbers, strings, lists, dicts): "
                "unpickling it could run any code, so it is not loaded. If you wrote this checkpoint yourself, "
                f"trust the file by name: Checkpoint(trust_pickles=[{rel!r}]) (or checkpointing.load(..., "
                f"trust_pickles=[{rel!r}])). Better: make the object a plugin with state_dict/load_state_dict, "
                "which hookloop stores as data")
    return out
