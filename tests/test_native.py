"""meshembed_native: the cache key of a built kernel library covers the shared headers; the
one huge-page helper asks for whole 2 MiB pages only."""

from __future__ import annotations

import pathlib
import sys
from types import SimpleNamespace

import pytest

from meshembed_native import build as native
from meshembed_native import pages


def test_library_key_covers_source_flags_and_headers(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHEMBED_CACHE", str(tmp_path / "cache"))
    include = tmp_path / "cpp"
    include.mkdir()
    (include / "shared.h").write_text("// v1\n")
    monkeypatch.setattr(native, "INCLUDE_DIR", include)
    source = tmp_path / "k.cc"
    source.write_text('#include "shared.h"\n')
    first = native.library_path(source, "k")
    assert first == native.library_path(source, "k")
    assert native.library_path(source, "k", flags=(*native.FLAGS, "-fopenmp")) != first
    (include / "shared.h").write_text("// v2\n")  # a header edit must rebuild every kernel
    assert native.library_path(source, "k") != first


def test_the_shared_header_is_on_the_include_path_and_in_the_key():
    assert (native.INCLUDE_DIR / "row_kernels.h").is_file()
    assert native.INCLUDE_DIR.name == "meshembed_native"  # backend-side, not in the core


def test_the_core_carries_no_cpp_and_no_build_driver():
    import meshembed

    core = pathlib.Path(meshembed.__file__).parent
    assert not list(core.rglob("*.h")) and not list(core.rglob("*.cc")) and not (core / "native.py").exists()


class _Madvise:
    """Stands in for libc's ``madvise`` (a ctypes function: it takes ``argtypes``)."""

    def __init__(self, calls: list):
        self.calls = calls

    def __call__(self, start, length, advice):
        self.calls.append((start, length, advice))
        return 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is asked for on Linux only")
@pytest.mark.parametrize("collapse", [False, True])
def test_huge_pages_cover_only_whole_pages_inside_the_buffer(monkeypatch, collapse):
    calls: list = []
    monkeypatch.setattr(pages.ctypes, "CDLL", lambda *a, **k: SimpleNamespace(madvise=_Madvise(calls)))
    page = pages.HUGE_PAGE
    pages.advise_huge_pages(3 * page + 4096, 5 * page, collapse=collapse)
    expected = [(4 * page, 4 * page, pages.MADV_HUGEPAGE)]
    if collapse:
        expected.append((4 * page, 4 * page, pages.MADV_COLLAPSE))
    assert calls == expected
    calls.clear()
    pages.advise_huge_pages(page + 1, page, collapse=collapse)  # no whole page inside: nothing asked
    assert calls == []


def test_huge_pages_on_real_memory_is_harmless():
    import numpy as np

    buf = np.zeros(3 * pages.HUGE_PAGE // 4, dtype=np.float32)
    pages.advise_huge_pages(buf.ctypes.data, buf.nbytes, collapse=True)
    assert not buf.any()  # a hint: the contents stay


def test_load_once_sets_signatures_and_warns_once_when_unusable(tmp_path, monkeypatch):
    import ctypes
    import warnings

    monkeypatch.setenv("MESHEMBED_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "add.cc"
    source.write_text('extern "C" double me_add(double a, double b) { return a + b; }\n')
    state: dict = {}
    lib = native.load_once(state, source, "add", {"me_add": (ctypes.c_double, [ctypes.c_double] * 2)}, "adding is")
    assert lib.me_add(1.5, 2.25) == 3.75 and native.load_once(state, source, "add", {}, "adding is") is lib
    broken: dict = {}
    with pytest.warns(RuntimeWarning, match=r"adding is unavailable .*same numbers\)\. Fix it"):
        assert native.load_once(broken, source, "add", {"me_sub": (None, [])}, "adding is", hint=" Fix it.") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.load_once(broken, source, "add", {"me_sub": (None, [])}, "adding is") is None


def test_both_backends_bind_the_shared_drivers():
    """The dense chunked update, the all-finite check, the row gather and the huge-page hint
    are written once (meshembed_native/drivers.h): the torch and JAX sources call them and hold
    no loop of their own for them."""
    root = pathlib.Path(native.INCLUDE_DIR).parent
    torch_src = (root / "meshembed_torch" / "native_dense.cc").read_text() + (root / "meshembed_torch" / "native_fused.cc").read_text()
    jax_src = (root / "meshembed_jax" / "native.cc").read_text()
    for src in (torch_src, jax_src):
        assert '#include "drivers.h"' in src
        for driver in ("meshembed::DenseUpdate<", "meshembed::AllFinite(", "meshembed::GatherRowRange("):
            assert driver in src, driver
        assert "madvise(" not in src and "0x7f800000" not in src  # no second huge-page hint or finite test
    assert "meshembed::AdviseHugePages(" in jax_src
