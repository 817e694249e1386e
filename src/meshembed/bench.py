"""``meshembed bench``: find meshembed's source checkout and run its benchmark runner there.

The side-by-side benchmarks (``benchmarks/``: meshembed against fbgemm, TensorFlow, Optax, ...)
are part of the repository, not of the installed package, so an installed wheel has nothing
to run: the command then says how to get a checkout instead of failing on an import. This
module imports nothing outside meshembed; ``benchmarks/runner.py`` (run in the checkout, in
its own process) does the work.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

#: Where a source checkout's root is when meshembed is imported from its ``src/`` (editable install).
_ROOT = pathlib.Path(__file__).resolve().parents[2]

#: The options of ``meshembed bench`` handed on to the runner.
OPTIONS = ("backends", "workload", "peers", "repeats", "json", "png")


def _is_checkout(root: pathlib.Path) -> bool:
    """A meshembed source checkout (not just any folder with a ``benchmarks`` package)."""
    try:
        project = (root / "pyproject.toml").read_text()
    except OSError:
        return False
    return (root / "benchmarks" / "runner.py").is_file() and 'name = "meshembed"' in project


def find_checkout() -> pathlib.Path:
    """The checkout this meshembed comes from, else the working directory if it is one."""
    for root in (_ROOT, pathlib.Path.cwd()):
        if _is_checkout(root):
            return root
    raise SystemExit(
        "`meshembed bench` runs the benchmarks of meshembed's source checkout (benchmarks/, which "
        f"the installed package does not contain), and none was found at {_ROOT} or in the working "
        f"directory {pathlib.Path.cwd()}. Fix: clone the meshembed repository, `pip install -e .` in "
        "it, and run `meshembed bench` there (or run it from the checkout's root directory)."
    )


def main(args: Any) -> int:
    root = find_checkout()
    options = {name: getattr(args, name) for name in OPTIONS}
    for name in ("json", "png"):  # output paths are the user's, relative to where they ran the command
        if options[name]:
            options[name] = str(pathlib.Path(options[name]).resolve())
    return subprocess.run([sys.executable, "-m", "benchmarks.runner", json.dumps(options)], cwd=root).returncode
