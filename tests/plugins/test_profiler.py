"""The built-in ``torch-profiler`` plugin (``hookloop.plugins.Profiler``): a
window of updates profiled with torch.profiler, its trace written where
Perfetto and TensorBoard read it, its top operators printed, no profiler left
running."""

import json

import launching
import pytest
import torch
from accelerate import Accelerator
from paths import ROOT
from torch.profiler._trace_validator import validate_trace  # torch.profiler's reader of its Chrome traces

from hookloop import hookimpl
from hookloop.cli import main
from hookloop.plugins import Profiler
from hookloop.testing import tiny_loop

# tiny_loop: 64 examples, batch 8 (8 updates an epoch), an MLP of two Linear layers


def trace_of(directory):
    """The one trace file in ``directory``, read by torch.profiler's own
    reader (which also checks it), and its events."""
    traces = sorted(directory.glob("*.pt.trace.json"))
    assert len(traces) == 1, f"expected one trace in {directory}, found {traces}"
    passed, violations = validate_trace(str(traces[0]))
    assert passed, violations
    return traces[0], json.loads(traces[0].read_text())["traceEvents"]


def step_markers(events):
    return sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))


def count(events, name):
    return sum(e.get("name") == name for e in events)


def test_a_fit_writes_a_trace_of_its_window_and_prints_the_top_operators(tmp_path, capsys):
    profiler = Profiler(dir=tmp_path / "prof")
    tiny_loop([profiler]).fit(epochs=1)
    path, events = trace_of(tmp_path / "prof")
    assert path.name.startswith("rank0.") and profiler.traces == [path]
    # the default window: update 1 skipped, update 2 warms up, updates 3 to 5 recorded
    # (ProfilerStep#k is the fit's update k + 1)
    assert step_markers(events) == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]
    assert count(events, "aten::linear") == 3 * 2  # three forward passes of two layers
    assert count(events, "aten::addmm") >= 3 * 2
    out = capsys.readouterr().out
    assert f"Profiler: updates 3-5 (global_step), by self_cpu_time_total; trace {path}" in out
    (table,) = profiler.tables
    assert f"trace {path}\n{table}" in out and "Self CPU" in table
    assert "aten::addmm" in table  # the top operators by name


def test_one_profiler_step_per_update_under_gradient_accumulation(tmp_path, capsys):
    loop = tiny_loop([Profiler(dir=tmp_path, wait=0, warmup=1, active=2)],
                     accelerator=Accelerator(gradient_accumulation_steps=2))
    loop.fit(epochs=1)  # 8 batches, 4 updates
    assert loop.state.global_step == 4
    _, events = trace_of(tmp_path)
    assert step_markers(events) == ["ProfilerStep#1", "ProfilerStep#2"]
    assert count(events, "aten::linear") == 2 * 2 * 2  # 2 updates of 2 micro-batches of 2 layers
    assert "Profiler: updates 2-3 (global_step)" in capsys.readouterr().out


def test_an_evaluation_inside_the_window_is_not_profiled(tmp_path):
    evaluated = []

    class Probe:
        @hookimpl
        def on_eval_start(self, loop):
            evaluated.append(loop.state.global_step)

    tiny_loop([Profiler(dir=tmp_path), Probe()], eval_data=True).fit(epochs=1, eval_every=2)
    assert 4 in evaluated  # after update 4: inside the recorded updates 3-5
    _, events = trace_of(tmp_path)
    # the three training forward passes only (each evaluation would add 2 batches of 2 layers)
    assert count(events, "aten::linear") == 3 * 2


def test_a_fit_that_ends_inside_the_window_writes_what_it_recorded(tmp_path, capsys):
    tiny_loop([Profiler(dir=tmp_path)], n=32).fit(epochs=1)  # 4 updates
    _, events = trace_of(tmp_path)
    assert step_markers(events) == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]  # #4: the fit's end
    assert count(events, "aten::linear") == 2 * 2
    assert "Profiler: updates 3-4 (global_step)" in capsys.readouterr().out


def test_a_fit_that_ends_before_the_window_warns_and_writes_nothing(tmp_path):
    with pytest.warns(RuntimeWarning, match="the fit ended after 2 updates, before update 3, the first it records"):
        tiny_loop([Profiler(dir=tmp_path)], n=16).fit(epochs=1)
    assert list(tmp_path.iterdir()) == []
    assert not torch.autograd._profiler_enabled()


@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup:UserWarning")  # torch's, for warmup=0
@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events:UserWarning")  # torch's: a table per window
def test_repeat_writes_a_trace_per_window_counted_from_each_fit_start(tmp_path, capsys):
    profiler = Profiler(dir=tmp_path, wait=1, warmup=0, active=1, repeat=2)
    loop = tiny_loop([profiler])
    loop.fit(epochs=1)
    loop.fit(epochs=2)  # updates 9 to 16: a window of its own
    assert [step_markers(json.loads(t.read_text())["traceEvents"]) for t in profiler.traces] == [
        ["ProfilerStep#1"], ["ProfilerStep#3"]] * 2
    assert sorted(tmp_path.iterdir()) == sorted(profiler.traces)
    out = capsys.readouterr().out
    assert [line.split(" (")[0] for line in out.splitlines() if line.startswith("Profiler: ")] == [
        "Profiler: update 2", "Profiler: update 4", "Profiler: update 10", "Profiler: update 12"]


def test_a_fit_that_raises_leaves_no_profiler_running(tmp_path):
    class Boom:
        @hookimpl
        def after_step(self, loop):
            if loop.state.global_step == 4:  # inside the recorded window
                raise RuntimeError("boom at update 4")

    with pytest.raises(RuntimeError, match="boom at update 4"):
        tiny_loop([Profiler(dir=tmp_path), Boom()]).fit(epochs=1)
    assert not torch.autograd._profiler_enabled()
    assert list(tmp_path.iterdir()) == []  # a failed fit's partial window is not written
    with torch.profiler.profile() as again:  # and the next profile starts and records
        torch.ones(2).add(1)
    assert "aten::add" in {event.name for event in again.events()}


def test_bad_options_are_refused_naming_the_argument(tmp_path):
    with pytest.raises(ValueError, match="Profiler: active must be an int >= 1, got 0"):
        Profiler(dir=tmp_path, active=0)
    with pytest.raises(ValueError, match="Profiler: sort_by must be one of .*'self_cpu_time_total'.*, got 'cpu'"):
        Profiler(dir=tmp_path, sort_by="cpu")
    with pytest.raises(TypeError, match="Profiler: activities must be torch.profiler.ProfilerActivity values"):
        Profiler(dir=tmp_path, activities=["cpu"])


def test_listed_by_hookloop_plugins_given_by_name_and_beside_the_hook_profiler(tmp_path, capsys, monkeypatch):
    assert main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    row = rows["torch-profiler"]
    assert row["object"] == "hookloop.plugins.profiler.Profiler" and row["status"] == "available"
    assert row["changes_training"] is False and "after_step" in row["hooks"]
    loop = tiny_loop([("torch-profiler", {"dir": str(tmp_path), "active": 2})])
    assert isinstance(loop.plugins.get("torch-profiler"), Profiler)
    # the hook timings of plugins/hookloop-profiler are named "profiler": both run together
    monkeypatch.syspath_prepend(str(ROOT / "plugins" / "hookloop-profiler" / "src"))
    from hookloop_profiler import Profiler as HookTimings

    loop = tiny_loop([Profiler(dir=tmp_path / "both"), HookTimings(print_table=False)])
    assert {"profiler", "torch-profiler"} <= set(loop.plugins.names())
    loop.fit(epochs=1)
    trace_of(tmp_path / "both")


@pytest.mark.slow
def test_every_process_writes_its_trace_and_the_main_process_prints(tmp_path):
    result = launching.run_two("profiler_two_processes.py", tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert json.loads((tmp_path / "ranks.json").read_text()) == [0, 1]
    for rank in (0, 1):
        (trace,) = (tmp_path / "prof").glob(f"rank{rank}.*.pt.trace.json")
        assert step_markers(json.loads(trace.read_text())["traceEvents"]) == [
            "ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]
    assert result.stdout.count("Profiler: updates 3-5 (global_step)") == 1
