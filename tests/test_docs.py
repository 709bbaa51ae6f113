"""The documentation runs: every ```python block of README.md and docs/*.md is executed as a
program, the README example prints what the README says it prints, and every link points at a
file of this repository (no page points outside it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)


def _blocks(page: Path) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(page.read_text())]


def _python_blocks() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        for n, (_lang, code) in enumerate(b for b in _blocks(page) if b[0] == "python"):
            out.append((f"{page.relative_to(ROOT)}#{n}", code))
    return out


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    script = cwd / "example.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize(("where", "code"), _python_blocks(), ids=lambda v: v if "#" in str(v) else "")
def test_every_python_block_runs(where: str, code: str, tmp_path: Path) -> None:
    proc = _run(code, tmp_path)
    assert proc.returncode == 0, f"{where} failed:\n{proc.stdout}\n{proc.stderr[-5000:]}"


def test_the_readme_example_prints_what_the_readme_shows(tmp_path: Path) -> None:
    blocks = _blocks(ROOT / "README.md")
    at = next(i for i, (lang, _) in enumerate(blocks) if lang == "python")
    code, shown = blocks[at][1], blocks[at + 1][1]
    proc = _run(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert proc.stdout == shown
    assert "unchanged: True" in shown and "unchanged: False" not in shown


def test_the_readme_example_stands_alone() -> None:
    code = next(c for lang, c in _blocks(ROOT / "README.md") if lang == "python")
    assert "async def main" in code and "Lookup.PENDING" in code  # the wait a reader must copy
    compile(code, "README.md", "exec")


def test_links_point_inside_the_repository() -> None:
    for page in PAGES:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            assert (page.parent / target).exists(), f"{page.name}: link to missing {target}"
        assert "../shared" not in text and "/work/" not in text, f"{page.name} points outside the repository"


#: ``pip install tierkv``, ``pip install 'tierkv[s3]'``, ``pip install "tierkv[...]"``: the package
#: index's ``tierkv`` is an unrelated project, so no page or message may tell anyone to install it
WRONG_PROJECT = re.compile(r"""pip3?\s+install\s+(?:-U\s+|--upgrade\s+)?['"]?tierkv(?![\w./-])""")


def _texts() -> list[tuple[str, str]]:
    files = [*PAGES, *sorted((ROOT / "tierkv").rglob("*.py")), *sorted((ROOT / "bench").glob("*.py")),
             ROOT / "scripts" / "dev", ROOT / "pyproject.toml"]
    return [(str(f.relative_to(ROOT)), f.read_text()) for f in files]


def test_the_pattern_catches_the_wrong_install_lines() -> None:
    for line in ("pip install tierkv", "pip install 'tierkv[s3]'", 'pip install "tierkv[metrics]"',
                 "pip install tierkv[s3]", "pip3 install -U tierkv", "pip install tierkv\n"):
        assert WRONG_PROJECT.search(line), line
    for line in ("pip install -e '.[s3]'", "pip install 's3fs>=2024.6'", "pip install -e './tierkv[s3]'",
                 "pip install tierkv-cache", "pip install ./tierkv"):
        assert not WRONG_PROJECT.search(line), line


def test_no_page_or_message_installs_the_unrelated_tierkv() -> None:
    bad = [f"{name}: {m.group(0)!r}" for name, text in _texts() for m in WRONG_PROJECT.finditer(text)]
    assert not bad, "these install the package index's unrelated 'tierkv':\n" + "\n".join(bad)


def test_the_distribution_name_is_not_the_unrelated_project() -> None:
    import tomllib

    name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    from tierkv.errors import DISTRIBUTION, install_hint

    assert name == DISTRIBUTION and name != "tierkv"
    hint = install_hint("s3")
    assert "s3fs" in hint and not WRONG_PROJECT.search(hint)


def test_the_concurrent_restore_table_holds_what_the_benchmark_prints() -> None:
    """docs/performance.md's deterministic table (steps, not seconds): its 8-request rows against a
    run of the same scenarios now."""
    import anyio

    from tierkv.tools.simulate import Scenario, run_scenario

    text = (ROOT / "docs" / "performance.md").read_text()
    row = r"^\| 8 \| (\d) \| \*\*([\d.]+)\*\* \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (\d+) \|$"
    rows = re.findall(row, text, re.M)
    assert len(rows) == 3, "the table's 8-request rows are gone"
    for slots, q_restored, q_steps, n_restored, n_steps, scratch in rows:
        got = {}
        for admission in ("queue", "naive"):
            sc = Scenario(documents=8, requests=8, blocks=8, kinds=["full", "sliding_window", "recurrent"],
                          slots={2: int(slots)}, default_slots=4096, block_bytes=4096, admission=admission,
                          writer_subprocess=False, max_steps=1000)
            got[admission] = anyio.run(run_scenario, sc)
        q, n = got["queue"], got["naive"]
        assert f"{q.restored_fraction:.3f}" == q_restored and f"{q.mean_steps_waited:.2f}" == q_steps
        assert f"{n.restored_fraction:.3f}" == n_restored and f"{n.mean_steps_waited:.2f}" == n_steps
        assert str(sum(r.from_scratch for r in n.requests)) == scratch
