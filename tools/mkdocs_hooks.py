"""MkDocs hooks: the home page is the README itself, its links made relative to docs/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return readme.replace("](docs/", "](").replace("](CHANGELOG.md)", "](changelog.md)")
