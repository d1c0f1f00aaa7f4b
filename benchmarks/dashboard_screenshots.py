"""Screenshots of the dashboard while ``pstrain demo --dashboard`` trains (docs/*.png).

    python benchmarks/dashboard_screenshots.py [--steps 6000]

Starts the demo as a process, opens the one-time URL it prints in the distribution's
headless Chromium (Playwright), and saves the page twice: early and later in training.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import sys
import tempfile
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


async def main(steps: int) -> None:
    from playwright.async_api import async_playwright

    out = tempfile.mkdtemp(prefix="pstrain-demo-")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pstrain",
        "demo",
        "--dashboard",
        "--quiet",
        "--steps",
        str(steps),
        "--output",
        out,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    try:
        url = None
        while url is None:
            line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
            if not line:
                raise RuntimeError("the demo ended before printing the dashboard's URL")
            print(line, end="")
            match = re.search(r"(http://\S+/login\?key=\S+)", line)
            url = match.group(1) if match else None
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
            page = await browser.new_page(viewport={"width": 1360, "height": 1000})
            await page.goto(url)
            for name, wait in (("dashboard.png", 20), ("dashboard-later.png", 25)):
                await asyncio.sleep(wait)  # training runs meanwhile: the charts fill
                await page.screenshot(path=str(DOCS / name), full_page=True)
                print(f"wrote {DOCS / name}")
            await browser.close()
    finally:
        if proc.returncode is None:
            proc.terminate()  # the demo this script started, by its PID
            await proc.wait()
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6000)
    asyncio.run(main(parser.parse_args().steps))
