"""Every byte hookloop reads from a checkpoint folder is bounded and confined.

A checkpoint root may be shared with others, downloaded, or on a disk that
went bad. Each test damages a root one run wrote, then resumes (or starts
the next fit) and checks that the result is a CheckpointError naming the
file (an explicit path), or a warning naming it and the newest usable
checkpoint ("latest", and every scan of the root): never a hang, an
unbounded read, a RecursionError, a file outside the root followed, or its
content echoed. Each failed on hookloop 0.2.
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import zlib

import pytest

from hookloop import checkpointing
from hookloop.checkpointing import saving
from hookloop.checkpointing import CheckpointError
from hookloop.plugins import Checkpoint
from hookloop.testing import reset_accelerate, tiny_loop

DEEP = 100_000


def make(root, resume_from=None, keep_last=None):
    """tiny_loop (8 batches an epoch) saving every 2 updates into ``root``."""
    reset_accelerate()
    return tiny_loop([Checkpoint(dir=root, every_steps=2, keep_last=keep_last, signals=None)],
                     resume_from=resume_from)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A root with step-00000002 and step-00000004 (``latest``), written once."""
    root = tmp_path_factory.mktemp("written") / "run"
    make(root).fit(max_steps=4)
    reset_accelerate()
    return root


@pytest.fixture
def root(written, tmp_path):
    """A copy of ``written`` for this test to damage."""
    copy = tmp_path / "run"
    shutil.copytree(written, copy, symlinks=True)
    assert (copy / "latest").read_text().strip() == "step-00000004"
    return copy


def nest(folder):
    """A ``hookloop.json`` nested 100,000 deep."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hookloop.json").write_text("[" * DEEP + "]" * DEEP)


def manifest_crc(doc):
    body = {k: v for k, v in doc.items() if k != "manifest_crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def within(seconds, fn, unblock=None):
    """``fn()`` in a thread, with a deadline: its result, or its exception
    raised here. Past the deadline, ``unblock()`` frees the thread and the
    test fails."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if unblock is not None:
            unblock()
        thread.join(30)
        pytest.fail(f"still running after {seconds} s: it hangs")
    if "error" in out:
        raise out["error"]
    return out.get("value")


def release_fifo(fifo):
    """Open a FIFO for writing and close it: a reader blocked on it gets EOF."""
    def unblock():
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return
        os.close(fd)
    return unblock


# -- 1. JSON nested absurdly deep ------------------------------------------------------------


def test_a_manifest_nested_100k_deep_named_by_latest_falls_back_with_a_warning(root):
    nest(root / "step-00000004")
    with pytest.warns(RuntimeWarning, match=r"step-00000004.*hookloop.json is nested too deep"):
        loop = make(root, resume_from="latest")
    assert loop.resumed_from == root / "step-00000002"


def test_a_manifest_nested_100k_deep_given_explicitly_is_a_checkpoint_error_naming_it(root):
    nest(root / "step-00000004")
    with pytest.raises(CheckpointError, match=r"step-00000004'?: hookloop.json is nested too deep"):
        make(root, resume_from=root / "step-00000004")


def test_a_foreign_folder_with_a_hostile_manifest_never_stops_the_next_fit(root):
    nest(root / "step-00000999")  # someone else's folder in the root: it names no step of ours
    with pytest.warns(RuntimeWarning, match=r"skipping .*step-00000999.*nested too deep"):
        loop = make(root, resume_from="latest", keep_last=2)  # rotates at fit start and each save
        loop.fit(max_steps=6)
    assert loop.resumed_from == root / "step-00000004"
    assert (root / "latest").read_text().strip() == "step-00000006"
    assert (root / "step-00000999" / "hookloop.json").exists()  # left alone, never rotated away
    with pytest.warns(RuntimeWarning, match=r"skipping .*step-00000999"):
        scan = saving.Scan(root)  # (each manifest read once: one warning)
        assert scan.best(loop.state.run, "loss", "min") == []
        assert scan.foreign(loop.state.run) == []


def test_a_fresh_run_starts_beside_a_foreign_folder_with_a_hostile_manifest(tmp_path):
    root = tmp_path / "fresh"
    nest(root / "step-00000999")
    with pytest.warns(RuntimeWarning, match=r"skipping .*step-00000999"):
        make(root).fit(max_steps=2)
    assert (root / "latest").read_text().strip() == "step-00000002"


def test_the_newest_run_folder_holding_only_a_hostile_folder_is_skipped(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Checkpoint() without dir: ./checkpoints/version_<N>
    reset_accelerate()
    tiny_loop([Checkpoint(every_steps=2, signals=None)]).fit(max_steps=2)
    base = tmp_path / "checkpoints"
    nest(base / "version_1" / "step-00000009")
    reset_accelerate()
    with pytest.warns(RuntimeWarning, match=r"skipping run folder .*version_1"):
        loop = tiny_loop([Checkpoint(every_steps=2, signals=None)], resume_from="latest")
    assert loop.resumed_from == base / "version_0" / "step-00000002"


# -- 2. no hang, no unbounded read -----------------------------------------------------------


@pytest.mark.parametrize("where", ["latest", "step-00000004/hookloop.json"])
def test_a_fifo_is_never_opened_and_nothing_hangs(root, where):
    fifo = root / where
    fifo.unlink()
    os.mkfifo(fifo)
    if where == "latest":
        with pytest.raises(CheckpointError, match=r"latest' is a FIFO \(named pipe\), not a regular file"):
            within(30, lambda: make(root, resume_from="latest"), release_fifo(fifo))
    else:  # resuming, and every scan of the root at the fit's start (run ownership, rotation)
        def resume_and_fit():
            loop = make(root, resume_from="latest", keep_last=2)
            loop.fit(max_steps=3)
            return loop

        with pytest.warns(RuntimeWarning, match=r"step-00000004.*hookloop.json' is a FIFO"):
            loop = within(30, resume_and_fit, release_fifo(fifo))
        assert loop.resumed_from == root / "step-00000002"
        assert (root / "latest").read_text().strip() == "step-00000003"


CHILD = """
import sys
from hookloop.plugins import Checkpoint
from hookloop.testing import tiny_loop
try:
    tiny_loop([Checkpoint(dir=sys.argv[1], signals=None)], resume_from="latest")
except Exception as exc:
    print("RAISED", type(exc).__name__, exc)
else:
    print("RESUMED")
"""


def test_latest_linked_to_dev_zero_is_refused_at_once(root):
    (root / "latest").unlink()
    os.symlink("/dev/zero", root / "latest")

    def cap():  # an unbounded read meets a MemoryError here, not the machine's memory
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # a CUDA torch maps ~4 GiB at import

    try:
        done = subprocess.run([sys.executable, "-c", CHILD, str(root)], capture_output=True, text=True,
                              timeout=240, preexec_fn=cap)
    except subprocess.TimeoutExpired:
        pytest.fail("resuming read /dev/zero for 240 s")
    assert "RAISED CheckpointError" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "latest' leads to '/dev/zero' (a symbolic link), outside" in done.stdout


def test_a_latest_bigger_than_a_checkpoint_name_is_refused(root):
    (root / "latest").write_text("step-00000004" + " " * (1 << 20) + "\n")
    with pytest.raises(CheckpointError, match=r"latest' is \d+ bytes, more than 512"):
        make(root, resume_from="latest")


def test_a_manifest_bigger_than_16_mib_is_refused_naming_it(root):
    ckpt = root / "step-00000004"
    doc = json.loads((ckpt / "hookloop.json").read_text())
    doc["padding"] = "x" * (17 << 20)
    doc["manifest_crc32"] = manifest_crc(doc)
    (ckpt / "hookloop.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"step-00000004/hookloop.json' is \d+ bytes, more than"):
        make(root, resume_from=ckpt)


# -- 3. nothing outside the root is followed, nor echoed --------------------------------------


def test_latest_linked_to_a_file_outside_the_root_is_refused_without_echoing_it(root, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("SECRET-first-line\nstep-00000002\n")
    (root / "latest").unlink()
    os.symlink(outside, root / "latest")
    with pytest.raises(CheckpointError) as info:
        make(root, resume_from="latest")
    message = str(info.value)
    assert "latest' leads to" in message and str(outside) in message and "outside" in message
    assert "SECRET" not in message


def test_latest_linked_to_a_file_inside_the_root_is_followed(root):
    (root / "pointer").write_text("step-00000002\n")
    (root / "latest").unlink()
    os.symlink("pointer", root / "latest")
    assert make(root, resume_from="latest").resumed_from == root / "step-00000002"


def test_a_checkpoint_folder_that_is_a_link_elsewhere_is_never_loaded(root, tmp_path):
    copy = tmp_path / "elsewhere" / "step-00000004"
    shutil.copytree(root / "step-00000004", copy)
    os.symlink(copy, root / "step-00000006")
    (root / "latest").write_text("step-00000006\n")
    with pytest.warns(RuntimeWarning, match=r"names 'step-00000006', which is not usable .*"
                                            r"step-00000006' is a symbolic link to"):
        loop = make(root, resume_from="latest")
    assert loop.resumed_from == root / "step-00000004"
    with pytest.raises(CheckpointError, match=r"step-00000006' is a symbolic link to '.*elsewhere"):
        make(root, resume_from=root / "step-00000006")


def test_a_file_of_a_checkpoint_linked_out_of_it_is_refused_naming_it(root, tmp_path):
    ckpt = root / "step-00000004"
    outside = tmp_path / "weights.safetensors"
    shutil.copy(ckpt / "model.safetensors", outside)  # the same bytes: size and checksum agree
    (ckpt / "model.safetensors").unlink()
    os.symlink(outside, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors leads to '.*weights.safetensors'.*outside"):
        make(root, resume_from=ckpt)


@pytest.mark.parametrize("entry", ["../step-00000002/model.safetensors", "absolute"])
def test_a_manifest_entry_out_of_its_checkpoint_is_refused_naming_it(root, entry):
    ckpt = root / "step-00000004"
    target = root / "step-00000002" / "model.safetensors"
    if entry == "absolute":
        entry = str(target)
    doc = json.loads((ckpt / "hookloop.json").read_text())
    data = target.read_bytes()
    doc["files"][entry] = len(data)
    doc["crc32"][entry] = zlib.crc32(data)
    doc["manifest_crc32"] = manifest_crc(doc)  # only the entry check can tell
    (ckpt / "hookloop.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=rf"lists '{entry}' in 'files', which is not a file of "
                                              r"the checkpoint"):
        make(root, resume_from=ckpt)


# -- 4. latest never names a temporary folder -------------------------------------------------


@pytest.mark.parametrize("prefix", [".tmp-", ".trash-"])
def test_latest_naming_a_temporary_folder_falls_back_to_the_newest_checkpoint(root, prefix):
    name = f"{prefix}step-00000006"
    shutil.copytree(root / "step-00000004", root / name)  # complete: only its name tells
    (root / "latest").write_text(name + "\n")
    with pytest.warns(RuntimeWarning, match=rf"latest' names '{name}'.*not followed"):
        loop = make(root, resume_from="latest")
    assert loop.resumed_from == root / "step-00000004"


def test_latest_naming_a_temporary_folder_never_stops_the_fit_that_resumed(root):
    # 0.3: the rotation at fit start read latest again and raised NotACheckpointName
    name = ".tmp-step-00000006-deadbeef-1"
    shutil.copytree(root / "step-00000004", root / name)  # what a save killed before its rename left
    (root / "latest").write_text(name + "\n")
    with pytest.warns(RuntimeWarning, match=rf"latest' names '{name}'.*not followed"):
        loop = make(root, resume_from="latest", keep_last=1)
    loop.fit(max_steps=6)
    assert loop.resumed_from == root / "step-00000004"
    assert (root / "latest").read_text().strip() == "step-00000006"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000006"]  # cleaned, rotated


def test_latest_names_what_the_saving_code_writes_a_generation_too(root):
    # a save of the position latest names takes the next generation: step-00000004.1
    shutil.copytree(root / "step-00000004", root / "step-00000004.1")
    (root / "latest").write_text("step-00000004.1\n")
    assert make(root, resume_from="latest").resumed_from == root / "step-00000004.1"
    assert checkpointing.read_latest(root) == "step-00000004.1"


def test_the_helper_refuses_what_is_not_a_regular_file_inside_its_root(tmp_path):
    from hookloop.checkpointing import store as safe_read

    (tmp_path / "dir").mkdir()
    (tmp_path / "small").write_bytes(b"12345")
    with pytest.raises(CheckpointError, match="is a directory"):
        safe_read.read_checked(tmp_path / "dir", tmp_path, limit=10, what="x")
    with pytest.raises(CheckpointError, match="5 bytes, more than 4"):
        safe_read.read_checked(tmp_path / "small", tmp_path, limit=4, what="x")
    assert safe_read.read_checked(tmp_path / "small", tmp_path, limit=5, what="x") == b"12345"
    with pytest.raises(CheckpointError, match="nested too deep|nested more than"):
        safe_read.loads_json(b"[" * 300 + b"]" * 300, tmp_path / "x.json")
    for bad in ("../x", "/x", "a//b", "./a", "a\\b", ""):
        assert safe_read.relative_entry(bad) is not None, bad
    assert safe_read.relative_entry("sub/model.safetensors") is None
