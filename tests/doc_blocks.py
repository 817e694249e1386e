"""The ```python blocks of a markdown file, for the tests that run the README and docs/*.md.

A block is run as written unless the line before it (blank lines aside) is an HTML comment
``<!-- not run: REASON -->``: the reader does not see it, the test reports REASON as the skip.
"""

from __future__ import annotations

import pathlib
import re
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->\s*$", re.S)


class Block(NamedTuple):
    """One ```python block: its file, first code line (1-based), code and skip reason."""

    path: pathlib.Path
    line: int
    code: str
    not_run: str | None

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.line}"


def blocks(path: pathlib.Path) -> list[Block]:
    """Every ```python block of ``path`` in order, with its ``<!-- not run: ... -->`` reason."""
    text = path.read_text()
    out = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()].rstrip()
        reason = _NOT_RUN.search(before[before.rfind("\n") + 1:] if "\n" in before else before)
        line = text.count("\n", 0, m.start(1)) + 1
        out.append(Block(path, line, m.group(1), reason.group(1) if reason else None))
    return out


def compiled(block: Block):  # -> code object whose line numbers are the file's
    """``block.code`` compiled so a traceback names the markdown file and its line."""
    return compile("\n" * (block.line - 1) + block.code, str(block.path), "exec")


def run_in_subprocess(selected: list[Block], timeout: float = 300.0) -> dict[str, str | None]:
    """Run ``selected`` in one fresh interpreter, each block in its own namespace and its own
    empty working directory (blocks write files); returns ``{block.id: None or traceback}``."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spec = pathlib.Path(tmp, "blocks.json")
        spec.write_text(json.dumps([[str(b.path), b.line] for b in selected]))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "TF_CPP_MIN_LOG_LEVEL": "3"}
        proc = subprocess.run([sys.executable, "-m", "tests.doc_blocks", str(spec)], cwd=tmp, env=env,
                              capture_output=True, text=True, timeout=timeout)
        out = pathlib.Path(tmp, "results.json")
        if not out.exists():
            raise RuntimeError(f"the block runner died (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def _main(spec: str) -> None:
    """The subprocess: run the blocks listed in ``spec``, write ``results.json`` beside it."""
    import json
    import os
    import traceback

    results: dict[str, str | None] = {}
    here = pathlib.Path(spec).parent
    (here / "results.json").write_text("{}")
    for k, (path, line) in enumerate(json.loads(pathlib.Path(spec).read_text())):
        block = next(b for b in blocks(pathlib.Path(path)) if b.line == line)
        work = here / f"block{k}"
        work.mkdir()
        os.chdir(work)
        try:
            exec(compiled(block), {"__name__": "__main__"})
            results[block.id] = None
        except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
            results[block.id] = traceback.format_exc()
        (here / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    import sys

    _main(sys.argv[1])
