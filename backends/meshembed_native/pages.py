"""2 MiB pages for large CPU tables, the one helper of the torch and JAX backends.

Row access of an embedding table is random, so with 4 KiB pages nearly every touched row
costs a TLB miss; transparent huge pages remove most of them (figures: docs/benchmarks.md,
"Huge pages"). A hint only: anything unsupported leaves ordinary pages.
"""

from __future__ import annotations

import ctypes
import sys

#: Tables at least this large are worth asking for huge pages (both backends).
HUGE_PAGE_MIN_BYTES = 32 << 20
HUGE_PAGE = 1 << 21
MADV_HUGEPAGE = 14  # keep (or make, on the next fault) the range's pages huge
MADV_COLLAPSE = 25  # Linux >= 6.1: collapse the already-written pages now, synchronously


def advise_huge_pages(addr: int, nbytes: int, collapse: bool = False) -> None:
    """Ask Linux for 2 MiB pages over the whole huge pages inside ``[addr, addr + nbytes)``:
    ``MADV_HUGEPAGE`` (before the first write: the pages come huge), and with ``collapse``
    also ``MADV_COLLAPSE`` (memory already written, e.g. a buffer XLA allocated)."""
    if not sys.platform.startswith("linux"):
        return
    start = -(-addr // HUGE_PAGE) * HUGE_PAGE
    end = (addr + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(start, end - start, MADV_HUGEPAGE)
        if collapse:
            libc.madvise(start, end - start, MADV_COLLAPSE)
    except (OSError, AttributeError):  # no libc / no madvise here: ordinary pages
        return
