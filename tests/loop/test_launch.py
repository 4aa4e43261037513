"""Launch mistakes hookloop refuses or warns about at Loop(...), before
anything is prepared, and loop.print once per job."""

import json
import warnings

import launching
import pytest
import torch
from accelerate import Accelerator

from hookloop import Loop
from hookloop.testing import tiny_loop


def no_launch_warnings(caught):
    return [str(w.message) for w in caught if "hookloop: " in str(w.message)
            and ("FSDP" in str(w.message) or "DeepSpeed" in str(w.message) or "fp16" in str(w.message))]


def test_several_launched_processes_but_an_accelerator_of_one_is_refused(monkeypatch):
    accelerator = Accelerator(cpu=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    model = torch.nn.Linear(2, 2)
    prepared = []
    monkeypatch.setattr(accelerator, "prepare", lambda *a, **k: prepared.append(a) or a)
    with pytest.raises(RuntimeError) as caught:
        Loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
             train_data=[(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long))],
             accelerator=accelerator)
    message = str(caught.value)
    assert "WORLD_SIZE=2, LOCAL_WORLD_SIZE=2" in message and "this Accelerator has one" in message
    assert "Accelerator(cpu=True)" in message and "ACCELERATE_USE_CPU=1" in message
    assert "GPU" in message
    assert prepared == []  # refused before anything was prepared


def test_one_launched_process_is_fine(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_loop()
    assert no_launch_warnings(caught) == []


def test_an_fsdp_plugin_accelerate_drops_warns_once(monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")  # Accelerate sets it: put back after the test
    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    assert str(accelerator.distributed_type) != "DistributedType.FSDP"
    with pytest.warns(RuntimeWarning, match=r"FSDP .* was asked for .* but Accelerate did not take it"):
        tiny_loop(accelerator=accelerator)
    with warnings.catch_warnings(record=True) as caught:  # a second loop on it: no second warning
        warnings.simplefilter("always")
        tiny_loop(accelerator=accelerator)
    assert no_launch_warnings(caught) == []


def test_use_deepspeed_in_the_environment_not_taken_warns(monkeypatch):
    accelerator = Accelerator(cpu=True)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # as accelerate launch --use_deepspeed
    with pytest.warns(RuntimeWarning, match=r"DeepSpeed .* was asked for .* did not take it"):
        tiny_loop(accelerator=accelerator)


def test_fp16_on_a_cpu_warns_that_bf16_works():
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    with pytest.warns(RuntimeWarning, match=r"mixed_precision='fp16' on a CPU trains in fp32") as caught:
        tiny_loop(accelerator=accelerator)
    assert "mixed_precision='bf16', which works on a CPU" in str(caught[0].message)


def test_bf16_on_a_cpu_does_not_warn():
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_loop(accelerator=accelerator)
    assert no_launch_warnings(caught) == []


def test_print_is_for_the_main_process_of_the_job(monkeypatch, capsys):
    loop = tiny_loop()
    loop.print("once")
    assert capsys.readouterr().out == "once\n"
    # a local main process that is not the job's main (rank 1's machine): silent
    monkeypatch.setattr(type(loop.accelerator), "is_main_process", property(lambda self: False))
    monkeypatch.setattr(type(loop.accelerator), "is_local_main_process", property(lambda self: True))
    loop.print("twice")
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_multi_gpu_launch_of_a_plain_accelerator_on_a_cpu_is_refused(tmp_path):
    code, output = launching.accelerate_two("launch_checks.py", tmp_path, "plain", timeout=60)
    assert code is not None, "the run hung:\n" + output[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"plain-{rank}.json").read_text())
        assert result["num_processes"] == 1  # the trap: each process thinks it is alone
        assert "error" in result, f"rank {rank} was not refused: {result}\n{output[-3000:]}"
        assert "Accelerator(cpu=True)" in result["error"]
        assert "ACCELERATE_USE_CPU=1" in result["error"]
    assert not (tmp_path / "checkpoints").exists()  # no run started, none wrote a checkpoint


@pytest.fixture(scope="module")
def two_machines(tmp_path_factory):
    """One run of two processes, each on its own "machine" (its local main
    process), with Accelerator(cpu=True, fsdp_plugin=FSDP2): MULTI_CPU DDP."""
    out = tmp_path_factory.mktemp("machines")
    codes, output = launching.two_machines("launch_checks.py", out, "machines", timeout=60)
    assert codes == [0, 0], output[-3000:]
    return [json.loads((out / f"machines-{r}.json").read_text()) for r in (0, 1)], output


@pytest.mark.slow
def test_loop_print_prints_once_per_job_not_once_per_machine(two_machines):
    results, output = two_machines
    assert [r["num_processes"] for r in results] == [2, 2]
    assert output.count("PRINTED-BY-RANK-") == 1 and "PRINTED-BY-RANK-0" in output, output[-3000:]


@pytest.mark.slow
def test_an_fsdp_plugin_run_as_ddp_on_cpu_warns_once_per_job(two_machines):
    results, _output = two_machines
    assert [r["distributed_type"] for r in results] == ["DistributedType.MULTI_CPU"] * 2
    fsdp = [[w for w in r["warnings"] if "FSDP" in w] for r in results]
    assert len(fsdp[0]) == 1 and fsdp[1] == [], results
    assert "plain DDP (MULTI_CPU" in fsdp[0][0]


def elastic_warnings(caught):
    return [str(w.message) for w in caught if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in str(w.message)]


@pytest.mark.parametrize("case", ["first start", "variable set", "a restart", "no restarts", "torch 2.12"])
def test_torchrun_restarts_on_torch_2_13_without_the_store_variable_warn_at_the_first_start(monkeypatch, case):
    # (tests/loop/test_torchelastic.py: without the variable every restart failed to connect)
    monkeypatch.setattr(torch, "__version__", "2.12.1+cpu" if case == "torch 2.12" else "2.13.0+cpu")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0" if case == "no restarts" else "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1" if case == "a restart" else "0")
    if case == "variable set":
        monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    else:
        monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_loop()
    said = elastic_warnings(caught)
    if case == "first start":
        assert len(said) == 1 and "torchrun --max-restarts=3 with torch 2.13.0+cpu" in said[0]
        assert "a restarted group (after a failure, or when a node joins or leaves) cannot connect" in said[0]
    else:
        assert said == []


# -- launching.run_two, the suite's two ranks, against accelerate launch -----------------


@pytest.mark.slow  # one `accelerate launch`, ~4 s
def test_run_two_gives_a_rank_what_accelerate_launch_gives_it(tmp_path):
    """The multi-process tests fork their two ranks from one forkserver
    (launching.run_two) instead of launching each run: what a rank sees must
    be what ``accelerate launch --multi_gpu --num_processes 2`` gives it, but
    for the agent's error file and the store's port."""
    launched, pooled = tmp_path / "launched", tmp_path / "pooled"
    launched.mkdir()
    pooled.mkdir()
    code, output = launching.accelerate_two("launch_env.py", launched)
    assert code == 0, output[-3000:]
    done = launching.run_two("launch_env.py", pooled, check=True)
    agent_only = {"TORCHELASTIC_ERROR_FILE", "MASTER_PORT"}
    for rank in (0, 1):
        a = json.loads((launched / f"rank-{rank}.json").read_text())
        b = json.loads((pooled / f"rank-{rank}.json").read_text())
        assert {k: v for k, v in a["env"].items() if k not in agent_only} == \
            {k: v for k, v in b["env"].items() if k not in agent_only}, rank
        for key in ("num_processes", "distributed_type", "local", "main", "gathered", "threads",
                    "stdout_is_a_tty", "name"):
            assert a[key] == b[key], (rank, key, a[key], b[key])
        assert b["argv"] == [str(pooled)] and b["cwd"] == a["cwd"]
        assert f"rank {rank} says hello" in done.stdout and f"rank {rank} warns" in done.stderr
        assert f"rank {rank} atexit" in output and f"rank {rank} atexit" in done.stdout
    assert json.loads((pooled / "rank-0.json").read_text())["gathered"] == [1.0, 2.0]
    # a rank that fails fails the run, as under the launcher: exit status 1, the
    # interpreter's traceback and its atexit handlers (not multiprocessing's ending)
    bad = launching.run_two("launch_env.py", tmp_path / "no-such-folder")
    assert bad.returncode == 1 and "FileNotFoundError" in bad.stderr
    assert "Traceback (most recent call last)" in bad.stderr and "ForkServerProcess" not in bad.stderr
    assert "atexit" in bad.stdout
