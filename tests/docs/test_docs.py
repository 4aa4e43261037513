"""The hook reference stays honest: every hook documented to the template,
and listed in the README."""

import inspect
from pathlib import Path

import pytest

from hookloop import hookspecs
from hookloop.manager import hook_names
from paths import ROOT, SCRIPTS  # noqa: F401

README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("hook", hook_names())
def test_every_hook_is_documented_to_the_template(hook):
    func = getattr(hookspecs, hook)
    doc = inspect.getdoc(func) or ""
    summary = doc.split("\n\n")[0].strip()
    assert summary.endswith(".") and summary[0].isupper(), f"{hook}: no summary sentence"
    for arg in inspect.signature(func).parameters:
        assert f":param {arg}:" in doc, f"{hook}: argument {arg!r} undocumented"
    if func.hookloop_spec.get("firstresult"):
        assert "Stops at the first non-None result." in doc, hook
    else:  # a broadcast hook whose results the loop uses documents them
        assert "Return value ignored." in doc or ":return:" in doc, hook
    assert ".. versionadded::" in doc, hook


@pytest.mark.parametrize("hook", hook_names())
def test_every_hook_is_in_the_readme(hook):
    assert f"`{hook}" in README or f"/ `{hook}" in README or f" {hook}(" in README, hook


def test_the_architecture_names_are_kept():
    names = hook_names()
    for required in ("before_step", "after_backward", "on_epoch_end", "training_step",
                     "compute_loss", "on_exception"):
        assert required in names


# -- the plugin-writing guide, docs/plugins.md ---------------------------------

GUIDE_PATH = ROOT / "docs" / "plugins.md"


def _docs_hooks():
    """docs/hooks.py, the script that generates the guide's hook reference."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", GUIDE_PATH.parent / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_guide_s_hook_reference_is_generated_from_the_docstrings():
    generator = _docs_hooks()
    assert generator.current(GUIDE_PATH.read_text()) == generator.reference(), (
        "docs/plugins.md's hook reference is out of date: run python docs/hooks.py")


@pytest.mark.parametrize("hook", hook_names())
def test_every_hook_is_in_the_plugin_guide(hook):
    section = _docs_hooks().current(GUIDE_PATH.read_text())
    assert f"### `{hook}(" in section, hook
    entry = section.split(f"### `{hook}(", 1)[1].split("\n### ", 1)[0]
    assert "(undocumented)" not in entry and "*Added in" in entry, hook


def test_the_guide_s_worked_example_and_its_test_run(tmp_path, monkeypatch, capsys):
    import re

    import torch

    from hookloop.testing import HookRecorder, reset_accelerate, tiny_loop

    text = GUIDE_PATH.read_text()

    def block(section):
        body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
        (code,) = re.findall(r"```python\n(.*?)```", body, flags=re.S)
        return code

    blocks = [block("A worked example"), block("Testing a plugin")]
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(blocks[0], "docs/plugins.md:example", "exec"), namespace)
    keep_best, loop = namespace["keep_best"], namespace["loop"]
    saved = torch.load(tmp_path / "best.pt")
    assert saved["eval_loss"] == keep_best.best and loop.state.epoch == 6
    # the saved weights are those that were evaluated: evaluating them again gives the saved loss
    model = loop.networks["model"].unwrapped
    model.load_state_dict(saved["weights"])
    assert loop.evaluate()["eval_loss"] == pytest.approx(saved["eval_loss"], abs=1e-6)
    assert f"epoch {saved['epoch']}: eval_loss" in capsys.readouterr().out

    reset_accelerate()
    exec(compile(blocks[1], "docs/plugins.md:test", "exec"), namespace)
    namespace["test_keep_best_saves_the_weights_of_the_best_epoch"](
        tiny_loop=tiny_loop, tmp_path=tmp_path, hookloop_recorder=HookRecorder())


def test_the_guide_s_metric_plugin_runs():
    import re

    text = GUIDE_PATH.read_text()
    body = text.split("\n## When hooks run\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", body, flags=re.S)
    namespace = {}
    code = code.replace("seen = ExamplesSeen()", "seen = ExamplesSeen()\nseen = counted(seen)")
    namespace["counted"] = _counting
    exec(compile("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
                 "from hookloop import Loop, hookimpl\n" + code, "docs/plugins.md:metric", "exec"),
         namespace)
    assert 0.0 <= namespace["metrics"]["eval_top2"] <= 1.0
    assert namespace["metrics"]["eval_top2"] >= namespace["metrics"]["eval_accuracy"]
    # the accumulating plugin, as written: every example once in every evaluation
    assert _COUNTS == [("sanity", 16), ("eval", 64)]


_COUNTS = []


def _counting(plugin):
    """The guide's plugin, with a note of each evaluation's count."""
    from hookloop import hookimpl

    end = type(plugin).on_eval_end

    class Counted(type(plugin)):
        @hookimpl
        def on_eval_end(self, loop, metrics):
            end(self, loop, metrics)
            _COUNTS.append((loop.state.stage, metrics["eval_examples"]))

    return Counted()


# -- "Writing a strategy": built from the kit, in Lightning's order ------------------


def _strategy_block():
    import re

    text = GUIDE_PATH.read_text()
    body = text.split("\n## Writing a strategy\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)[0]


def _lightning_by_hand(setup, epochs):
    """Lightning's GAN step order, written by hand on Accelerate."""
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator

    namespace = {}
    exec(setup, namespace)
    G, D, ring = namespace["G"], namespace["D"], namespace["ring"]
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = Accelerator()
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
    data = DataLoader(TensorDataset(ring), batch_size=64, shuffle=True)
    G, D, opt_g, opt_d, data = accelerator.prepare(G, D, opt_g, opt_d, data)

    def bce(logits, target):
        return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))

    for _ in range(epochs):
        for (real,) in data:
            z = torch.randn(real.shape[0], 4, device=real.device)
            D.requires_grad_(False)
            accelerator.backward(bce(D(G(z)), 1.0))
            D.requires_grad_(True)
            opt_g.step()
            opt_g.zero_grad()
            with torch.no_grad():
                fake = G(z)
            accelerator.backward((bce(D(real), 1.0) + bce(D(fake), 0.0)) / 2)
            opt_d.step()
            opt_d.zero_grad()
    return [p.detach().clone() for m in (G, D) for p in m.parameters()]


def test_the_guide_s_strategy_is_short_uses_the_kit_and_trains_like_lightning_by_hand():
    import torch

    from hookloop import hookimpl
    from hookloop.testing import parameters, reset_accelerate

    code = _strategy_block()
    assert len(code.splitlines()) < 60
    imports = [line for line in code.splitlines() if line.startswith(("import", "from"))]
    assert "from hookloop.strategy import" in "\n".join(imports)
    assert not any("hookloop.strategies" in line or "._" in line for line in imports)

    namespace = {}
    exec(compile(code, "docs/plugins.md:strategy", "exec"), namespace)
    loop = namespace["loop"]
    assert loop.state.global_step == 5 * 8  # 512 points, batches of 64, 5 epochs
    ours = parameters(loop, "generator") + parameters(loop, "discriminator")

    reset_accelerate()
    header = code.split("\n\n\nclass ", 1)[0]  # the imports
    setup = code.split("\ntorch.manual_seed(0)\n", 1)[1].split("\nloop = Loop(", 1)[0]
    theirs = _lightning_by_hand(f"{header}\ntorch.manual_seed(0)\n{setup}", 5)
    assert len(ours) == len(theirs)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))

    # the order of the updates, and no discriminator gradient from the generator's step
    class Watch:
        def __init__(self):
            self.order, self.leaks = [], 0

        @hookimpl
        def after_backward(self, loop, network):
            self.order.append(network.name)
            if network.name == "generator":
                self.leaks += sum(p.grad is not None and bool(p.grad.any())
                                  for p in loop.networks["discriminator"].unwrapped.parameters())

    reset_accelerate()
    watch = Watch()
    Loop, Network, LightningGAN = namespace["Loop"], namespace["Network"], namespace["LightningGAN"]
    G, D = namespace["G"], namespace["D"]
    loop = Loop(networks={"generator": Network(G, torch.optim.Adam(G.parameters(), lr=1e-3)),
                          "discriminator": Network(D, torch.optim.Adam(D.parameters(), lr=1e-3))},
                strategy=LightningGAN(latent_dim=4), plugins=[watch],
                train_data=torch.utils.data.DataLoader(
                    torch.utils.data.TensorDataset(torch.randn(128, 2)), batch_size=64))
    loop.fit(epochs=1)
    assert watch.order == ["generator", "discriminator"] * 2 and watch.leaks == 0


def test_the_guide_s_logging_example_puts_train_loss_in_the_metrics():
    import re

    from hookloop import hookimpl
    from hookloop.testing import reset_accelerate, tiny_loop

    text = GUIDE_PATH.read_text()
    body = text.split("\n## Logging and several instances\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", body, flags=re.S)
    namespace = {"hookimpl": hookimpl}
    exec(compile(code, "docs/plugins.md:logging", "exec"), namespace)
    reset_accelerate()
    metrics = tiny_loop([namespace["TrainLoss"]()], eval_data=True).fit(epochs=1)
    assert {"train_loss", "eval_loss"} <= set(metrics) and metrics["train_loss"] > 0


def test_the_guide_s_grad_norm_logger_logs_at_50_and_100_with_and_without_gradclip():
    import re

    from hookloop.plugins import GradClip
    from hookloop.testing import reset_accelerate, tiny_loop

    text = GUIDE_PATH.read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "class GradNormLogger" in c)
    namespace = {}
    exec(compile(code, "docs/plugins.md:GradNormLogger", "exec"), namespace)
    for clip in ([GradClip(max_norm=1.0)], []):
        reset_accelerate()
        loop = tiny_loop([namespace["GradNormLogger"](), *clip], n=64, batch_size=4)  # 16 updates an epoch
        logged = []
        loop.log = lambda values, **kwargs: logged.append((loop.state.global_step + 1, float(*values.values())))
        loop.fit(max_steps=100)
        assert [update for update, _ in logged] == [50, 100], clip
        assert all(norm > 0 for _, norm in logged)


def test_the_plugin_guide_runs_without_a_warning_about_untrained_parameters(tmp_path, monkeypatch):
    """0.3: the PredictionWriter example built a Loop of one model with another's optimizer."""
    import re
    import runpy
    import warnings

    from hookloop.testing import reset_accelerate

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD", "1")
    namespace = runpy.run_path(str(ROOT / "docs" / "example_names.py"))
    code = re.findall(r"(<!-- fragment: [^>]*-->\n)?```python\n(.*?)```", GUIDE_PATH.read_text(), flags=re.S)
    reset_accelerate()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for fragment, block in code:
            if not fragment:
                exec(compile(block, "docs/plugins.md", "exec"), namespace)
    reset_accelerate()
    assert not [w for w in seen if "no param group" in str(w.message)], [str(w.message) for w in seen]


# -- the plugin guide's hook diagram and what it says of grad_norm ---------------------


def _hook_diagram():
    """The plain code block under docs/plugins.md's "When hooks run"."""
    import re

    section = GUIDE_PATH.read_text().split("\n## When hooks run\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"\n```\n(.*?)\n```\n", section, flags=re.S).group(1)


def _guide_s_hook_table():
    """docs/guide.md's "Hooks in call order"."""
    return (ROOT / "docs" / "guide.md").read_text().split("\n## Hooks in call order\n", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("where", ["docs/plugins.md diagram", "docs/guide.md table"])
@pytest.mark.parametrize("hook", hook_names())
def test_the_hook_diagram_and_table_show_every_hook_with_its_arguments(hook, where):
    """0.4's diagram said 0.3 and lacked commit_update and the checkpoint hooks; the
    guide's table lacked them too, and eval_step's eval_set (0.5)."""
    import re

    text = _hook_diagram() if where.endswith("diagram") else _guide_s_hook_table()
    shown = re.findall(rf"(?<![\w/]){hook}(?:\(([^)]*)\))?", text)
    assert shown, f"{hook} is not in the {where}"
    expected = [p for p in inspect.signature(getattr(hookspecs, hook)).parameters
                if p != "loop" or where.endswith("table")]  # (the diagram leaves loop out)
    for arguments in shown:
        named = [a.split("=")[0].strip() for a in arguments.split(",") if a.strip()]
        assert named in ([], expected), (hook, arguments, expected)
    if expected:
        assert any(arguments for arguments in shown), f"{hook}: its arguments ({', '.join(expected)}) are not shown"


def _sentences_about(name, text):
    """Each piece of ``text`` from ``name`` to the end of its sentence."""
    import re

    return [re.split(r"\.\s|\.$|\n\s*\n", text[m.start():], maxsplit=1)[0]
            for m in re.finditer(re.escape(name), text)]


def test_no_page_or_docstring_says_grad_norm_is_none():
    """It is ``hookloop.NOT_MEASURED`` when nothing measures it (0.4's docs/plugins.md
    said None: a plugin testing ``is None`` then took it for a number)."""
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "plugins").glob("*/README.md"),
             *(ROOT / "src" / "hookloop").rglob("*.py"), *(ROOT / "plugins").glob("*/src/**/*.py")]
    said = [(page.relative_to(ROOT).as_posix(), sentence) for page in pages
            for sentence in _sentences_about("grad_norm", page.read_text())
            if "`None`" in sentence or "``None``" in sentence]
    assert said == []
