"""Every ```python block of docs/*.md runs as written (issue 35, item 14).

The blocks run in one subprocess (imports paid once), each in a fresh namespace and an empty
working directory. A block the docs mark ``<!-- not run: REASON -->`` (it needs peers, several
processes or an accelerator) is a skip that says REASON.
"""

from __future__ import annotations

import pytest

from tests.doc_blocks import ROOT, blocks, run_in_subprocess

BLOCKS = [b for path in sorted((ROOT / "docs").glob("*.md")) for b in blocks(path)]


@pytest.fixture(scope="module")
def results():
    return run_in_subprocess([b for b in BLOCKS if b.not_run is None])


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_docs_block_runs(block, results):
    if block.not_run is not None:
        pytest.skip(f"{block.id} not run: {block.not_run}")
    error = results.get(block.id, "not reached: the runner stopped before this block")
    assert error is None, f"docs/{block.id} failed as written:\n{error}"


def test_docs_have_blocks_and_reasons():
    assert len(BLOCKS) >= 10
    assert all(b.not_run for b in BLOCKS if b.not_run is not None)  # a marker always says why
