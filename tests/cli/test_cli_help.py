"""The command's front door: what `hookloop --help` and `hookloop demo --help`
list, the one line a demo without its extra prints, and the one folder every
demo writes under."""

import subprocess
import sys

import pytest

from hookloop.cli import DEMO_LINES, DEMOS, main
from hookloop.examples import distillation, gan_digits, text_classification

#: every demo and the extra it needs, as the help texts are to say
EXPECTED = {"gan": "demo", "digits": "demo", "text": "text", "distill": "text"}


def demo_rows(text):
    """``{demo: its line}`` for the lines of ``text`` that start with a demo's name."""
    rows = {}
    for line in text.splitlines():
        words = line.split()
        if words and words[0] in EXPECTED and line.startswith("  "):
            assert words[0] not in rows, f"{words[0]} listed twice:\n{text}"
            rows[words[0]] = line
    return rows


def check_listing(text):
    rows = demo_rows(text)
    assert set(rows) == set(EXPECTED) == set(DEMOS), text
    for name, extra in EXPECTED.items():
        assert DEMO_LINES[name] in rows[name] and rows[name].endswith(f"[{extra}]"), rows[name]
    assert 'pip install "hookloop[demo]"' in text and 'pip install "hookloop[text]"' in text
    assert "./hookloop-runs/NAME" in text


def test_hookloop_help_lists_every_command_and_every_demo():
    # through the console script's module: what a user's terminal shows
    done = subprocess.run([sys.executable, "-m", "hookloop.cli", "--help"],
                          capture_output=True, text=True, check=True)
    out = done.stdout
    for command, line in (("plugins", "list the plugins a Loop would load"),
                          ("hooks", "print the hook reference"),
                          ("demo", "run a packaged example"),
                          ("new-plugin", "write a ready plugin distribution")):
        assert f"    {command}" in out and line in out, (command, out)
    check_listing(out)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_demo_help_lists_every_demo_not_the_default_demos_options(flag, capsys):
    assert main(["demo", flag]) == 0
    out = capsys.readouterr().out
    check_listing(out)
    assert "--latent-dim" not in out  # the GAN's own options: `hookloop demo gan --help`


def test_a_demos_help_shows_its_options_and_its_folder(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["demo", "gan", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "--latent-dim" in out and "./hookloop-runs/gan" in out


@pytest.mark.parametrize("parse, option, folder", [
    (lambda argv: gan_digits.build_parser().parse_args(argv), "out", "gan"),
    (text_classification.parse_args, "output_dir", "text"),
    (distillation.parse_args, "out", "distill"),
])
def test_every_demo_writes_under_hookloop_runs(parse, option, folder, tmp_path):
    args = parse([])
    assert getattr(args, option) == f"hookloop-runs/{folder}"
    if folder == "distill":  # the fine-tuned teacher too
        assert args.teacher == "hookloop-runs/distill/teacher"
    if folder == "text":  # the name the other demos use works here too
        assert parse(["--out", str(tmp_path)]).output_dir == str(tmp_path)


def test_the_digits_demo_writes_under_hookloop_runs_digits(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "digits", "--epochs", "1"]) == 0
    assert (tmp_path / "hookloop-runs" / "digits" / "train.jsonl").stat().st_size > 0
    assert "log: hookloop-runs/digits/train.jsonl" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["hookloop-runs"]


@pytest.mark.parametrize("demo", ["text", "distill"])
@pytest.mark.parametrize("module", ["transformers", "datasets", "vaderSentiment"])
def test_a_text_demo_without_its_extra_says_which_to_install(demo, module, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, module, None)  # what `import` sees when it is not installed
    assert main(["demo", demo]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err  # one line, no traceback
    assert lines[0].startswith(f"hookloop demo {demo}: needs the 'text' extra")
    assert lines[0].endswith('pip install "hookloop[text]"')
    assert {"vaderSentiment": "vadersentiment"}.get(module, module) in lines[0]


@pytest.mark.parametrize("demo", [text_classification, distillation])
def test_a_text_demo_run_as_a_module_says_so_too(demo, monkeypatch, capsys):
    # `python -m hookloop.examples.text_classification` does not pass through the command
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert demo.main(["--epochs", "1"]) == 2
    assert capsys.readouterr().err.endswith('(datasets is not installed): pip install "hookloop[text]"\n')


def test_the_default_demo_without_its_extra_names_the_demo_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    assert main(["demo"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "hookloop demo gan: needs the 'demo' extra (scikit-learn is not installed): "
        'pip install "hookloop[demo]"']


def test_only_the_main_process_says_an_extra_is_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setenv("RANK", "1")
    assert main(["demo", "text"]) == 2
    assert capsys.readouterr().err == ""
