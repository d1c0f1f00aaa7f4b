"""The CLI part of docs/cli-and-http.md, drawn from the ``pstrain`` command's own parsers.

``python tools/cli_reference.py`` prints it; ``--write`` puts it between the page's
``<!-- cli:begin -->`` and ``<!-- cli:end -->`` markers. ``tests/unit/test_docs_reference.py``
fails when the page and the parsers disagree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli-and-http.md"
BEGIN, END = "<!-- cli:begin -->", "<!-- cli:end -->"


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from pstrain.cli.dashboard_login import dashboard_login_parser
    from pstrain.cli.launch import add_launch_parser
    from pstrain.cli.serve import serve_parser
    from pstrain.cli.status import status_parser
    from pstrain.demo import add_demo_parser

    sub = argparse.ArgumentParser(prog="pstrain").add_subparsers(dest="command")
    for add in (serve_parser, status_parser, add_launch_parser, add_demo_parser, dashboard_login_parser):
        add(sub)
    return dict(sub.choices)


def _cell(text: str) -> str:
    return " ".join(text.replace("%%", "%").replace("|", "\\|").split())


def draw() -> str:
    out = []
    for name, parser in _parsers().items():
        description = _cell((parser.description or "").replace("``", "`"))
        out += [f"### `pstrain {name}`", "", description, "", "| option | what it does |", "|---|---|"]
        for action in parser._actions:  # noqa: SLF001 - argparse has no public list of them
            if "--help" in action.option_strings:
                continue
            names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}`"
            out.append(f"| {names} | {_cell(action.help or '')} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def written(page: str) -> str:
    """The page with its CLI block drawn afresh."""
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{draw()}{END}{tail}"


if __name__ == "__main__":
    if "--write" in sys.argv:
        PAGE.write_text(written(PAGE.read_text()))
    else:
        print(draw())
