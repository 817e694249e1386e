"""meshembed.native: the cache key of a built kernel library covers the shared headers."""

from __future__ import annotations

from meshembed import native


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
