"""The reference pages say what the code does: the CLI page is the command's own parsers,
and ``pstrain --version`` is the installed version."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import sys
import tomllib
from pathlib import Path

import pytest

import pstrain
from pstrain.cli import main

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import cli_reference  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_the_cli_page_lists_every_option_of_every_subcommand():
    page = cli_reference.PAGE.read_text()
    assert page == cli_reference.written(page), "run: python tools/cli_reference.py --write"
    for name, parser in cli_reference._parsers().items():  # noqa: SLF001
        assert f"### `pstrain {name}`" in page
        for action in parser._actions:  # noqa: SLF001
            for option in set(action.option_strings) - {"-h", "--help"}:
                assert f"`{option}`" in page, (name, option)


def test_pstrain_version_is_the_installed_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out.strip() == f"pstrain {declared}"
    assert pstrain.__version__ == declared == importlib.metadata.version("pstrain")


def test_the_changelog_has_a_section_for_this_version_and_says_how_to_upgrade():
    text = (ROOT / "CHANGELOG.md").read_text()
    section = text.split(f"## {pstrain.__version__} ", 1)[1].split("\n## ", 1)[0]
    assert "### Upgrading" in section and "### Added" in section and "### Fixed" in section


PUBLIC_MODULES = [
    "pstrain",
    "pstrain.checkpoint",
    "pstrain.optimizers",
    "pstrain.data",
    "pstrain.errors",
    "pstrain.nn",
    "pstrain.math",
    "pstrain.strings",
    "pstrain.initializers",
    "pstrain.partitioners",
    "pstrain.schedules",
    "pstrain.metrics",
    "pstrain.summary",
    "pstrain.dashboard",
]


def test_every_public_name_and_member_has_a_docstring():
    """The reference is generated from docstrings: a public name without one is missing from
    it (``LocalCluster.pid`` was)."""
    missing = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if not inspect.getdoc(obj):
                missing.append(f"{module_name}.{name}")
            for member, value in vars(obj).items() if inspect.isclass(obj) else ():
                f = value.fget if isinstance(value, property) else value
                if member.startswith("_") or not (inspect.isfunction(f) or isinstance(value, property)):
                    continue
                if not (getattr(f, "__doc__", None) or "").strip():
                    missing.append(f"{module_name}.{name}.{member}")
    assert not missing, f"public names without a docstring: {sorted(set(missing))}"


def test_the_reference_lists_every_public_name_of_pstrain():
    """``docs/reference.md`` names the members of ``pstrain`` one by one (so that nothing
    private is rendered): the list is ``pstrain.__all__``'s classes and functions."""
    text = (ROOT / "docs" / "reference.md").read_text()
    block = text.split("::: pstrain\n", 1)[1].split("\n\n", 1)[0]
    listed = [line.strip()[2:] for line in block.splitlines() if line.strip().startswith("- ")]
    public = [
        n for n in pstrain.__all__ if not n.startswith("_") and not inspect.ismodule(getattr(pstrain, n))
    ]
    assert listed == public
