"""The ``meshembed`` command: ``demo``, ``conformance``, ``bench`` and ``dryrun``."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshembed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a small recommender on synthetic clicks")
    demo.add_argument("--backend", default=None, help="numpy, torch, jax ... (default: the current default)")
    demo.add_argument("--steps", type=int, default=None, help="training steps (default: the demo's own)")

    conf = sub.add_parser("conformance", help="run the conformance suite on each backend and print one table")
    conf.add_argument("--backends", default=None, help="comma-separated backends (default: every available one)")
    conf.add_argument("--json", default=None, help="also write the report as JSON to this file")
    conf.add_argument("--markdown", default=None, help="also write the table as Markdown to this file")
    conf.add_argument("-k", dest="select", default=None, help="only tests matching this pytest -k expression")
    conf.add_argument("--against", default=None, help="diff against peers instead: torchrec,fbgemm (me.interop)")
    conf.add_argument("--config", default=None, metavar="PATH",
                      help="run the suite's engine checks on your serialized TPUEmbeddingConfiguration "
                           "(.pb binary, .pbtxt text) instead of its own cases")
    conf.add_argument("--steps", type=int, default=3, help="training steps per --against or --config case")

    bench = sub.add_parser("bench", help="side-by-side benchmarks (W1 sparse step, W2 dense Adadelta); needs a source checkout")
    bench.add_argument("--backends", default=None)
    bench.add_argument("--workload", default="all", choices=["W1", "W2", "all", "tiny"])
    bench.add_argument("--peers", action="store_true", help="also time installed peer libraries")
    bench.add_argument("--repeats", type=int, default=7)
    bench.add_argument("--json", default=None)
    bench.add_argument("--png", default=None)
    from meshembed import dryrun_cli

    dryrun_cli.add_parser(sub)
    return parser


#: What each ``--against`` peer imports, and how to get it (the interop extra).
_PEERS = {"torchrec": ("torchrec", "fbgemm_gpu"), "fbgemm": ("fbgemm_gpu",), "keras_rs": ("keras", "keras_rs")}
_INTEROP_HINT = ("install the interop extra: from a source checkout `make test-interop` (pinned torchrec, "
                 "fbgemm-gpu-cpu and keras-rs, --no-deps, in .venv/interop; then run .venv/interop/bin/meshembed), "
                 "or `pip install 'meshembed[interop]'` where torchrec's CUDA fbgemm-gpu installs")


def _against(args: argparse.Namespace) -> int:
    """``conformance --against``: a missing peer is a message with the install command, not a traceback."""
    import importlib.util

    if args.config:
        print("meshembed conformance: --against and --config are separate runs; give one of them.", file=sys.stderr)
        return 2
    if args.backends:  # one backend for the meshembed side of the diff
        from meshembed.conformance_report import check_backends

        problem = check_backends([args.backends.strip()])
        if problem:
            print(problem, file=sys.stderr)
            return 2
    for peer in (a.strip() for a in args.against.split(",")):
        missing = [m for m in _PEERS.get(peer, ()) if importlib.util.find_spec(m) is None]
        if missing:
            print(f"meshembed conformance --against {peer}: needs {', '.join(missing)} (not installed). "
                  f"Fix: {_INTEROP_HINT}.", file=sys.stderr)
            return 2
    from meshembed.errors import ConfigError
    from meshembed.interop import cli_main

    try:
        return cli_main(args)
    except ConfigError as exc:  # an unknown peer name
        print(f"meshembed conformance: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from meshembed import demo

        return demo.main(backend=args.backend, steps=args.steps) or 0
    if args.command == "conformance" and args.against:
        return _against(args)
    if args.command == "conformance":
        from meshembed import conformance_report

        return conformance_report.main(args)
    if args.command == "dryrun":
        from meshembed import dryrun_cli

        return dryrun_cli.main(args)
    from meshembed import bench

    return bench.main(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
