"""Building a backend's small C++ kernels on first use (like ``torch.utils.cpp_extension.load``).

A backend ships a ``.cc`` file (which may include the shared headers of this package, e.g.
the bitmap row dedup of ``row_kernels.h``); :func:`build_library` compiles it with the
system compiler (``$CXX`` or ``g++``) into ``$MESHEMBED_CACHE`` (default ``~/.cache/meshembed``), once per
source, flags, caller's key (framework versions) and CPU, under a file lock so that several
processes (tests, ``jax.distributed``, ``torchrun``) can ask at once. A backend that cannot
build its kernels falls back to its framework's own ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

#: Flags of every build: ``-ffp-contract=off`` keeps ``a - b * c`` two roundings, as NumPy
#: computes it, instead of one fused multiply-add; ``-fno-math-errno`` lets ``sqrt`` vectorise
#: (errno is never read; the results are the same IEEE square roots).
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-w")


#: Headers every kernel may include (``#include "row_kernels.h"``): on the include path of
#: every build, and part of every library's cache key.
INCLUDE_DIR = Path(__file__).parent


class BuildError(RuntimeError):
    """The kernels could not be compiled; the message has the compiler's output."""


def cache_dir() -> Path:
    return Path(os.environ.get("MESHEMBED_CACHE") or Path.home() / ".cache" / "meshembed")


def _cpu_id() -> str:
    """What ``-march=native`` depends on: a cache shared by machines with different CPUs
    (a network home directory) must not hand one a library with instructions it lacks."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()}/{platform.processor()}/{flags}"


def library_path(source: Path, stem: str, key: str = "", flags: Sequence[str] = FLAGS) -> Path:
    """Where the library of ``source`` built with ``flags`` for ``key`` lives in the cache."""
    headers = b"".join(h.read_bytes() for h in sorted(INCLUDE_DIR.glob("*.h")))
    digest = hashlib.sha256(source.read_bytes() + headers + repr((tuple(flags), key, _cpu_id())).encode()).hexdigest()[:16]
    return cache_dir() / f"{stem}-{digest}.so"


def build_library(source: Path, stem: str, key: str = "", flags: Sequence[str] = FLAGS,
                  include_dirs: Sequence[str] = ()) -> Path:
    """The compiled library of ``source`` (built atomically under a file lock if missing)."""
    path = library_path(source, stem, key, flags)
    if path.exists():
        return path
    try:
        import fcntl  # POSIX: several processes may build at once
    except ImportError as exc:
        raise BuildError(f"cannot lock the build directory here ({exc})") from None
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise BuildError("no C++ compiler found (set CXX or install g++)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():  # another process built it meanwhile
            return path
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        includes = [str(INCLUDE_DIR), *include_dirs]
        cmd = [cxx, *flags, *(f"-I{d}" for d in includes), str(source), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(tmp)
            raise BuildError(f"{' '.join(cmd)} failed:\n{done.stderr[:4000]}")
        os.replace(tmp, path)
    return path


def load_once(state: dict, source: Path, stem: str, signatures: Mapping[str, tuple[Any, Sequence[Any]]],
              what: str, flags: Sequence[str] = FLAGS, hint: str = "") -> Any:
    """``source``'s library (built if missing) with each function's ``(restype, argtypes)`` set,
    kept in ``state["lib"]``; None, with one RuntimeWarning naming ``what`` (then ``hint``), where
    it cannot be built or loaded (the caller's framework ops then run instead)."""
    if "lib" not in state:
        try:
            lib = ctypes.CDLL(str(build_library(source, stem, flags=flags)))
            for name, (restype, argtypes) in signatures.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, list(argtypes)
            state["lib"] = lib
        except Exception as exc:  # no compiler, a failed build, a missing symbol
            state["lib"] = None
            warnings.warn(f"meshembed: {what} unavailable ({type(exc).__name__}: {str(exc)[:500]}); the core "
                          f"functions run instead (same numbers).{hint}", RuntimeWarning, stacklevel=3)
    return state["lib"]
