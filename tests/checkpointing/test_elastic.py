"""A checkpoint continued on another number of processes, batch size or
gradient accumulation (docs/checkpoints.md, Another number of processes).

The runs are tests/scripts/elastic.py: 64 examples, shuffled, each batch
``(x, y, index)``; its ``Recorder`` writes the indices every batch trains
(gathered over the processes, in global order) to ``records.jsonl``, so that
a test can check which examples two runs (the interrupted one, up to its
checkpoint, and the resumed one) drew of the interrupted epoch.

The resumed run cannot end with the uninterrupted run's parameters bit for
bit: on another number of processes the per-process random states differ
(re-derived for the ranks the checkpoint lacks) and an update's gradient is
reduced in another order (DDP's all-reduce of two halves against one mean
of 16). With dropout 0 and a deterministic model they end within float
rounding of each other, and the data order and the learning rate of every
update are the uninterrupted run's.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import elastic
import launching
import runner
from hookloop.testing import reset_accelerate

SCRIPT = runner.HERE / "elastic.py"


# -- helpers ---------------------------------------------------------------------------


def run(out, *args) -> int:
    """elastic.py in this process (one process); its exit status."""
    reset_accelerate()
    try:
        elastic.main([str(out), *map(str, args)])
    except SystemExit as exc:
        return exc.code
    finally:
        reset_accelerate()
    return 0


def launch_two(out, *args) -> subprocess.CompletedProcess:
    """elastic.py in two processes (``accelerate launch --multi_gpu
    --num_processes 2``; the script asks for ``Accelerator(cpu=True)``), as
    ``runner.launch_two`` starts resumable.py."""
    done = launching.run_two(SCRIPT, out, *args, timeout=runner.PATIENCE_S)
    done.stdout += done.stderr  # (the launcher's one stream)
    return done


def launch_one(out, *args) -> subprocess.CompletedProcess:
    """elastic.py in a ``python`` of its own (one process)."""
    return subprocess.run([sys.executable, str(SCRIPT), str(out), *map(str, args)], capture_output=True,
                          text=True, timeout=runner.PATIENCE_S, env={**os.environ, "OMP_NUM_THREADS": "1"})


def built(tmp_path, **options):
    """elastic.py's loop, built in this process (one process)."""
    args = dict(out=tmp_path, ckpt=tmp_path / "new", batch_size=8, accum=1, epochs=1, every_steps=2,
                kill_at=None, generator=False, dropout=0.0)
    args = argparse.Namespace(**{**args, **options})
    reset_accelerate()
    return elastic.build(args, elastic.Accelerator(cpu=True, gradient_accumulation_steps=args.accum))


def records(out, until=None) -> list[dict]:
    """What a run trained, batch by batch (up to update ``until``: a killed
    run's batches after its last checkpoint are lost with it)."""
    file = out / "records.jsonl"  # (none: the run trained no batch)
    rows = [json.loads(line) for line in file.read_text().splitlines()] if file.exists() else []
    return [r for r in rows if until is None or r["global_step"] <= until]


def order(rows, epoch) -> list[int]:
    """The examples of ``epoch`` in the order they were drawn (global order)."""
    return [i for r in rows if r["epoch"] == epoch for i in r["indices"]]


def report(out) -> dict:
    return json.loads((out / "run.json").read_text())


def params(out) -> dict:
    return torch.load(out / "params.pt", weights_only=True)


def max_difference(a, b) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_drawn_once(epoch_rows, n=64, skipped=()):
    """Every example of the epoch exactly once, except ``skipped`` (never)."""
    drawn = [i for rows in epoch_rows for i in rows]
    assert len(drawn) == len(set(drawn)), f"drawn twice: {sorted({i for i in drawn if drawn.count(i) > 1})}"
    assert set(drawn) == set(range(n)) - set(skipped), f"never drawn: {sorted(set(range(n)) - set(drawn))}"


# -- another batch size, one process ----------------------------------------------------


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """An uninterrupted 1 x 8 run (its epoch order) and one stopped after 5
    of the 8 updates of epoch 0 (``fit(max_steps=5)``: 40 examples drawn)."""
    base = tmp_path_factory.mktemp("one")
    assert run(base / "ref", "--ckpt", base / "ref-ck", "--epochs", "1") == 0
    assert run(base / "stopped", "--ckpt", base / "ck", "--epochs", "1", "--max-steps", "5") == 0
    assert (base / "ck" / "latest").read_text().strip() == "step-00000005"
    return base


def fresh_copy(one_process_run, tmp_path):
    shutil.copytree(one_process_run / "ck", tmp_path / "ck")
    return tmp_path / "ck"


def test_another_batch_size_is_refused_naming_both_values_and_what_to_do(one_process_run, tmp_path):
    ck = fresh_copy(one_process_run, tmp_path)
    assert run(tmp_path / "b", "--ckpt", ck, "--epochs", "1", "--batch-size", "16", "--resume", "latest") == 3
    error = json.loads((tmp_path / "b" / "error.json").read_text())["error"]
    assert "batch_size=8 (this run has batch_size=16" in error
    assert "its global batch was 8 examples per update" in error and "this run's is 16" in error
    assert "make the global batch 8 again" in error and "on 1 process(es): batch_size=8" in error
    assert "pass strict=False to continue from the same examples" in error
    assert "40 examples of epoch 0 were drawn" in error
    assert f"load_checkpoint('{ck / 'step-00000005'}', weights_only=True)" in error
    assert (ck / "latest").read_text().strip() == "step-00000005"  # nothing written


@pytest.mark.parametrize(("batch_size", "continue_at"), [(4, 10), (20, 2), (16, 3), (12, 4)])
def test_another_batch_size_with_strict_false_continues_from_the_same_examples(
        one_process_run, tmp_path, batch_size, continue_at):
    """40 examples were drawn: 10 batches of 4, 2 of 20; 2.5 of 16 and 3.33
    of 12 are rounded up (documented): the rest of the partly drawn batch is
    not trained in that epoch, and no example is trained twice."""
    ck = fresh_copy(one_process_run, tmp_path)
    out = tmp_path / "b"
    assert run(out, "--ckpt", ck, "--epochs", "1", "--batch-size", batch_size, "--resume", "latest",
               "--lenient") == 0
    reference = order(records(one_process_run / "ref"), 0)
    first, second = order(records(one_process_run / "stopped"), 0), order(records(out), 0)
    assert first == reference[:40]
    assert second == reference[continue_at * batch_size:]  # the saved epoch's order, from there on
    skipped = reference[40:continue_at * batch_size]
    assert_drawn_once([first, second], skipped=skipped)
    (message,) = report(out)["warnings"]
    assert "Resuming anyway (strict=False) from the same examples" in message
    assert f"this run continues after {continue_at} batch(es) of {batch_size}" in message
    assert ("rounded up" in message) == bool(skipped)
    assert "a learning-rate schedule sized for 8 examples per update now mean other examples" in message
    batches = -(-64 // batch_size)
    assert report(out)["global_step"] == 5 + batches - continue_at


def test_the_same_global_batch_cut_otherwise_resumes_by_default_at_the_same_examples(tmp_path):
    """1 x 8 x accumulation 2 -> 1 x 16: the same 16 examples per update."""
    assert run(tmp_path / "ref", "--ckpt", tmp_path / "ref-ck", "--accum", "2") == 0
    assert run(tmp_path / "a", "--ckpt", tmp_path / "ck", "--accum", "2", "--max-steps", "6") == 0
    assert run(tmp_path / "b", "--ckpt", tmp_path / "ck", "--batch-size", "16", "--resume", "latest") == 0
    ref, a, b = records(tmp_path / "ref"), records(tmp_path / "a"), records(tmp_path / "b")
    for epoch in (0, 1):
        assert order(a, epoch) + order(b, epoch) == order(ref, epoch)
    assert_drawn_once([order(a, 1), order(b, 1)])
    (message,) = report(tmp_path / "b")["warnings"]
    assert "the same global batch of 16 examples per update" in message
    assert "32 examples of epoch 1 were drawn" in message and "continues after 2 batch(es) of 16" in message
    assert report(tmp_path / "b")["global_step"] == 8
    # the schedule goes on: every update's learning rate is the uninterrupted run's
    lr = {r["global_step"]: r["lr"] for r in ref}
    assert {r["global_step"]: r["lr"] for r in a + b} == lr
    assert max_difference(params(tmp_path / "b"), params(tmp_path / "ref")) < 1e-5


# -- the pieces -----------------------------------------------------------------------------


def test_ranks_a_checkpoint_lacks_get_random_states_derived_from_rank_0s_and_their_rank():
    from hookloop.checkpointing.accelerate import derived_seed

    states = {"torch_manual_seed": torch.manual_seed(3).get_state()}
    seeds = [derived_seed(states, rank) for rank in range(1, 4)]
    assert seeds == [derived_seed(states, rank) for rank in range(1, 4)]  # the same on every resume
    assert len(set(seeds)) == 3 and all(0 <= s < 2 ** 63 for s in seeds)
    assert derived_seed({"torch_manual_seed": torch.manual_seed(4).get_state()}, 1) != seeds[0]


def test_the_epochs_logged_values_are_taken_over_by_rank_modulo_the_new_count():
    from hookloop.checkpointing.elastic import Plan, merged_logged

    parts = {0: (None, {}, {"loss": ["mean", 6.0, 3], "top": ["max", 2.0, 3]}),
             1: (None, {}, {"loss": ["mean", 4.0, 2], "top": ["max", 5.0, 2]}),
             2: (None, {}, {"loss": ["mean", 1.0, 1]})}
    merged = merged_logged(parts, 0, Plan(processes=(3, 2)))
    assert merged["loss"] == ["mean", 7.0, 4] and float(merged["top"][1]) == 2.0
    assert merged_logged(parts, 1, Plan(processes=(3, 2)))["top"][2] == 2
    assert merged_logged(parts, 2, Plan(processes=(2, 3))) == {}  # a new rank starts empty


def test_a_shuffle_drawn_from_the_global_rng_is_found_again_as_a_generator_state():
    """One process with the default sampler seeds the epoch's permutation
    from the global RNG: the generator state it drew it with is recovered
    from the epoch start, and given to another loader's sampler."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    from hookloop import rng

    acc = Accelerator(cpu=True)
    data = acc.prepare(DataLoader(TensorDataset(torch.arange(64)), batch_size=16, shuffle=True))
    roles = rng.generator_roles(data)
    assert roles == {"sampler": "global", "loader": "global"}
    start = rng.capture_epoch(data)
    drawn = [i for batch in data for i in batch[0].tolist()]
    state = rng.shuffle_state(start, roles)
    assert torch.randperm(64, generator=torch.Generator().set_state(state)).tolist() == drawn
    other = DataLoader(TensorDataset(torch.arange(64)), batch_size=4, shuffle=True,
                       generator=torch.Generator().manual_seed(99))
    with rng.shuffling_from(other, state):
        first = next(iter(other))[0].tolist()
    assert first == drawn[:4]


# -- weights only --------------------------------------------------------------------------


def test_weights_only_starts_a_new_run_from_the_weights_of_another_cut(one_process_run, tmp_path):
    from hookloop.checkpointing import read_manifest
    from safetensors.torch import load_file

    ck = one_process_run / "ck" / "step-00000005"
    saved = load_file(ck / "model.safetensors")
    loop = built(tmp_path, batch_size=16, accum=2)  # resuming would need strict=False
    run_id = getattr(getattr(loop.state, "run", None), "id", None)
    assert loop.load_checkpoint(ck, weights_only=True) == ck
    state = loop.networks["model"].unwrapped.state_dict()
    assert all(torch.equal(state[k], saved[k]) for k in saved)
    assert loop.state.state_dict() == {"epoch": 0, "step_in_epoch": 0, "global_step": 0, "micro_step": 0}
    assert loop.state.run.id == run_id != read_manifest(ck)["run_id"] and loop.resumed_from is None
    assert loop.networks["model"].optimizer.state_dict()["state"] == {}  # a fresh optimizer
    loop.fit(epochs=1)  # a run of its own, in its own folder
    assert loop.state.global_step == 2
    assert read_manifest(tmp_path / "new" / "step-00000002-epoch-end")["run_id"] == run_id
    loop.close()


def test_weights_only_compares_network_names_and_shapes(one_process_run):
    from hookloop import Loop
    from hookloop.checkpointing import CheckpointError
    from hookloop.testing import tiny_gan_loop, tiny_loop

    ck = one_process_run / "ck" / "step-00000005"
    reset_accelerate()
    with pytest.raises(CheckpointError, match=r"holds the weights of networks \['model'\]; this loop has "
                                              r"\['discriminator', 'generator'\]"):
        tiny_gan_loop().load_checkpoint(ck, weights_only=True)
    reset_accelerate()
    loop = tiny_loop(features=10)
    with pytest.raises(CheckpointError, match=r"tensor '0.weight' has shape \[16, 8\] in the checkpoint "
                                              r"but \[16, 10\] in this model"):
        loop.load_checkpoint(ck, weights_only=True)
    assert isinstance(loop, Loop)


def test_weights_only_reads_a_folder_of_accelerates_plain_format(tmp_path):
    from accelerate import Accelerator

    from hookloop.checkpointing import CheckpointError
    from hookloop.testing import tiny_loop

    reset_accelerate()
    acc = Accelerator(cpu=True)
    torch.manual_seed(5)
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                            torch.nn.Linear(16, 3)))
    acc.save_state(str(tmp_path / "plain"))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    reset_accelerate()
    loop = tiny_loop()
    with pytest.raises(CheckpointError, match="written by accelerator.save_state without hookloop"):
        loop.load_checkpoint(tmp_path / "plain")  # to continue a run, it needs hookloop's state
    assert loop.load_checkpoint(tmp_path / "plain", weights_only=True) == tmp_path / "plain"
    state = loop.networks["model"].unwrapped.state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert loop.state.global_step == 0


# -- another number of processes (two processes on this CPU) -------------------------------


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """2 processes x batch 8, 2 epochs of 4 updates, the default sampler: an
    uninterrupted run, and one killed (SIGKILL) in batch 7, whose last
    checkpoint is that of update 6 (epoch 1, 32 of its examples drawn)."""
    base = tmp_path_factory.mktemp("two")
    ref = launch_two(base / "ref", "--ckpt", base / "ref-ck")
    assert ref.returncode == 0, ref.stdout[-3000:]
    assert report(base / "ref")["num_processes"] == 2
    killed = launch_two(base / "killed", "--ckpt", base / "ck", "--kill-at", "7")
    assert killed.returncode != 0
    assert (base / "ck" / "latest").read_text().strip() == "step-00000006"
    assert max(r["micro_step"] for r in records(base / "killed")) == 7
    return base


@pytest.mark.slow
def test_two_processes_to_one_with_the_same_global_batch_resumes_exactly_in_the_data(two_process_run, tmp_path):
    """2 x 8 killed mid-epoch, resumed as 1 x 16 without strict=False."""
    shutil.copytree(two_process_run / "ck", tmp_path / "ck")
    out = tmp_path / "one"
    result = launch_one(out, "--ckpt", tmp_path / "ck", "--batch-size", "16", "--resume", "latest")
    assert result.returncode == 0, result.stderr[-3000:]
    ref, killed, resumed = (records(two_process_run / "ref"), records(two_process_run / "killed", until=6),
                            records(out))
    assert_drawn_once([order(killed, 1), order(resumed, 1)])
    assert order(killed, 1) + order(resumed, 1) == order(ref, 1)  # the uninterrupted run's order
    assert [r["global_step"] for r in resumed] == [7, 8]
    # the schedule continues: a prepared scheduler counted 2 steps an update on 2 processes, 1 here
    assert [r["lr"] for r in resumed] == [r["lr"] for r in ref if r["global_step"] in (7, 8)]
    done = report(out)
    assert done["num_processes"] == 1 and done["started_at"] == 6 and done["global_step"] == 8
    (message,) = done["warnings"]
    assert "2 process(es) x batch_size=8" in message and "1 process(es) x batch_size=16" in message
    assert "the same global batch of 16 examples per update" in message
    assert "random states (dropout, noise) cannot carry over" in message
    final, reference = params(out), params(two_process_run / "ref")
    assert all(torch.isfinite(v).all() for v in final.values())
    assert max_difference(final, reference) < 1e-5  # float rounding, not bit for bit (docstring)


@pytest.mark.slow
def test_a_stream_on_two_processes_continues_on_one_in_the_same_order(tmp_path):
    """An IterableDataset without a length, whose order comes from the global
    RNG: on two processes Accelerate dispatches its batches from the main
    process (its epoch start is rank 0's), on one it is read directly."""
    assert launch_two(tmp_path / "ref", "--ckpt", tmp_path / "ref-ck", "--stream").returncode == 0
    assert launch_two(tmp_path / "a", "--ckpt", tmp_path / "ck", "--stream", "--kill-at", "7").returncode != 0
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-00000006"
    result = launch_one(tmp_path / "b", "--ckpt", tmp_path / "ck", "--stream", "--batch-size", "16",
                        "--resume", "latest")
    assert result.returncode == 0, result.stderr[-3000:]
    ref, a, b = records(tmp_path / "ref"), records(tmp_path / "a", until=6), records(tmp_path / "b")
    assert_drawn_once([order(a, 1), order(b, 1)])
    assert order(a, 1) + order(b, 1) == order(ref, 1)
    assert report(tmp_path / "b")["global_step"] == 8
    assert max_difference(params(tmp_path / "b"), params(tmp_path / "ref")) < 1e-5


@pytest.mark.slow
def test_one_process_to_two_with_the_same_global_batch_resumes_exactly_in_the_data(tmp_path):
    """1 x 16 stopped mid-epoch (fit(max_steps=5)), resumed as 2 x 8. With
    the loader's own generator, every later epoch's order is the
    uninterrupted run's too (the generator goes on from the saved state)."""
    args = ("--batch-size", "16", "--epochs", "3", "--generator")
    assert run(tmp_path / "ref", "--ckpt", tmp_path / "ref-ck", *args) == 0
    assert run(tmp_path / "a", "--ckpt", tmp_path / "ck", *args, "--max-steps", "5") == 0
    result = launch_two(tmp_path / "b", "--ckpt", tmp_path / "ck", "--epochs", "3", "--generator",
                        "--resume", "latest")
    assert result.returncode == 0, result.stdout[-3000:]
    ref, a, b = records(tmp_path / "ref"), records(tmp_path / "a"), records(tmp_path / "b")
    assert_drawn_once([order(a, 1), order(b, 1)])
    for epoch in (0, 1, 2):
        assert order(a, epoch) + order(b, epoch) == order(ref, epoch)
    assert {r["global_step"]: r["lr"] for r in a + b} == {r["global_step"]: r["lr"] for r in ref}
    done = report(tmp_path / "b")
    assert done["num_processes"] == 2 and done["started_at"] == 5 and done["global_step"] == 12
    assert "rank 1 takes states derived from the saved rank 0's" in done["warnings"][0]
    final = params(tmp_path / "b")
    assert all(torch.isfinite(v).all() for v in final.values())
    assert max_difference(final, params(tmp_path / "ref")) < 1e-5


@pytest.mark.slow
def test_another_global_batch_on_another_number_of_processes_needs_strict_false(two_process_run, tmp_path):
    """2 x 8 (16 an update) -> 1 x 8 (8 an update): refused, naming both
    values and what to do; with strict=False, from the same examples (32
    drawn: 4 batches of 8)."""
    shutil.copytree(two_process_run / "ck", tmp_path / "ck")
    refused = launch_one(tmp_path / "refused", "--ckpt", tmp_path / "ck", "--resume", "latest")
    assert refused.returncode == 3, refused.stderr[-3000:]
    error = json.loads((tmp_path / "refused" / "error.json").read_text())["error"]
    assert "num_processes=2 (this run has num_processes=1" in error
    assert "its global batch was 16 examples per update (2 process(es) x batch_size=8" in error
    assert "this run's is 8 (1 process(es) x batch_size=8" in error
    assert "batch_size=16, or gradient_accumulation_steps=2" in error
    assert "pass strict=False" in error and "weights_only=True" in error
    out = tmp_path / "lenient"
    result = launch_one(out, "--ckpt", tmp_path / "ck", "--resume", "latest", "--lenient")
    assert result.returncode == 0, result.stderr[-3000:]
    killed, resumed = records(two_process_run / "killed", until=6), records(out)
    assert_drawn_once([order(killed, 1), order(resumed, 1)])
    assert order(killed, 1) + order(resumed, 1) == order(records(two_process_run / "ref"), 1)
    assert report(out)["global_step"] == 6 + 4  # the 4 batches of 8 left, one update each


@pytest.mark.slow
def test_weights_only_across_numbers_of_processes(two_process_run, tmp_path):
    """A two-process checkpoint's weights into one process, and a
    one-process checkpoint's into two: new runs from step 0."""
    from safetensors.torch import load_file

    ck = two_process_run / "ck" / "step-00000006"
    loop = built(tmp_path, batch_size=5)
    assert loop.load_checkpoint(ck, weights_only=True) == ck
    saved = load_file(ck / "model.safetensors")
    state = loop.networks["model"].unwrapped.state_dict()
    assert all(torch.equal(state[k], saved[k]) for k in saved) and loop.state.global_step == 0
    loop.close()

    assert run(tmp_path / "single", "--ckpt", tmp_path / "ck2", "--batch-size", "16", "--max-steps", "3") == 0
    two = tmp_path / "two"
    result = launch_two(two, "--ckpt", tmp_path / "ck3", "--epochs", "1", "--resume",
                        tmp_path / "ck2" / "step-00000003", "--weights-only")
    assert result.returncode == 0, result.stdout[-3000:]
    done = report(two)
    assert done["num_processes"] == 2 and done["started_at"] == 0 and done["global_step"] == 4
    assert [r["global_step"] for r in records(two)] == [1, 2, 3, 4]
    saved = load_file(tmp_path / "ck2" / "step-00000003" / "model.safetensors")
    loaded = torch.load(two / "loaded.pt", weights_only=True)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


def test_an_epoch_scheduler_keeps_its_epoch_count_while_a_step_scheduler_is_rescaled():
    """Another global batch rescales the count of a scheduler stepped with the
    optimizer (it counts batches); one of ``scheduler_interval="epoch"``
    counts epochs, which mean the same on any number of processes."""
    from types import SimpleNamespace

    from hookloop.checkpointing.elastic import Plan, scale_schedulers

    per_step, per_epoch = object(), object()
    loop = SimpleNamespace(
        accelerator=SimpleNamespace(_schedulers=[per_step, per_epoch]),
        networks={"a": SimpleNamespace(scheduler=per_step, scheduler_interval="step"),
                  "b": SimpleNamespace(scheduler=per_epoch, scheduler_interval="epoch")})
    staged = SimpleNamespace(schedulers=[{"last_epoch": 12, "_step_count": 13},
                                         {"last_epoch": 3, "_step_count": 4}])
    scale_schedulers(loop, staged, Plan(processes=(2, 1), scheduler_ratio=(2, 1)))
    assert staged.schedulers == [{"last_epoch": 24, "_step_count": 25}, {"last_epoch": 3, "_step_count": 4}]
