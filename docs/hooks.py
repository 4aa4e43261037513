"""Generate the hook reference of docs/plugins.md from the hookspec docstrings.

    python docs/hooks.py           rewrite the section between the markers
    python docs/hooks.py --check   exit 1 if the section is out of date

The section lies between ``<!-- hooks:begin -->`` and ``<!-- hooks:end -->``;
tests/test_docs.py fails when it differs from what this script generates, so
a new, changed or undocumented hook cannot reach the guide silently.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

GUIDE = Path(__file__).resolve().parent / "plugins.md"
BEGIN, END = "<!-- hooks:begin -->", "<!-- hooks:end -->"


def _inline(text: str) -> str:
    """reST inline markup to Markdown: ``x`` and :role:`~a.b.X` to `x`, `X`."""
    text = re.sub(r":\w+:`~?([^`]+)`",
                  lambda m: "`" + (m.group(1).rsplit(".", 1)[-1] if m.group(0).count("~") else m.group(1)) + "`",
                  text)
    return text.replace("``", "`")


def _docstring(doc: str) -> list[str]:
    """A hookspec docstring in Markdown: paragraphs, ``:param:`` /
    ``:return:`` as a list, ``.. versionadded::`` as a note."""
    out: list[str] = []
    for block in inspect.cleandoc(doc).split("\n\n"):
        lines = block.splitlines()
        if lines[0].startswith((":param ", ":return:")):
            items: list[str] = []
            for line in lines:
                if line.startswith(":param "):
                    name, _, text = line[len(":param "):].partition(":")
                    items.append(f"- `{name.strip()}`: {text.strip()}")
                elif line.startswith(":return:"):
                    items.append(f"- returns: {line[len(':return:'):].strip()}")
                else:  # a continuation line of the item above
                    items[-1] += " " + line.strip()
            out.extend(_inline(item) for item in items)
        elif lines[0].startswith(".. version"):
            notes: list[str] = []
            for line in lines:  # one directive per line, its text indented below it
                if line.startswith(".. version"):
                    directive, _, version = line[3:].partition("::")
                    word = {"versionadded": "Added", "versionchanged": "Changed"}.get(directive, directive)
                    notes.append(f"*{word} in {version.strip()}.*")
                else:
                    notes[-1] += " " + _inline(line.strip())
            out.append(" ".join(notes))
        elif lines[0].startswith("- "):
            items = []
            for line in lines:
                if line.startswith("- "):
                    items.append(line)
                else:  # a continuation line of the item above
                    items[-1] += " " + line.strip()
            out.extend(_inline(item) for item in items)
        else:
            out.append(_inline(" ".join(line.strip() for line in lines)))
        out.append("")
    return out


def reference() -> str:
    """The Markdown hook reference, one section per hook in declaration order."""
    from hookloop import hookspecs
    from hookloop.manager import hook_names

    out = [
        "Generated from the docstrings in `src/hookloop/hookspecs.py` by `python docs/hooks.py`",
        "(the same text as `hookloop hooks`). Do not edit by hand.",
        "",
    ]
    for name in hook_names():
        func = getattr(hookspecs, name)
        kind = "firstresult" if func.hookloop_spec.get("firstresult") else "broadcast"
        sig = inspect.signature(func)  # the arguments by name, as `hookloop hooks` prints them
        sig = sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                          return_annotation=sig.empty)
        out.append(f"### `{name}{sig}`")
        out.append("")
        out.append(f"*{kind}*")
        out.append("")
        out.extend(_docstring(func.__doc__ or "(undocumented)"))
    return "\n".join(out).rstrip() + "\n"


def current(text: str) -> str:
    """The generated section as it is in ``text``."""
    try:
        return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"
    except IndexError:
        raise ValueError(f"{GUIDE.name} has no {BEGIN} ... {END} section") from None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = GUIDE.read_text()
    fresh = reference()
    if "--check" in argv:
        if current(text) != fresh:
            print(f"{GUIDE} is out of date: run python docs/hooks.py", file=sys.stderr)
            return 1
        return 0
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    GUIDE.write_text(f"{head}{BEGIN}\n{fresh}{END}{tail}")
    print(f"wrote the hook reference into {GUIDE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
