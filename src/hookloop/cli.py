"""The hookloop command: list plugins and hooks, run the demos.

    hookloop plugins [--json]     what a Loop would load, and why
    hookloop plugins NAME ...     the instances Loop(plugins=[NAME, ...]) would register
    hookloop hooks                the hook reference
    hookloop demo [NAME] [ARGS]   run a packaged example (default: the GAN demo);
                                  ``hookloop demo --help`` lists them
    hookloop new-plugin NAME      write a ready plugin distribution (hookloop.scaffold)
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from . import hookspecs
from ._version import __version__
from . import manager as plugin_manager

#: demo name -> module under hookloop.examples with a ``main(argv)`` function
DEMOS = {
    "gan": "gan_digits",
    "digits": "digits_classifier",
    "text": "text_classification",
    "distill": "distillation",
}
DEFAULT_DEMO = "gan"
#: demo name -> what it does, in one line (``hookloop --help``, ``hookloop demo --help``)
DEMO_LINES = {
    "gan": "a GAN learns to draw scikit-learn's 8x8 digits, about a minute",
    "digits": "an MLP learns to classify the same digits, in seconds",
    "text": "fine-tune a transformer on the VADER sentiment lexicon",
    "distill": "distil the text demo's fine-tuned MiniLM into a tiny BERT",
}


def plugin_rows(block: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Every plugin a ``Loop`` could run: built-ins and installed ones, with
    whether it is active and why."""
    from .plugins import BUILTINS, loop_defaults
    from .strategies import GAN, Distillation, Supervised

    blocked = plugin_manager.blocked_names(block)
    rows: list[dict[str, Any]] = []
    # what Loop(...) registers without being asked: the default strategy, its
    # default plugins and the loop's (progress bar, finiteness check, metrics to trackers)
    strategy = Supervised()
    defaults = {plugin_manager.plugin_name(p): type(p)
                for p in (strategy, *strategy.default_plugins(), *loop_defaults())}
    strategies = {"gan": GAN, "distillation": Distillation}
    for name, cls in {**defaults, **BUILTINS, **strategies}.items():
        if any(r["name"] == name for r in rows):
            continue
        if name in strategies:
            status, why = "available", f"a strategy: Loop(..., strategy={cls.__name__}(...))"
        elif name in blocked and name != strategy.name:
            status, why = "blocked", "blocked by name"
        elif name in defaults:
            status, why = "active", "built-in default"
        else:
            status, why = "available", f"built-in: switch on with plugins=[{cls.__name__}(...)] or plugins=[{name!r}]"
        rows.append({
            "name": name,
            "source": "built-in",
            "distribution": "hookloop",
            "version": __version__,
            "object": f"{cls.__module__}.{cls.__qualname__}",
            "hooks": plugin_manager.implemented_hooks(cls),
            "changes_training": plugin_manager.changes_training(cls),
            "status": status,
            "reason": why,
        })
    for item in plugin_manager.discover():
        active, why = plugin_manager.autoload_decision(item, block)
        if item.error is not None:
            status = "blocked" if item.name in blocked else "error"
        elif item.name in blocked:
            status = "blocked"
        else:
            status = "active" if active else "installed"
        rows.append({
            "name": item.name,
            "source": "entry point",
            "distribution": item.distribution,
            "version": item.version,
            "object": item.entry_point.value,
            "hooks": item.hooks,
            "changes_training": item.changes_training if item.error is None else None,
            "status": status,
            "reason": why,
        })
    return rows


#: how ``hookloop plugins`` shows a plugin's ``changes_training``
CHANGES_TRAINING = {True: "yes", False: "no (an observer)", None: "not declared"}


def hook_reference() -> str:
    """The hook reference, from the hookspec docstrings."""
    out = [inspect.cleandoc(hookspecs.__doc__ or ""), ""]
    for name in plugin_manager.hook_names():
        func = getattr(hookspecs, name)
        # the arguments by name, as a hookimpl takes them (their types: hookspecs.py)
        sig = inspect.signature(func).replace(
            parameters=[p.replace(annotation=p.empty) for p in inspect.signature(func).parameters.values()],
            return_annotation=inspect.Signature.empty)
        first = " (firstresult)" if func.hookloop_spec.get("firstresult") else ""
        out.append(f"{name}{sig}{first}")
        out.append("-" * len(out[-1]))
        out.append(inspect.cleandoc(func.__doc__ or "(undocumented)"))
        out.append("")
    return "\n".join(out)


def instance_rows(given: Sequence[str]) -> list[dict[str, Any]]:
    """The plugins ``Loop(plugins=given)`` would register from a list of
    names (``"logger"``, or ``'logger={"every": 2}'`` with options as JSON):
    each instance's name (``logger``, ``logger-2``; an option ``name`` names
    it), in call order."""
    from .plugins import BUILTINS

    installed = {i.name: i for i in plugin_manager.discover()}
    entries: list[tuple[Any, str | None, str, str]] = []
    for spec in given:
        name, _, options = spec.partition("=")
        item: str | tuple[str, Any] = (name, json.loads(options)) if options else name
        plugin, source, explicit, base = plugin_manager.resolve_named(item, installed, BUILTINS)
        entries.append((plugin, explicit, base, source))
    return [
        {"name": name, "given": spec, "object": f"{type(p).__module__}.{type(p).__qualname__}",
         "source": source, "hooks": plugin_manager.implemented_hooks(p)}
        for spec, (p, name, source) in zip(given, plugin_manager.name_instances(entries))
    ]


def _cmd_plugins(args: argparse.Namespace) -> int:
    if args.given:
        rows = instance_rows(args.given)
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        for r in rows:
            print(f"{r['name']:<14} {r['given']:<30} {r['object']}")
        return 0
    rows = plugin_rows()
    if args.hook:
        rows = [r for r in rows if args.hook in r["hooks"]]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        where = r["source"] if r["source"] == "built-in" else f"{r['distribution']} {r['version']}"
        print(f"{r['name']:<14} {r['status']:<10} {where}")
        print(f"{'':<14} hooks: {', '.join(r['hooks']) or '-'}")
        print(f"{'':<14} changes training: {CHANGES_TRAINING[r['changes_training']]}")
        print(f"{'':<14} {r['reason']}")
    return 0


def _cmd_hooks(args: argparse.Namespace) -> int:
    print(hook_reference())
    return 0


def demo_listing() -> str:
    """Every demo, one line each, with the extra it needs; then where they
    write."""
    from .examples.demo_support import EXTRAS, RUNS_DIR

    width = max(map(len, DEMOS))
    text = max(len(DEMO_LINES.get(name, "")) for name in DEMOS)
    lines: list[str] = []
    extras: dict[str, str] = {}
    for name in DEMOS:
        extra = EXTRAS.get(name, ("",))[0]
        lines.append(f"  {name:<{width}}  {DEMO_LINES.get(name, ''):<{text}}  "
                     f"{f'[{extra}]' if extra else ''}".rstrip())
        if extra:
            extras.setdefault(extra, f'[{extra}]: pip install "hookloop[{extra}]"')
    return "\n".join([
        *lines,
        "; ".join(extras.values()),
        f"Each demo writes under ./{RUNS_DIR}/NAME (its --out moves it);",
        "hookloop demo NAME --help lists its options.",
    ])


def demo_help() -> str:
    """``hookloop demo --help``."""
    return "\n".join([
        "usage: hookloop demo [NAME] [OPTIONS]",
        "",
        f"Run a packaged example. NAME (default {DEFAULT_DEMO}; options without a NAME go to it):",
        demo_listing(),
    ])


def _cmd_demo(args: argparse.Namespace) -> int:
    from .examples.demo_support import require_extra

    name = args.name or DEFAULT_DEMO
    if name not in DEMOS:
        print(f"hookloop demo: unknown demo {name!r}; choose from {', '.join(DEMOS)}", file=sys.stderr)
        return 2
    missing = require_extra(name)  # before the import: the demo module imports what is missing
    if missing is not None:
        return missing
    module = importlib.import_module(f"hookloop.examples.{DEMOS[name]}")
    return int(module.main(args.args) or 0)


def plain(text: str) -> str:
    """Docstring text for a terminal: reST literals (````x````) and roles
    (``:class:`x```) become plain words."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return re.sub(r"``([^`]+)``", r"\1", text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hookloop", description=plain((__doc__ or "hookloop").splitlines()[0]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"demos (hookloop demo NAME [OPTIONS], default {DEFAULT_DEMO}):\n" + demo_listing())
    parser.add_argument("--version", action="version", version=f"hookloop {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands (hookloop COMMAND --help for its options)")
    p = sub.add_parser("plugins", help="list the plugins a Loop would load")
    p.add_argument("given", nargs="*", metavar="NAME[=JSON]",
                   help="plugins as given to Loop(plugins=[...]) by name, e.g. logger "
                        "'logger={\"every\": 2}': show the instance names they would get")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--hook", help="only plugins implementing this hook")
    p.set_defaults(func=_cmd_plugins)
    p = sub.add_parser("hooks", help="print the hook reference")
    p.set_defaults(func=_cmd_hooks)
    p = sub.add_parser("demo", help=f"run a packaged example (default {DEFAULT_DEMO}; the demos below)",
                       add_help=False)
    p.add_argument("name", nargs="?", help=f"one of {', '.join(DEMOS)} (default {DEFAULT_DEMO})")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the example")
    p.set_defaults(func=_cmd_demo)
    from . import scaffold

    scaffold.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"] and argv[1:2] in (["-h"], ["--help"]):
        print(demo_help())  # the demos themselves; `hookloop demo NAME --help`: one demo's options
        return 0
    if argv[:1] == ["demo"] and len(argv) > 1 and argv[1].startswith("-"):
        argv.insert(1, DEFAULT_DEMO)  # `hookloop demo --epochs 5`: options of the default demo
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
