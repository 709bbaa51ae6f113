"""docs/other-stacks.md: every Python example in it runs as written and does what it says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "other-stacks.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_page_has_both_examples() -> None:
    assert len(EXAMPLES) == 2
    assert "LoopThread" in EXAMPLES[1] and "async with TieredStore" in EXAMPLES[0]


@pytest.mark.parametrize(("index", "says"), [(0, r"restored 8 blocks; disk tier: 8 hits"),
                                             (1, r"^4 blocks on disk$")])
def test_an_example_runs_as_written(index: int, says: str, tmp_path: Path) -> None:
    script = tmp_path / f"example{index}.py"
    script.write_text(EXAMPLES[index])
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(says, proc.stdout, flags=re.M), proc.stdout
