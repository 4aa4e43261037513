"""Kill a run at EVERY file-system operation of its checkpointing, resume it,
and check that it ends exactly where the uninterrupted run ends.

    python tests/scripts/fs_kill.py CASE [--json] [--only K[,K...]] [--keep DIR] [--ops]

prints a summary (K, how many k resumed exactly, the first failures and what
differed); ``--json``: the whole report on stdout (the summary on stderr);
``--ops``: the reference's operations, numbered as k; ``--keep``: every run's
files stay there; ``FS_KILL_DIR``: where the runs write (default /dev/shm).

CASE is one of (see ``CASES``):

``a``   ``fit(eval_every=N)`` with ``Checkpoint(every_steps=N, monitor="eval_loss",
        save_top_k=2)``: every step save falls on an evaluation;
``b``   the same with ``every_steps=3``, ``eval_every=2``: some saves fall on an
        evaluation, some do not;
``c``   ``TrainerCallbacks([EarlyStoppingCallback(...)])`` with
        ``eval_strategy="steps"``, ``eval_steps == every_steps``;
``c2``  the same with ``eval_steps=2``, ``every_steps=3``.

How: this process imports torch and hookloop once (``torch.set_num_threads(1)``)
and forks one child per run (children end with ``os._exit``):

- the reference child trains uninterrupted and counts K, the file-system
  operations made while ``loop.fit`` runs (``os.rename``, ``os.replace``,
  ``os.mkdir``, ``os.makedirs``, ``os.rmdir``, ``os.unlink``, ``os.remove``,
  ``os.fsync``, ``shutil.rmtree``, ``os.open`` with write/create flags,
  ``open``/``io.open`` in a writing mode; nested calls count too, e.g. each
  unlink inside an rmtree). It records the SHA-256 of the final parameters,
  the evaluation history (kept by a stateful plugin, so it is what the
  checkpoints hold), the entries left in the checkpoint root, what ``latest``
  names, ``checkpoint.best`` and the update at which training stopped;
- for every k in 1..K: one child runs the same training from scratch and
  SIGKILLs itself just before the k-th operation (checked: it died of
  SIGKILL); right after, ``latest`` must name a complete checkpoint (one with
  ``hookloop.json``) if it exists; a second child builds the same run with
  ``resume_from="latest"``, calls the same ``fit``, and records the same
  things, which must equal the reference's.

Only hookloop's public API is used (Loop, Checkpoint, hookimpl, resume_from,
TrainerCallbacks). Exit status: 0 if every k resumed exactly, 1 otherwise.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse  # noqa: E402
import builtins  # noqa: E402
import hashlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(1)

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DataLoaderConfiguration, set_seed  # noqa: E402
from torch.optim.lr_scheduler import LambdaLR  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from hookloop import Loop, hookimpl  # noqa: E402
from hookloop.checkpointing import writer  # noqa: E402
from hookloop.plugins import Checkpoint  # noqa: E402

# A save writes its big files in parallel threads: the same operations in an order
# that varies, so the k-th operation would not name the same one in every run.
# Written one after the other here, every k names one operation; the kills that the
# parallel order adds fall in the same window (files of a .tmp folder, before its
# publish), which these runs cover.
writer.WRITE_THREADS = 1

#: the runs; sizes chosen so that one case takes well under 30 s here
CASES = {
    "a": dict(kind="monitor", n=32, epochs=1, every_steps=2, eval_every=2, keep_last=1,
              doc="eval_every == every_steps == 2, monitor='eval_loss', save_top_k=2"),
    "b": dict(kind="monitor", n=32, epochs=1, every_steps=3, eval_every=2, keep_last=1,
              doc="every_steps=3, eval_every=2, monitor='eval_loss', save_top_k=2"),
    "c": dict(kind="trainer", n=32, epochs=4, every_steps=2, eval_steps=2, patience=2, keep_last=2,
              doc="TrainerCallbacks(EarlyStoppingCallback(patience=2)), eval_steps == every_steps == 2"),
    "c2": dict(kind="trainer", n=32, epochs=4, every_steps=3, eval_steps=2, patience=2, keep_last=2,
               doc="TrainerCallbacks(EarlyStoppingCallback(patience=2)), eval_steps=2, every_steps=3"),
}

CHILD_TIMEOUT_S = 120

# -- the originals, for the driver's own files --------------------------------------------

_open = builtins.open
_os_open = os.open
_ORIG = {name: getattr(os, name) for name in
         ("rename", "replace", "mkdir", "makedirs", "rmdir", "unlink", "remove", "fsync", "open")}
_ORIG_RMTREE = shutil.rmtree
_ORIG_IO_OPEN = io.open
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class Injector:
    """Counts the file-system operations made while ``armed``; SIGKILLs this
    process just before the ``kill_at``-th one. ``ops`` describes each one
    (paths relative to ``root``, this process's pid as ``PID``)."""

    def __init__(self, root: Path, kill_at: int | None, marker: Path | None, record: bool):
        self.root = str(root)
        self.kill_at = kill_at
        self.marker = marker
        self.record = record
        self.armed = False
        self.count = 0
        self.ops: list[str] = []
        self._fds: dict[int, str] = {}
        self._pid = str(os.getpid())

    def _name(self, path) -> str:
        try:
            text = os.fsdecode(path) if not isinstance(path, int) else self._fds.get(path, f"fd{path}")
        except TypeError:
            text = repr(path)
        if text.startswith(self.root):
            text = text[len(self.root):].lstrip("/") or "."
        text = text.replace(self._pid, "PID")
        # a save's temporary folder is .tmp-<name>-<run id prefix>-<pid>: the run id is new each run
        return re.sub(r"(\.tmp-[^/]*)-[0-9a-f]{8}-PID", r"\1-RUN-PID", text)

    def _op(self, what: str):
        if not self.armed:
            return
        self.count += 1
        if self.record:
            self.ops.append(what)
        if self.kill_at is not None and self.count == self.kill_at:
            if self.marker is not None:
                with _open(self.marker, "w") as f:
                    f.write(what)
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # not reached

    def install(self):
        inj = self

        def two(name):
            orig = _ORIG[name]

            def wrapped(src, dst, *a, **kw):
                inj._op(f"{name} {inj._name(src)} -> {inj._name(dst)}")
                return orig(src, dst, *a, **kw)
            return wrapped

        def one(name):
            orig = _ORIG[name]

            def wrapped(path, *a, **kw):
                inj._op(f"{name} {inj._name(path)}")
                return orig(path, *a, **kw)
            return wrapped

        def fsync(fd):
            n = fd if isinstance(fd, int) else fd.fileno()
            inj._op(f"fsync {inj._name(n)}")
            return _ORIG["fsync"](fd)

        def os_open(path, flags, *a, **kw):
            if flags & _WRITE_FLAGS:
                inj._op(f"os.open(w) {inj._name(path)}")
            fd = _ORIG["open"](path, flags, *a, **kw)
            if inj.armed:
                inj._fds[fd] = os.fsdecode(path) if not isinstance(path, int) else str(path)
            return fd

        def rmtree(path, *a, **kw):
            inj._op(f"rmtree {inj._name(path)}")
            return _ORIG_RMTREE(path, *a, **kw)

        def any_open(file, mode="r", *a, **kw):
            writing = isinstance(mode, str) and any(c in mode for c in "wax+")
            if writing:
                inj._op(f"open({mode}) {inj._name(file)}")
            f = _ORIG_IO_OPEN(file, mode, *a, **kw)
            if writing and inj.armed and not isinstance(file, int):
                try:
                    inj._fds[f.fileno()] = os.fsdecode(file)
                except (TypeError, OSError, ValueError):
                    pass
            return f

        for name in ("rename", "replace"):
            setattr(os, name, two(name))
        for name in ("mkdir", "makedirs", "rmdir", "unlink", "remove"):
            setattr(os, name, one(name))
        os.fsync = fsync
        os.open = os_open
        shutil.rmtree = rmtree
        builtins.open = any_open
        io.open = any_open


# -- the run --------------------------------------------------------------------------------


class Recorder:
    """Every evaluation seen in ``on_eval_end``: (global_step, epoch, metrics),
    kept in the checkpoints (state_dict / load_state_dict, plain data)."""

    name = "fs-kill-recorder"

    def __init__(self):
        self.history: list = []

    @hookimpl
    def on_eval_end(self, loop, metrics):
        values = {}
        for key, value in metrics.items():
            if any(t in key for t in ("runtime", "per_second", "time")):
                continue  # wall-clock figures (TrainerCallbacks' eval_runtime, ...)
            if isinstance(value, torch.Tensor):
                value = value.item()
            if isinstance(value, (int, float)):
                values[key] = float(value)
        self.history.append([int(loop.state.global_step), int(loop.state.epoch), values])

    def state_dict(self):
        return {"history": json.dumps(self.history)}

    def load_state_dict(self, state):
        self.history = json.loads(state["history"])


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(32, 3))


def build(case: dict, root: Path, resume: bool):
    """The run of ``case`` checkpointing into ``root``: (loop, model,
    checkpoint, recorder, fit keyword arguments)."""
    set_seed(0)
    n = case["n"]
    x, y = torch.randn(n, 8), torch.randint(0, 3, (n,))
    ex, ey = torch.randn(24, 8), torch.randint(0, 3, (24,))
    train = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True,
                       generator=torch.Generator().manual_seed(1))
    # no generator: iterating it draws from the global random state, as training does
    evaluation = DataLoader(TensorDataset(ex, ey), batch_size=8)
    model = _mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=case.get("lr", 1e-2))
    total = case["epochs"] * len(train)
    scheduler = LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3) * max(0.1, 1 - s / total))
    recorder = Recorder()
    kwargs = dict(resume_from="latest") if resume else {}
    if case["kind"] == "monitor":
        accelerator = Accelerator(cpu=True,
                                  dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
        checkpoint = Checkpoint(dir=root, every_steps=case["every_steps"], monitor="eval_loss",
                                save_top_k=2, keep_last=case["keep_last"], signals=None)
        loop = Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=train,
                    eval_data=evaluation, plugins=[checkpoint, recorder], accelerator=accelerator,
                    block=["progress"], **kwargs)
        return loop, model, checkpoint, recorder, dict(epochs=case["epochs"],
                                                       eval_every=case["eval_every"],
                                                       sanity_check=False)
    from transformers import EarlyStoppingCallback, TrainingArguments

    from hookloop.adapters.transformers import TrainerCallbacks

    args = TrainingArguments(output_dir=str(root.parent / "hf"), use_cpu=True, report_to=[],
                             eval_strategy="steps", eval_steps=case["eval_steps"],
                             save_strategy="no", logging_strategy="no",
                             metric_for_best_model="eval_loss", num_train_epochs=case["epochs"],
                             per_device_train_batch_size=8, per_device_eval_batch_size=8,
                             disable_tqdm=True, seed=0)
    # (creating TrainingArguments resets Accelerate's state: before the Accelerator)
    accelerator = Accelerator(cpu=True,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    stopper = EarlyStoppingCallback(early_stopping_patience=case["patience"])
    checkpoint = Checkpoint(dir=root, every_steps=case["every_steps"], every_epoch=False,
                            keep_last=case["keep_last"], signals=None)
    adapter = TrainerCallbacks([stopper], args=args, eval_data=evaluation)
    loop = Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=train,
                plugins=[checkpoint, recorder, adapter], accelerator=accelerator,
                block=["progress"], **kwargs)
    return loop, model, checkpoint, recorder, dict(epochs=case["epochs"], sanity_check=False)


def params_sha(model) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def outcome(root: Path, loop, model, checkpoint, recorder) -> dict:
    best = checkpoint.best
    latest = root / "latest"
    return {
        "params": params_sha(model),
        "history": recorder.history,
        "names": sorted(p for p in os.listdir(root) if p != "latest"),
        "latest": latest.read_text().strip() if latest.exists() else None,
        "best": None if best is None else [Path(best["path"]).name, float(best["value"])],
        "stopped_at": int(loop.state.global_step),
    }


def child(case: dict, root: Path, result: Path, log: Path, kill_at=None, resume=False,
          marker=None, record=False):
    """Body of a forked child; never returns."""
    code = 1
    try:
        fd = _os_open(str(log), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        warnings.simplefilter("ignore")
        injector = Injector(root, kill_at, marker, record)
        injector.install()
        loop, model, checkpoint, recorder, fit = build(case, root, resume)
        started = int(loop.state.global_step)
        injector.armed = True
        try:
            loop.fit(**fit)
        finally:
            injector.armed = False
        out = outcome(root, loop, model, checkpoint, recorder)
        out.update(K=injector.count, ops=injector.ops, started_at=started,
                   resumed_from=None if loop.resumed_from is None else Path(loop.resumed_from).name)
        with _open(result, "w") as f:
            json.dump(out, f)
        code = 0
    except BaseException:  # noqa: BLE001 - reported through the log
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def fork(*args, **kwargs) -> int:
    """Run ``child(*args, **kwargs)`` in a forked process; its wait status."""
    pid = os.fork()
    if pid == 0:
        child(*args, **kwargs)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -1
        time.sleep(0.002)


def describe_status(status: int) -> str:
    if status == -1:
        return f"hung (killed after {CHILD_TIMEOUT_S} s)"
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit {os.WEXITSTATUS(status)}"


def tail(log: Path, n=1500) -> str:
    try:
        return log.read_text()[-n:]
    except OSError:
        return ""


def last_error(log: Path) -> str:
    """The last line of a child's log (the exception, after a traceback)."""
    lines = [line for line in tail(log, 4000).splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def differences(ref: dict, got: dict) -> list[str]:
    out = []
    if got["stopped_at"] != ref["stopped_at"]:
        out.append(f"stopped at update {got['stopped_at']}, not {ref['stopped_at']}")
    if got["params"] != ref["params"]:
        out.append("parameters differ")
    if got["history"] != ref["history"]:
        rs = [h[0] for h in ref["history"]]
        gs = [h[0] for h in got["history"]]
        if rs != gs:
            missing = [s for s in rs if s not in gs] or None
            extra = [s for s in gs if s not in rs] or None
            out.append(f"evaluation steps {gs}, not {rs}"
                       + (f" (missing {missing})" if missing else "")
                       + (f" (extra {extra})" if extra else ""))
        else:
            bad = [r[0] for r, g in zip(ref["history"], got["history"]) if r != g]
            out.append(f"evaluation metrics differ at steps {bad}")
    if got["names"] != ref["names"]:
        out.append(f"checkpoints left {got['names']}, not {ref['names']}")
    if got["latest"] != ref["latest"]:
        out.append(f"latest names {got['latest']}, not {ref['latest']}")
    if got["best"] != ref["best"]:
        out.append(f"best {got['best']}, not {ref['best']}")
    return out


def scratch():
    """Where the runs write: a RAM file system (/dev/shm) where there is one,
    so that the fsync of every save costs nothing (a SIGKILL loses nothing
    from the page cache, so this changes nothing the test can observe);
    else the default temporary directory. ``FS_KILL_DIR`` overrides it."""
    chosen = os.environ.get("FS_KILL_DIR")
    if chosen:
        return chosen
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def run_case(name: str, only=None, keep=None, progress=None) -> dict:
    """Test every k (or those in ``only``) of case ``name``: the report."""
    base = Path(keep) if keep else Path(tempfile.mkdtemp(prefix=f"fs-kill-{name}-", dir=scratch()))
    base.mkdir(parents=True, exist_ok=True)
    try:
        return _run_case(name, base, only, keep, progress)
    finally:
        if not keep:
            _ORIG_RMTREE(base, ignore_errors=True)


def _run_case(name, base, only, keep, progress) -> dict:
    case = CASES[name]
    t0 = time.monotonic()
    warm_up(case, base)

    ref_dir = base / "reference"
    ref_dir.mkdir()
    status = fork(case, ref_dir / "ck", ref_dir / "result.json", ref_dir / "log", record=True)
    if status != 0:
        raise SystemExit(f"fs_kill: the reference run failed ({describe_status(status)}):\n"
                         f"{tail(ref_dir / 'log', 4000)}")
    ref = json.loads((ref_dir / "result.json").read_text())
    K = ref["K"]
    ks = range(1, K + 1) if not only else [k for k in only if 1 <= k <= K]
    failures, passed = [], 0
    for k in ks:
        d = base / f"k{k:04d}"
        d.mkdir()
        root = d / "ck"
        problems = []
        status = fork(case, root, d / "killed.json", d / "log", kill_at=k, marker=d / "killed-at")
        killed_at = (d / "killed-at").read_text() if (d / "killed-at").exists() else None
        if not (status > 0 and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            problems.append(f"the run to kill at op {k} ended with {describe_status(status)}, "
                            f"not SIGKILL: {last_error(d / 'log')}")
        elif killed_at != ref["ops"][k - 1]:
            problems.append(f"not deterministic: op {k} was {killed_at!r}, "
                            f"in the reference {ref['ops'][k - 1]!r}")
        latest = root / "latest"
        left_after_kill = sorted(os.listdir(root)) if root.is_dir() else []
        if latest.exists():
            target = latest.read_text().strip()
            if not (root / target / "hookloop.json").is_file():
                problems.append(f"after the kill, latest names {target!r}, which "
                                f"{'is incomplete' if (root / target).exists() else 'does not exist'}"
                                f" (root holds {left_after_kill})")
        status = fork(case, root, d / "result.json", d / "log", resume=True)
        if status != 0:
            problems.append(f"the resumed run failed ({describe_status(status)}): "
                            f"{last_error(d / 'log')}")
        else:
            got = json.loads((d / "result.json").read_text())
            diff = differences(ref, got)
            if diff:
                final = " (the uninterrupted run's final checkpoint)" \
                    if got["resumed_from"] == ref["latest"] else ""
                problems += [f"resumed from {got['resumed_from']}{final} (update "
                             f"{got['started_at']}): " + "; ".join(diff)]
        if problems:
            failures.append({"k": k, "op": ref["ops"][k - 1], "left": left_after_kill,
                             "problems": problems})
        else:
            passed += 1
        if not keep:
            _ORIG_RMTREE(d, ignore_errors=True)
        if progress:
            progress(k, K, bool(problems))
    seconds = time.monotonic() - t0
    return {"case": name, "doc": case["doc"], "K": K, "tested": len(ks), "passed": passed,
            "failed": len(failures), "seconds": round(seconds, 1), "failures": failures,
            "reference": {k: ref[k] for k in ("stopped_at", "names", "latest", "best", "history")},
            "ops": ref["ops"]}


def warm_up(case: dict, base: Path):
    """Import and run once, in this process, what every child needs (lazy
    imports, first-call setup, a save), in a scratch directory: forks start warm."""
    from hookloop.testing import reset_accelerate

    reset_accelerate()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        devnull = _open(os.devnull, "w")
        saved = os.dup(1), os.dup(2)
        os.dup2(devnull.fileno(), 1)
        os.dup2(devnull.fileno(), 2)
        try:
            loop, _, _, _, fit = build(case, base / "warm", resume=False)
            fit.pop("epochs")
            loop.fit(max_steps=case["every_steps"] + 1, **fit)
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            devnull.close()
    del loop
    reset_accelerate()
    _ORIG_RMTREE(base / "warm", ignore_errors=True)


def _generic(text: str, root_hint="/ck") -> str:
    """A problem's text without what differs from one k to the next (pids,
    temporary paths), to group the k that failed alike."""
    import re

    text = re.sub(r"(\.trash-[^'\s,]*-|latest\.tmp-|\.tmp-probe-)\d+", r"\1PID", text)
    return re.sub(r"[^\s']*/k\d{4}" + root_hint, "ROOT", text)


def groups(failures: list) -> list:
    """[(first k, last k, count, problems)] of consecutive k that failed alike."""
    out = []
    for f in failures:
        key = [_generic(p) for p in f["problems"]]
        if out and out[-1][3] == key and out[-1][1] == f["k"] - 1:
            out[-1][1], out[-1][2] = f["k"], out[-1][2] + 1
        else:
            out.append([f["k"], f["k"], 1, key])
    return out


def summary(report: dict, first=8) -> str:
    lines = [f"case {report['case']}: {report['doc']}",
             f"  reference: stopped at update {report['reference']['stopped_at']}, evaluations at "
             f"{[h[0] for h in report['reference']['history']]}, checkpoints "
             f"{report['reference']['names']}, best {report['reference']['best']}",
             f"  K={report['K']} file-system operations; {report['passed']}/{report['tested']} k "
             f"resumed exactly; {report['seconds']} s"]
    ops = report["ops"]
    found = groups(report["failures"])
    for lo, hi, _, problems in found[:first]:
        where = f"k={lo}" if lo == hi else f"k={lo}..{hi}"
        span = ops[lo - 1] if lo == hi else f"{ops[lo - 1]} ... {ops[hi - 1]}"
        lines.append(f"  {where} (killed before: {span})")
        for p in problems:
            lines.append(f"      {p}")
    if len(found) > first:
        rest = [f"{lo}..{hi}" if lo != hi else str(lo) for lo, hi, _, _ in found[first:]]
        lines.append(f"  ... and {len(found) - first} more groups of failing k: {', '.join(rest)}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    parser.add_argument("--only", help="test only these k (comma-separated)")
    parser.add_argument("--keep", help="keep every run's files under this directory")
    parser.add_argument("--ops", action="store_true", help="also list the reference's operations")
    args = parser.parse_args(argv)
    only = [int(k) for k in args.only.split(",")] if args.only else None
    report = run_case(args.case, only=only, keep=args.keep)
    if args.json:  # the report on stdout, the summary on stderr
        print(json.dumps(report, indent=1))
        print(summary(report), file=sys.stderr)
    else:
        print(summary(report))
        if args.ops:
            for i, op in enumerate(report["ops"], 1):
                print(f"  {i:4d} {op}")
    return 0 if report["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
