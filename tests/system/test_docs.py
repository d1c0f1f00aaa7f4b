"""Every Python block of the README and the docs site runs; the site builds strict and every
page of its navigation opens in Chromium."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    (doc.name, i, code)
    for doc in DOCS
    if doc.exists()
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S))
]

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("doc, index, code", BLOCKS, ids=[f"{d}-{i}" for d, i, _ in BLOCKS])
def test_code_block_runs(tmp_path, doc, index, code):
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSTRAIN_", "TF_CONFIG"))}
    env["TMPDIR"] = str(tmp_path)  # (a block's own temporary directories, as the tutorial's, stay here)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=100, env=env, cwd=tmp_path
    )
    assert result.returncode == 0, f"{doc} block {index} failed:\n{result.stderr[-3000:]}"


def test_there_are_blocks_to_run():
    assert len(BLOCKS) >= 8 and {doc for doc, _, _ in BLOCKS} >= {
        "README.md",
        "recommender-tables.md",
        "operations.md",
        "porting-from-tensorflow.md",
    }


def test_the_readme_is_short_and_points_at_the_site():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 250
    for page in (
        "tutorial",
        "architecture",
        "decisions",
        "concepts",
        "porting-from-tensorflow",
        "frameworks",
        "recommender-tables",
        "failures-and-checkpoints",
        "operations",
        "security",
        "benchmarks",
    ):
        assert f"](docs/{page}.md)" in text, page


@pytest.mark.timeout(240)
async def test_the_site_builds_strict_and_every_nav_link_opens_in_chromium(tmp_path):

    from playwright.async_api import async_playwright

    browser_path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser_path, "the docs test needs Chromium (`make test` installs it)"  # before any server
    site = (tmp_path / "site").resolve()
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [str(Path(sys.executable).with_name("mkdocs")), "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    reference = (site / "reference" / "index.html").read_text()
    # public API only: what a program uses is there (LocalCluster.pid was not), and the
    # members marked @internal (pstrain's layers call them) are not, nor private modules
    for name in (
        "pstrain.LocalCluster.pid",
        "pstrain.DynamicEmbedding.lookup",
        "pstrain.Variable.assign_add",
    ):
        assert f'id="{name}"' in reference, name
    for name in ("shard_config", "restore_requests", "attach_coordinator", "checked_value", "home_ps"):
        assert f".{name}" not in reference, name
    assert "pstrain._" not in reference

    async def serve(request: web.Request) -> web.StreamResponse:  # as a web server serves a site
        path = (site / request.match_info["path"]).resolve()
        if path.is_dir():
            path = path / "index.html"
        if not path.is_relative_to(site) or not path.is_file():
            raise web.HTTPNotFound()
        return web.FileResponse(path)

    app = web.Application()
    app.router.add_get("/{path:.*}", serve)
    runner = web.AppRunner(app)
    await runner.setup()
    server = web.TCPSite(runner, "127.0.0.1", 0)
    await server.start()
    port = runner.addresses[0][1]
    try:
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
            try:
                page = await browser.new_page()
                page.set_default_timeout(15_000)
                home = f"http://127.0.0.1:{port}/index.html"
                assert (await page.goto(home)).status == 200
                hrefs = await page.locator("nav.md-nav--primary a.md-nav__link[href]").evaluate_all(
                    "els => [...new Set(els.map(e => e.href))]"
                )
                pages = sorted({h.split("#")[0] for h in hrefs if h.startswith("http://127.0.0.1")})
                assert len(pages) >= 11, pages
                for url in pages:
                    reply = await page.goto(url)
                    assert reply is not None and reply.status == 200, url
                    title = await page.locator("article h1").first.text_content()
                    assert title and title.strip(), url
                    for img in await page.locator("article img").all():  # the plots load
                        assert await img.evaluate("i => i.complete && i.naturalWidth > 0"), url
            finally:
                await browser.close()
    finally:
        await runner.cleanup()


# -- the porting guide's table: complete, and true ------------------------------------------------
REFERENCE = ROOT.parent / "shared" / "reference"
STATUSES = {"same", "same with await", "different", "not supported"}


def _table() -> list[tuple[str, str, str, str]]:
    text = (ROOT / "docs" / "porting-from-tensorflow.md").read_text()
    section = text.split("## Every name, and its status", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows.append((cells[0], cells[1], cells[2], cells[3]))
    return rows


def _resolve(dotted: str) -> object:

    parts = dotted.split(".")
    obj: object = importlib.import_module(parts[0])
    for i, name in enumerate(parts[1:], 1):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def _names_on_the_pages() -> set[str]:
    """Public names of TF's pages: the strategy's methods and attributes (from the page's own
    headings and attribute table), RemoteValue's methods, and what the other pages and the
    tutorial's training loop use (listed by hand from those texts)."""
    pss = (REFERENCE / "tf-parameter-server-strategy.txt").read_text()
    names = set(re.findall(r"^### `(\w+)`", pss, re.M))
    names |= set(re.findall(r"^`(\w+)` \|  ", pss.split("Attributes", 1)[1].split("## Methods")[0], re.M))
    remote = (REFERENCE / "tf-remote-value.txt").read_text()
    names |= {f"RemoteValue.{m}" for m in re.findall(r"^### `(\w+)`", remote, re.M)}
    extended = (REFERENCE / "tf-distribute-experimental.txt").read_text()
    names |= set(
        re.findall(r"^(experimental_require_static_shapes|parameter_devices|worker_devices) ", extended, re.M)
    )
    names |= {
        "colocate_vars_with",
        "update",
        "reduce_to",
        "batch_reduce_to",
        "merge_call",
        "get_replica_context",
        "VariableAggregation",
        "DistributedValues",
        "DistributedDataset",
        "replica_id_in_sync_group",
        "ClusterCoordinator",
        "create_per_worker_dataset",
        "schedule",
        "join",
        "done",
        "fetch",
        "Server",
        "TFConfigClusterResolver",
        "MinSizePartitioner",
        "get_current_worker_index",
        "ReduceOp",
        # the tutorial's custom training loop
        "RMSprop",
        "Accuracy",
        "reset_states",
        "GradientTape",
        "apply_gradients",
        "trainable_variables",
        "StringLookup",
        "Embedding",
        "BinaryCrossentropy",
        "compute_average_loss",
        "Checkpoint",
        "CheckpointManager",
        "InputContext",
        "element_spec",
        "tf.function",
    }
    return names


NAMES_FILE = ROOT / "tests" / "system" / "data" / "tf_api_names.txt"


def _vendored_names() -> set[str]:
    return {
        line.strip()
        for line in NAMES_FILE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }


def test_the_porting_table_covers_every_name_on_tfs_pages():
    names = _vendored_names()
    if REFERENCE.exists():  # beside the seeds: the list must still be what the pages say
        assert _names_on_the_pages() <= names, "regenerate tests/system/data/tf_api_names.txt"
    rows = _table()
    listed = " ".join(tf for tf, *_ in rows)
    missing = sorted(n for n in names if n not in listed)
    assert len(names) > 50 and not missing, f"names of TF's pages missing from the porting table: {missing}"


def test_every_supported_name_exists_and_every_other_is_explained():
    rows = _table()
    assert len(rows) >= 60
    for tf, ours, status, notes in rows:
        assert status in STATUSES, (tf, status)
        if status == "not supported":
            assert len(notes) > 20, f"{tf}: say why it is not supported"
            continue
        if status == "different":
            assert len(notes) > 15, f"{tf}: say what differs"
        dotted = re.match(r"`(pstrain(?:\.\w+)+)`", ours)
        assert dotted, f"{tf}: give the pstrain name as `pstrain.…` ({ours!r})"
        _resolve(dotted.group(1))  # raises if the name does not exist


#: The pages that are the history or the figures, not the manual: the changelog (its
#: versions' dates) and the benchmarks page (its current table); the notebook is outside.
NOT_GUIDES = {"changelog.md", "benchmarks.md"}


def test_the_readme_and_the_guides_carry_no_dated_measurement():
    # A manual, not a notebook: measurements live in benchmarks/results/, the benchmarks page
    # and notebook/; a date in the README or a guide is a measurement's or a bug's history.
    pages = [
        ROOT / "README.md",
        *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in NOT_GUIDES),
    ]
    dated = [
        f"{page.name}: {line.strip()}"
        for page in pages
        for line in re.findall(r"[^\n]*\b20\d\d-[01]\d-[0-3]\d\b[^\n]*", page.read_text())
    ]
    assert len(pages) >= 12 and not dated, dated


def test_the_docs_link_nothing_outside_the_repository():
    outside = [
        f"{page.name}: {m}"
        for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for m in re.findall(r"\]\((\.\./[^)]*)\)", page.read_text())
        if not (page.parent / m).resolve().is_relative_to(ROOT)
    ]
    assert not outside, outside
