"""The reference pages say what the code does: the CLI page is the command's own parsers,
and ``pstrain --version`` is the installed version."""

from __future__ import annotations

import importlib.metadata
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
