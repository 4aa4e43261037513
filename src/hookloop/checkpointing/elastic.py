"""Where a checkpoint continues when this run cuts its global batch otherwise:
another number of processes, another batch size, another gradient
accumulation (:func:`plan`, called by :func:`~.stage.check_resume`).

The data position is counted in *examples of the epoch's global order*.
With Accelerate's default (non-dispatched) sharding of a map-style dataset,
an epoch's order is one permutation of the dataset, cut into batches of
``batch_size`` that go to the processes in turn (``BatchSamplerShard``:
batch ``i`` to process ``i % P``); a dispatched stream is cut the same way
on the main process. So ``k`` batches per process with ``P`` processes of
``b`` examples each (``split_batches``: ``b`` examples split over the
processes) are the first ``E = k * P * b`` (``k * b``) examples of that
order, and on ``P'`` processes with batch size ``b'`` the same place is
``k' = E / (P' * b')`` batches per process, rounded up when it is not a
whole number (a partly drawn batch counts as drawn: its other examples are
not trained in that epoch, and no example is trained twice in it).

The global batch, examples per update (``P * b * gradient_accumulation_steps``,
``b * ...`` with ``split_batches``), decides what an update and its step
mean. The same global batch on another cut continues by default (the
position maps exactly: checkpoints are taken at update boundaries); another
one only with ``strict=False``, from the same examples, with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..rng import translate_epoch, translate_generators
from . import accelerate as accel
from .errors import CheckpointError

#: what each recorded run setting decides (shown when a resume differs)
SETTINGS = {
    "num_processes": "the batches would be shared out over another number of processes",
    "gradient_accumulation_steps": "an update would average another number of batches, and "
                                   "global_step would count other updates",
    "batches_per_epoch": "the epoch would have another length, and the data position another meaning",
    "batch_size": "an update would average another number of examples, and global_step would "
                  "count other updates",
    "dataset_length": "the shuffle would be drawn over other examples",
    "sampler": "the data would be drawn in another order",
    "drop_last": "the epoch would have another length",
    "use_seedable_sampler": "the shuffle would be drawn from another generator",
    "data_seed": "the shuffle would be drawn from another seed",
    "split_batches": "the batches would be split differently between processes",
    "even_batches": "the last batches would be shared out differently between processes",
    "dispatch_batches": "the batches would be read and shared out differently between processes",
}

#: how the global batch is cut, and where the epoch is: mapped onto this
#: run's cut (not compared) whenever the position can be mapped
CUT = ("num_processes", "batch_size", "gradient_accumulation_steps", "batches_per_epoch",
       "examples_per_batch", "global_batch_size", "examples_in_epoch", "sampler_generator",
       "loader_generator")

@dataclass
class Plan:
    """How a checkpoint continues in this loop."""

    #: processes of the checkpoint, and of this run
    processes: tuple[int, int] = (1, 1)
    #: the data position is re-read in batches of another size
    mapped: bool = False
    #: the position in this run's batches (None: the checkpoint's, unchanged)
    step_in_epoch: int | None = None
    micro_step: int | None = None
    #: scheduler step counts become ``count * num // den`` (None: unchanged)
    scheduler_ratio: tuple[int, int] | None = None
    #: the saved loader's generator roles (``rng.generator_roles``), to
    #: translate its epoch start for this loader; None: not recorded
    roles: dict | None = None
    #: warnings to give once the checkpoint is loaded
    messages: list = field(default_factory=list)

    @property
    def elastic(self) -> bool:
        """Another number of processes."""
        return self.processes[0] != self.processes[1]


def _int(value):
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _cut(settings: dict, processes: int) -> tuple:
    """(batch_size, accumulation, split, examples per batch over all
    processes, global batch), None where unknown."""
    b = _int(settings.get("batch_size"))
    g = _int(settings.get("gradient_accumulation_steps"))
    split = settings.get("split_batches") is True
    per_batch = _int(settings.get("examples_per_batch"))
    if per_batch is None and b is not None:
        per_batch = b if split else b * processes
    total = per_batch * g if per_batch is not None and g is not None else None
    return b, g, split, per_batch, total


def describe_cut(processes: int, b, g, split: bool) -> str:
    if split:
        return f"batch_size={b} split over {processes} process(es) x gradient_accumulation_steps={g}"
    return f"{processes} process(es) x batch_size={b} x gradient_accumulation_steps={g}"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def plan(loop, path, doc: dict, now: dict, strict: bool) -> Plan:
    """Compare the checkpoint's run settings with this run's (``now``,
    :func:`~.stage.run_settings`) and decide where it continues; raises
    :class:`CheckpointError` naming what to change when it cannot."""
    where = f"checkpoint {str(path)!r}"
    acc = loop.accelerator
    saved = dict(doc.get("settings") or {})
    p_saved, p_now = doc["num_processes"], acc.num_processes
    if not isinstance(p_saved, int) or isinstance(p_saved, bool) or p_saved < 1:
        raise CheckpointError(f"{where}: its num_processes is {p_saved!r}, not a number of processes")
    result = Plan(processes=(p_saved, p_now))
    b_s, g_s, split_s, epb_s, total_s = _cut(saved, p_saved)
    b_n, g_n, split_n, epb_n, total_n = _cut(now, p_now)
    same_cut = p_saved == p_now and (not saved or (b_s == b_n and g_s == g_n))

    differ = []

    def add(key, was, value):
        differ.append(f"{key}={was!r} (this run has {key}={value!r}: "
                      f"{SETTINGS.get(key, 'the data order or the step count would differ')})")

    for key, was in saved.items():
        value = now.get(key)
        if key in CUT and not (same_cut and key == "batches_per_epoch"):
            continue  # (batches_per_epoch: compared when the cut is the same, as before)
        if was is None or value is None or was == value:
            continue
        add(key, was, value)
    if same_cut:
        return _settings_differ(result, differ, where, path, strict)

    loop_doc = doc.get("loop")
    position = loop_doc if isinstance(loop_doc, dict) else {}
    k = _int(position.get("step_in_epoch")) or 0
    epoch = _int(position.get("epoch")) or 0
    micro = _int(position.get("micro_step", position.get("global_step"))) or 0
    updates = _int(position.get("global_step")) or 0
    unmappable = None
    if epb_s is None or epb_n is None or g_s is None or g_n is None:
        unmappable = ("the checkpoint does not record its batch size" if epb_s is None or g_s is None
                      else "this run's train_data has no batch size")
    elif p_saved != p_now and getattr(loop.train_data, "use_stateful_dataloader", False):
        unmappable = ("its train_data is a stateful loader (use_stateful_dataloader), whose saved state "
                      "is one process's position in its own shard")
    elif p_saved != p_now and accel.kind(acc) in accel.SHARDED_TYPES:
        unmappable = f"it is a sharded ({accel.kind(acc)}) checkpoint"
    elif p_saved != p_now and "sampler_generator" not in saved:
        unmappable = ("it does not record which generator drew its shuffle (it was written by hookloop "
                      f"{(doc.get('versions') or {}).get('hookloop', '0.3')})")
    if unmappable is not None:
        if p_saved != p_now:
            raise CheckpointError(
                f"{where} was written by {p_saved} process(es); this run has {p_now}, and "
                f"{unmappable}: the data position cannot be mapped onto another number of processes. "
                f"Resume it on {p_saved} process(es), or use load_checkpoint({str(path)!r}, "
                "weights_only=True) to start a new run from its weights"
            )
        for key in ("batch_size", "gradient_accumulation_steps", "batches_per_epoch"):  # as before
            if saved.get(key) is not None and now.get(key) is not None and saved[key] != now[key]:
                add(key, saved[key], now[key])
        return _settings_differ(result, differ, where, path, strict)

    # the position in examples of the epoch's global order, and in this run's batches
    drawn = k * epb_s
    k_new = _ceil_div(drawn, epb_n)
    skipped = k_new * epb_n - drawn
    result.mapped = True
    result.step_in_epoch = k_new
    result.micro_step = _ceil_div(micro * epb_s, epb_n)
    unit_s, unit_n = b_s * g_s, b_n * g_n  # examples a prepared scheduler's step counts
    if unit_s != unit_n:
        result.scheduler_ratio = (unit_s, unit_n)
    if p_saved != p_now:
        result.roles = {"sampler": saved.get("sampler_generator"), "loader": saved.get("loader_generator")}
    was_cut, now_cut = describe_cut(p_saved, b_s, g_s, split_s), describe_cut(p_now, b_n, g_n, split_n)
    where_now = (f"{drawn} examples of epoch {epoch} were drawn ({k} batch(es) of {epb_s} over all "
                 f"processes): this run continues after {k_new} batch(es) of {epb_n}")
    if skipped:
        where_now += (f" ({drawn}/{epb_n} is not a whole number of batches: rounded up, so "
                      f"{skipped} example(s) of the epoch, the rest of its batch {k_new}, are not "
                      "trained in it; none is trained twice)")
    schedule = ""
    if result.scheduler_ratio is not None:
        schedule = (f"; a scheduler prepared by Accelerate counts batches of batch_size x "
                    f"gradient_accumulation_steps examples ({unit_s} there, {unit_n} here), so its "
                    f"step count is scaled by {unit_s}/{unit_n}")
    randomness = ""
    if p_saved != p_now:
        keep = min(p_saved, p_now)
        randomness = (
            "The per-process random states (dropout, noise) cannot carry over to another number of "
            f"processes: {_ranks(0, keep - 1)} keep{'s' if keep == 1 else ''} the saved ones"
            + (f", {_ranks(p_saved, p_now - 1)} take{'s' if p_now - p_saved == 1 else ''} states derived "
               "from the saved rank 0's and the rank" if p_now > p_saved else "")
            + (f" (those of the saved {_ranks(p_now, p_saved - 1)} are not used)" if p_saved > p_now else "")
            + ". "
        )
    if total_s == total_n:
        result.messages.append(
            f"{where} was written with {was_cut}; this run has {now_cut}: the same global batch of "
            f"{total_s} examples per update, so it continues where it stopped: {where_now}, in the "
            f"order the saved epoch drew, with the saved weights, optimizer state and "
            f"schedule{schedule}. {randomness}The gradient of an update is reduced over another split of "
            "its batch, so the numbers are not bit for bit those of the uninterrupted run; the data "
            "order is the same"
        )
        return _settings_differ(result, differ, where, path, strict)

    for key in ("num_processes", "batch_size", "gradient_accumulation_steps"):
        was = p_saved if key == "num_processes" else saved.get(key)
        value = p_now if key == "num_processes" else now.get(key)
        if was != value:
            add(key, was, value)
    batch = (f"its global batch was {total_s} examples per update ({was_cut}); this run's is "
             f"{total_n} ({now_cut})")
    if strict:
        hint = _same_batch_hint(total_s, p_now, b_n, g_n, split_n)
        raise CheckpointError(
            f"{where} was written with other settings than this run's, which decide the data order "
            f"and the step count: {'; '.join(differ)}; {batch}. The resumed run would not continue "
            f"the saved one: make the global batch {total_s} again{hint}, pass strict=False to "
            f"continue from the same examples ({where_now}), or use load_checkpoint({str(path)!r}, "
            "weights_only=True) to start a new run from its weights"
        )
    result.messages.append(
        f"{where} was written with other settings than this run's, which decide the data order and "
        f"the step count: {'; '.join(differ)}; {batch}. Resuming anyway (strict=False) from the same "
        f"examples: {where_now}. What changes: an update now averages {total_n} examples, not "
        f"{total_s}, so global_step ({updates}) counted updates of {total_s} examples until here and "
        f"counts updates of {total_n} from here: fit(max_steps=...), every_steps and a learning-rate "
        f"schedule sized for {total_s} examples per update now mean other examples{schedule}, and the "
        f"optimizer state was gathered at the other batch. {randomness}"
        "The data order is the saved run's"
    )
    return result


def _ranks(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def _same_batch_hint(total: int, processes: int, b, g, split: bool) -> str:
    """How this run would have the global batch ``total`` again, if simply."""
    per = 1 if split else processes
    if b and g and total % (per * g) == 0:
        alt = f"batch_size={total // (per * g)}"
        if b and total % (per * b) == 0 and total // (per * b) != g:
            alt += f", or gradient_accumulation_steps={total // (per * b)}"
        return f" (processes x batch_size x gradient_accumulation_steps; on {processes} process(es): {alt})"
    return " (processes x batch_size x gradient_accumulation_steps)"


def _settings_differ(result: Plan, differ: list, where: str, path, strict: bool) -> Plan:
    """Settings other than the cut of the global batch differ: refused, or
    (``strict=False``) a warning."""
    if not differ:
        return result
    msg = (f"{where} was written with other settings than this run's, which decide the data "
           f"order and the step count: {'; '.join(differ)}")
    if strict:
        raise CheckpointError(msg + ". The resumed run would not continue the saved one; pass "
                              "strict=False to resume anyway (with a warning), or use "
                              f"load_checkpoint({str(path)!r}, weights_only=True) to start a new run "
                              "from its weights")
    result.messages.append(msg + ". Resuming anyway (strict=False)")
    return result


# -- at load: the per-process parts, the schedulers, the epoch's random states ---------


def needed_ranks(staged, plan: Plan) -> list[int]:
    """The saved ranks whose rank files this process needs on another number
    of processes, besides its own: rank 0's (whose epoch start drew the
    shuffle every rank drew, and whose data generators every rank had) and
    those whose ``loop.log`` values it takes over (rank ``r`` of ``P'`` takes
    ``r, r + P', r + 2P' ...``)."""
    saved, now = plan.processes
    mine = staged.source_rank
    return sorted({0, *range(staged.process_index, saved, now)} - {mine})


def merged_logged(parts: dict, rank: int, plan: Plan) -> dict:
    """The ``loop.log(on_epoch=True)`` values of the epoch so far that this
    process continues: those of the saved ranks ``rank, rank + P' ...``
    added up (sums, means: totals and counts; max, min: the larger or
    smaller), so that the epoch's reduction over processes is the one the
    saved run would have made."""
    saved, now = plan.processes
    out: dict = {}
    for r in range(rank, saved, now):
        for key, (reduce, total, count) in parts[r][2].items():
            entry = out.get(key)
            if entry is None:
                out[key] = [reduce, total, count]
                continue
            if reduce in ("mean", "sum"):
                entry[1] = entry[1] + total
            else:
                pick = torch.maximum if reduce == "max" else torch.minimum
                entry[1] = pick(torch.as_tensor(entry[1], dtype=torch.float64),
                                torch.as_tensor(total, dtype=torch.float64))
            entry[2] += count
    return out


def continue_epoch(loop, staged, plan: Plan, parts: dict | None, messages: list) -> tuple:
    """What :func:`~.resume.load` gives the run state after the commit:
    ``(epoch_start, generators now, loop.log values)`` of this process, and
    the position in this run's batches when it was mapped. On another
    number of processes every rank continues the epoch from the saved rank
    0's epoch start (the shuffle every rank drew, :func:`epoch_for`), and
    rank ``r`` of ``P'`` takes over the ``loop.log(on_epoch=True)`` values
    of the saved ranks ``r, r + P', ...`` (:func:`merged_logged`); a rank
    the checkpoint has keeps its own random states, any other takes states
    derived from rank 0's and its rank (:func:`~.accelerate.derived_seed`,
    at the commit)."""
    if plan.mapped:  # the same place in the epoch's order, in this run's batches
        loop.state.step_in_epoch, loop.state.micro_step = plan.step_in_epoch, plan.micro_step
    if parts is None:
        return staged.epoch_start, staged.generators, staged.logged
    epoch_start, generators = epoch_for(loop, parts, plan, messages)
    return epoch_start, generators, merged_logged(parts, staged.process_index, plan)


def epoch_for(loop, parts: dict, plan: Plan, messages: list) -> tuple:
    """The epoch start and the data generators now, as this run's loader
    names them (:func:`hookloop.rng.translate_epoch`), from the saved rank
    0's: every rank continues the shuffle rank 0 drew."""
    epoch_start, generators, _ = parts[0]
    roles, data = plan.roles or {}, loop.train_data
    return translate_epoch(epoch_start, roles, data), translate_generators(generators, roles, data)


def scale_schedulers(loop, staged, plan: Plan) -> None:
    """Scale the step counts (``last_epoch``, ``_step_count``) of the staged
    states of schedulers that Accelerate steps with their optimizer by
    ``plan.scheduler_ratio``: such a scheduler counts batches of batch_size
    x gradient_accumulation_steps examples (once per process per update), so
    a count means other examples when that changes. Nested schedulers
    (``SequentialLR``, ``ChainedScheduler``: ``_schedulers``) are scaled too.
    A ``scheduler_interval="epoch"`` scheduler counts epochs, whatever the
    number of processes: never scaled."""
    if plan.scheduler_ratio is None:
        return
    num, den = plan.scheduler_ratio
    live = accel.scheduler_objects(loop.accelerator)
    per_epoch = {id(n.scheduler) for n in loop.networks.values()
                 if n.scheduler is not None and n.scheduler_interval == "epoch"}
    for i, state in enumerate(staged.schedulers):
        scheduler = live[i] if i < len(live) else None
        if scheduler is not None and (getattr(scheduler, "step_with_optimizer", True) is False
                                      or id(scheduler) in per_epoch):
            continue
        staged.schedulers[i] = _scaled(state, num, den)


def _scaled(state, num: int, den: int):
    if not isinstance(state, dict):
        return state
    state = dict(state)
    last = state.get("last_epoch")
    if isinstance(last, int) and not isinstance(last, bool) and last >= 0:
        new = last * num // den
        count = state.get("_step_count")
        if isinstance(count, int) and not isinstance(count, bool):
            state["_step_count"] = new + (count - last)
        state["last_epoch"] = new
    if isinstance(state.get("_schedulers"), list):
        state["_schedulers"] = [_scaled(s, num, den) for s in state["_schedulers"]]
    return state
