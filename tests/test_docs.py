"""Every Python block in the README and the porting guide runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "docs" / "porting-from-tensorflow.md"]
BLOCKS = [(doc.name, i, code) for doc in DOCS if doc.exists()
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S))]

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("doc, index, code", BLOCKS, ids=[f"{d}-{i}" for d, i, _ in BLOCKS])
def test_code_block_runs(tmp_path, doc, index, code):
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSTRAIN_", "TF_CONFIG"))}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=100, env=env, cwd=tmp_path)
    assert result.returncode == 0, f"{doc} block {index} failed:\n{result.stderr[-3000:]}"


def test_there_are_blocks_to_run():
    assert len(BLOCKS) >= 2
