"""``python -m meshembed demo|conformance|bench`` (same as the ``meshembed`` command)."""

from meshembed.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
