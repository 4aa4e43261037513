"""Staging: one process's files of a checkpoint read into memory and
verified (sizes, CRC-32s, safe deserialisation, random states, finiteness),
with nothing in the loop changed yet. :func:`~.loading.load` commits what
is staged here, or nothing.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from . import accelerate as accel
from . import formats
from .codec import check_rng, from_data, parse_rank_file
from .errors import CheckpointError, first_line
from .finite import check_staged_finite
from .layout import RANK_FILE, STATE_FILE, TENSORS_FILE
from . import manifest
from .manifest import checksum_error, read_manifest, verified


@dataclass
class Staged:
    """One process's view of a checkpoint, read, verified and deserialised
    into memory (:func:`stage`): nothing in the loop changed yet."""

    path: Path
    doc: dict
    process_index: int
    models: list
    optimizers: list
    schedulers: list
    rng: dict
    scaler: dict | None
    extra: dict  # other Accelerate files (sampler, stateful loader): verified bytes
    custom: dict  # custom_checkpoint_<i>.pkl -> ("data", state) | ("pickle", bytes)
    epoch_start: dict | None
    generators: dict
    plugin_states: dict
    #: this process's loop.log(on_epoch=True) values of the epoch so far
    logged: dict = field(default_factory=dict)
    #: whose per-process files were read (``random_states_<r>.pkl``,
    #: ``hookloop-rank<r>.safetensors``): this process's, or, on a run of more
    #: processes than the checkpoint's, 0's for a rank it does not have
    #: (:func:`~.loading.load` derives that rank's random states from them)
    source_rank: int | None = None
    #: a sharded format's verified share (:func:`~.formats.stage`); None: plain
    sharded: formats.Sharded | None = None


def stage(path, doc: dict | None = None, process_index: int | None = None) -> Staged:
    """Read every file of checkpoint ``path`` that process ``process_index``
    needs into memory: each one's size and CRC-32 checked against the
    manifest, then deserialised (safetensors, or ``torch.load`` with
    ``weights_only=True``), its random states tried on scratch generators and
    its weights and optimizer state checked to be finite. Raises
    :class:`CheckpointError` naming the file. Changes nothing. Each file is
    read once from disk: the CRC-32 of the weights and optimizer states runs
    in a thread over the pages the deserialisation reads, and their
    finiteness there too, while the small files are read (:class:`_Checks`).

    The state of objects given to ``accelerator.register_for_checkpointing``
    (``custom_checkpoint_<i>.pkl``) is deserialised the safe way too; one
    that is a real pickle is kept as bytes, for :func:`load` to refuse (or,
    if trusted by name, to unpickle)."""
    path = Path(path)
    doc = read_manifest(path) if doc is None else doc
    try:
        with _Checks(f"checkpoint {str(path)!r}") as checks:
            try:
                return _stage(path, doc, process_index, checks)
            except Exception:
                checks.settle(finite=False)  # an earlier file that is not what was written: first
                raise
    except CheckpointError:
        raise
    except (TypeError, KeyError, AttributeError, IndexError, RecursionError) as exc:
        # a manifest of the right format and checksum whose content is not what
        # hookloop writes (a hostile or hand-made one): not a crash of the loop
        raise CheckpointError(f"checkpoint {str(path)!r}: its {STATE_FILE} is not hookloop's "
                              f"({type(exc).__name__}: {first_line(exc)})") from None


class _Checks:
    """The checks that read a whole file again, run in one thread while the
    calling thread reads and deserialises (each releases the GIL): the CRC-32
    of the large files, over a memory map of the very file being read (from
    the page cache: no second read from disk), and the finiteness of the
    staged weights and optimizer states. :meth:`settle` waits for them and
    raises the first failure in reading order, checksums first, as checking
    each before reading the next would; a file that fails to deserialise is
    reported as a checksum mismatch when it is one."""

    def __init__(self, where: str):
        from concurrent.futures import ThreadPoolExecutor

        self.where = where
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="hookloop-verify")
        self.crcs: list[tuple[str, str, int, Future[int] | None]] = []  # (rel, what, expected, future)
        self.finite: Future[None] | None = None

    def crc(self, opened, expected: int, rel: str, what: str) -> None:
        """:func:`~.manifest.verified`'s ``deferred``: checksum ``opened`` in the thread."""
        import mmap

        if opened.size == 0:
            self.crcs.append((rel, what, expected, None))
            return
        mapped = mmap.mmap(opened.fd, opened.size, access=mmap.ACCESS_READ)  # outlives the descriptor

        def checksum():
            with mapped:
                return manifest.crc32(mapped)  # one call: the GIL released for the whole file

        self.crcs.append((rel, what, expected, self.pool.submit(checksum)))

    def check_finite(self, *args) -> None:
        self.finite = self.pool.submit(check_staged_finite, *args)

    def settle(self, finite: bool = True) -> None:
        """Raise the first failure of the checks so far (``finite``: and the finiteness's)."""
        crcs, self.crcs = self.crcs, []
        for rel, what, expected, future in crcs:
            now = 0 if future is None else future.result()
            if now != expected:
                raise checksum_error(self.where, what, rel, now, expected)
        if finite and self.finite is not None:
            self.finite.result()

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        self.pool.shutdown(wait=True)  # (every memory map closed)


def _stage(path: Path, doc: dict, process_index: int | None, checks: _Checks) -> Staged:
    rank = accel.process_index() if process_index is None else process_index
    # a rank the checkpoint has no files of (it was written by fewer
    # processes: an elastic resume) reads rank 0's
    source = rank if rank < doc["num_processes"] else 0
    where = f"checkpoint {str(path)!r}"
    counts = doc["accelerate"]
    owner = {}
    for name, entry in doc["networks"].items():
        for part in ("model", "optimizer", "scheduler"):
            if entry.get(part):
                owner[entry[part]] = f"the {'weights' if part == 'model' else part + ' state'} of network {name!r}"

    # every file through one checked descriptor (a regular file inside the
    # checkpoint, at most the size the manifest records), once its size and
    # checksum are verified; the loaders read that very file
    def load(loader, rel, what):
        with verified(path, rel, doc, where, what, deferred=checks.crc) as opened:
            return loader(opened.source(), rel, where, what)

    def read(rel, what):
        with verified(path, rel, doc, where, what) as opened:
            return opened.read()

    sharding = doc.get("sharding")  # None: the plain format
    sharded = formats.stage(path, doc, rank, where) if sharding is not None else None
    plain = sharding is None or sharding["accelerate"]["format"] == formats.PLAIN
    models = []
    for i in range(counts["models"] if plain else 0):
        rel = accel.model_file(i)
        what = owner.get(rel, f"the weights of accelerator model #{i}")
        if rel not in doc["files"] and accel.legacy_model_file(i) in doc["files"]:
            rel = accel.legacy_model_file(i)
            models.append(load(accel.torch_load, rel, what))
        else:
            models.append(load(accel.safetensors_load, rel, what))
    optimizers = []
    for i in range(counts["optimizers"] if plain else 0):
        rel = accel.optimizer_file(i)
        what = owner.get(rel, f"the state of accelerator optimizer #{i}")
        state = load(accel.torch_load, rel, what)
        if not (isinstance(state, dict) and isinstance(state.get("state"), dict)
                and isinstance(state.get("param_groups"), list)):
            raise CheckpointError(f"{where}: cannot read {what} from {rel}: it is not an optimizer "
                                  "state_dict (no 'state' and 'param_groups')")
        optimizers.append(state)
    # (in the thread, while the small files below are read)
    checks.check_finite(models, optimizers, doc, where)
    schedulers = []
    for i in range(counts["schedulers"] if plain or sharding is None else sharding["scheduler_files"]):
        rel = accel.scheduler_file(i)
        what = owner.get(rel, f"the state of accelerator scheduler #{i}")
        schedulers.append(load(accel.torch_load, rel, what))

    rel = accel.rng_file(source)
    what = f"the random states of process {source}"
    rng = load(accel.torch_load, rel, what)
    try:
        check_rng(rng["random_state"], rng["numpy_random_seed"], rng["torch_manual_seed"])
    except Exception as exc:  # noqa: BLE001 - any invalid content
        raise CheckpointError(f"{where}: cannot read {what} from {rel}: they are not valid random "
                              f"states ({type(exc).__name__}: {exc})") from exc
    scaler = None
    if accel.SCALER_FILE in doc["files"]:
        what = "the gradient scaler state"
        scaler = load(accel.torch_load, accel.SCALER_FILE, what)
    extra = {rel: read(rel, "a data loader state") for rel in doc["files"]
             if accel.LOADER_FILE.match(rel)}
    custom = {}
    for i in range(counts.get("custom_objects", 0)):
        rel = accel.custom_file(i)
        what = f"the state of object #{i} registered with accelerator.register_for_checkpointing"
        data = read(rel, what)
        try:
            custom[rel] = ("data", accel.torch_load(data, rel, where, what))
        except CheckpointError:
            custom[rel] = ("pickle", data)

    rel = RANK_FILE.format(rank=source)
    what = f"the data position of process {source}"
    data = read(rel, what)
    try:
        epoch_start, generators, logged = parse_rank_file(data)
    except Exception as exc:  # noqa: BLE001 - garbled in any way
        raise CheckpointError(f"{where}: cannot read {what} from {rel}: {type(exc).__name__}: "
                              f"{first_line(exc)}") from exc
    tensors = {}
    if TENSORS_FILE in doc["files"]:
        tensors = load(accel.safetensors_load, TENSORS_FILE, "the plugin states")
    plugin_states = {}
    for name, state in doc["plugins"].items():
        try:
            plugin_states[name] = from_data(state, tensors)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise CheckpointError(f"{where}: the state of plugin {name!r} refers to tensors that "
                                  f"{TENSORS_FILE} does not hold ({type(exc).__name__}: {exc})") from exc

    checks.settle()
    return Staged(path, doc, rank, models, optimizers, schedulers, rng, scaler, extra, custom,
                  epoch_start, generators, plugin_states, logged, source, sharded)
