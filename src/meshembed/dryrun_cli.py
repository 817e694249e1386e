"""``meshembed dryrun``: the TPU's input limits, checked on your batches before you rent one."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

DESCRIPTION = """\
Replay the TPU's embedding input preprocessing (TF tpu_embedding_v3 / jax-tpu-embedding) on
sample batches and report, per table and partition, the ids and unique ids against the limits
(max_ids_per_partition, max_unique_ids_per_partition, TF's max_ids_per_chip_per_sample), the
CSR buffer, padding, an HBM estimate and suggested limits; with --allow-id-dropping, every
(feature, sample, position, id) the TPU would drop, in the order it drops them."""

EPILOG = """\
inputs:
  --config   a serialized TPUEmbeddingConfiguration (.pb binary, .pbtxt text), or
             module:attribute naming a me.EmbeddingConfig or a me.tpu FeatureConfig nest
  BATCH.npz  one batch per file, keys by feature name (a nest's path, e.g. towers/user):
             NAME                          dense ids, shape = the feature's input shape
             NAME:values + NAME:row_splits ragged ids
             NAME:indices + NAME:values + NAME:dense_shape   sparse (COO) ids
             NAME:weights                  optional weights, aligned with NAME:values
             Each file is the global batch: split evenly over the chips, then each chip's cores.
  --limits   JSON (a file or inline): {"max_ids_per_partition": N, "max_unique_ids_per_partition": N,
             "max_ids_per_chip_per_sample": N} for every table, or {"TABLE": {...}, ...}.
             Default 256/256 (TF's and jax-tpu-embedding's defaults); the proto carries no limits.

outputs:
  a table per table (rich's when installed), the dropped ids, the suggested limits;
  --json PATH (or -) the report as JSON, schema "meshembed.dryrun/1" (docs/dryrun.md).
  Exit status 0 when every table fits (or only drops ids with --allow-id-dropping),
  1 when a table would fail on the TPU (a limit exceeded without id dropping), 2 on bad input.

topology presets (published figures, sources in docs/dryrun.md):
  v3 (TensorCore era, counts only), v4, v5p, v6e (Trillium), tpu7x (Ironwood)."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``dryrun`` on the ``meshembed`` command's subparsers."""
    from meshembed.embedding.dryrun import ALGORITHMS, PRESETS

    p = subparsers.add_parser("dryrun", help="check TPU embedding input limits on sample batches (no TPU needed)",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("batches", nargs="+", metavar="BATCH.npz", help="sample batches, one .npz file each")
    p.add_argument("--config", required=True, help="TPUEmbeddingConfiguration .pb/.pbtxt, or module:attribute")
    p.add_argument("--topology", default="v5p", choices=sorted(PRESETS), help="target TPU generation (default v5p)")
    p.add_argument("--chips", type=int, default=1, help="chips in the slice (default 1)")
    p.add_argument("--sparse-cores-per-chip", type=int, default=None, help="override the preset's SparseCores per chip")
    p.add_argument("--limits", default=None, help="limits as JSON, inline or a file (see below)")
    p.add_argument("--allow-id-dropping", action="store_true", help="list the ids the TPU drops instead of failing")
    p.add_argument("--algorithm", default="jax-tpu-embedding", choices=ALGORITHMS,
                   help="whose preprocessing to replay (default jax-tpu-embedding)")
    p.add_argument("--headroom", type=float, default=0.0, help="suggested limits = observed max x (1 + headroom)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON ('-': stdout)")
    p.add_argument("--max-dropped", type=int, default=20, help="dropped ids shown in the table (default 20)")
    p.add_argument("--plain", action="store_true", help="plain text even when rich is installed")
    return p


def _config(spec: str) -> Any:
    """A proto path, or ``module:attribute`` naming a config object."""
    if ":" in spec and not Path(spec).exists():
        module, _, attr = spec.partition(":")
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj
    return Path(spec)


def _limits(text: str | None) -> Any:
    if text is None:
        return None
    path = Path(text)
    return json.loads(path.read_text() if path.exists() else text)


def main(args: argparse.Namespace) -> int:
    from meshembed.errors import MeshembedError
    from meshembed.tpu.dryrun import dry_run

    try:
        report = dry_run(_config(args.config), [Path(b) for b in args.batches], args.topology, chips=args.chips,
                         sparse_cores_per_chip=args.sparse_cores_per_chip, limits=_limits(args.limits),
                         allow_id_dropping=args.allow_id_dropping, algorithm=args.algorithm, headroom=args.headroom)
    except (MeshembedError, OSError, ValueError, ImportError, AttributeError) as exc:
        print(f"meshembed dryrun: {exc}", file=sys.stderr)
        return 2
    if args.json == "-":
        print(report.to_json())
    else:
        print(report.render(use_rich=False if args.plain else None, max_dropped=args.max_dropped))
        if args.json:
            Path(args.json).write_text(report.to_json())
    return 1 if any(t["status"] == "error" for t in report.tables) else 0


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="meshembed")
    add_parser(parser.add_subparsers(dest="command", required=True))
    sys.exit(main(parser.parse_args()))
