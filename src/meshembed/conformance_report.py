"""``meshembed conformance``: run the conformance suite per backend and print one table.

Rows are test groups (the test name with its non-backend parameters: optimizer, combiner,
sharding, dtype, ...), columns are backends; each cell says pass/fail/skip/xfail and the
largest absolute/relative error against the golden data and against the NumPy reference.
The suite runs from the installed ``conformance`` package, so a third-party backend
registered by entry point is certified with the same command. Every skip and expected
failure carries its reason (a numbered note under the table, ``message`` in the JSON).

``--config my_config.pb`` runs the suite's engine checks on a user's own serialized
``TPUEmbeddingConfiguration`` instead: a few steps of random ids and gradients on every
backend, activations against the dense NumPy transcription (``conformance.reference``),
tables, slots and activations of every other backend against the NumPy backend, within the
suite's tolerances (``conformance.tolerances``).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys
from dataclasses import dataclass, field
from typing import Any

# A known, harmless warning of meshembed.variable.dtype_name's memo (an array_api_strict dtype
# compared with a NumPy one as a dict key); it is not a conformance result.
_IGNORED_WARNINGS = ("ignore:You are comparing a array_api_strict dtype:UserWarning",)


@dataclass
class Cell:
    outcome: str = ""
    golden: tuple[float, float] | None = None
    reference: tuple[float, float] | None = None
    message: str = ""

    def merge(self, other: "Cell") -> None:
        rank = {"failed": 4, "passed": 3, "xfailed": 2, "skipped": 1, "": 0}
        if rank.get(other.outcome, 0) > rank.get(self.outcome, 0) or other.outcome == "failed":
            if self.outcome != "failed":
                self.outcome, self.message = other.outcome, other.message
        for name in ("golden", "reference"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if theirs is not None:
                setattr(self, name, theirs if mine is None else (max(mine[0], theirs[0]), max(mine[1], theirs[1])))

    def text(self, note: int | None = None) -> str:
        parts = [{"passed": "pass", "failed": "FAIL", "skipped": "skip", "xfailed": "xfail"}.get(self.outcome, "-")]
        if note is not None:
            parts[0] += f" [{note}]"
        if self.golden:
            parts.append(f"g {self.golden[0]:.1e}/{self.golden[1]:.1e}")
        if self.reference:
            parts.append(f"r {self.reference[0]:.1e}/{self.reference[1]:.1e}")
        return " ".join(parts)


@dataclass
class Report:
    backends: list[str]
    rows: dict[str, dict[str, Cell]] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return any(c.outcome == "failed" for row in self.rows.values() for c in row.values())

    def markdown(self) -> str:
        head = "| test group | " + " | ".join(self.backends) + " |"
        sep = "|---|" + "---|" * len(self.backends)
        lines = [head, sep]
        notes: dict[str, int] = {}  # reason -> its number: every skip and xfail says why
        for group in sorted(self.rows):
            cells = []
            for b in self.backends:
                cell = self.rows[group].get(b, Cell())
                note = None
                if cell.outcome in ("skipped", "xfailed"):
                    note = notes.setdefault(cell.message or "no reason given", len(notes) + 1)
                cells.append(cell.text(note))
            lines.append(f"| {group} | " + " | ".join(cells) + " |")
        lines.append("")
        lines += [f"[{n}] {reason}" for reason, n in notes.items()]
        if notes:
            lines.append("")
        lines.append("cells: outcome, `g abs/rel` = largest error against golden data from TensorFlow/Keras/"
                     "PyTorch/Optax, `r abs/rel` = against the NumPy reference or the spec transcription")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "backends": self.backends,
            "failed": self.failed,
            "rows": {
                g: {b: c.__dict__ for b, c in row.items()} for g, row in sorted(self.rows.items())
            },
        }


class _Collector:
    """pytest plugin: one Cell per (group, backend)."""

    def __init__(self, report: Report):
        self.report = report
        # longest name first: "torch" must not match the start of "torch-module" (nor "jax" of "jax-functional")
        names = sorted(report.backends, key=len, reverse=True)
        self.pattern = re.compile(r"(^|-)(" + "|".join(re.escape(b) for b in names) + r")(-|$)")

    def pytest_runtest_logreport(self, report) -> None:
        if report.when != "call" and not (report.skipped or report.failed):
            return
        nodeid = report.nodeid.split("::", 1)[-1]
        name, _, params = nodeid.partition("[")
        params = params.rstrip("]")
        match = self.pattern.search(params)
        backend = match.group(2) if match else "all"
        if match:
            params = (params[: match.start()] + "-" + params[match.end():]).strip("-")
            params = params.replace("--", "-")
        group = f"{name}[{params}]" if params else name
        outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
        cell = Cell(outcome=outcome, message=_reason(report, outcome))
        for key, value in report.user_properties:
            if key == "err_golden":
                cell.golden = tuple(value)
            elif key == "err_reference":
                cell.reference = tuple(value)
        self.report.rows.setdefault(group, {}).setdefault(backend, Cell()).merge(cell)


def _reason(report: Any, outcome: str) -> str:
    """Why a test was skipped or expected to fail (pytest keeps it in different places), or
    the tail of a failure."""
    if outcome == "xfailed":
        return str(report.wasxfail) or "expected failure"
    if outcome == "skipped":
        longrepr = report.longrepr
        text = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        return text.removeprefix("Skipped: ")
    return str(report.longrepr)[-300:] if outcome == "failed" else ""


def suite_backends() -> dict[str, str | None]:
    """Every backend name the suite takes: ``{name: None if usable here, else the reason}``.

    Registered backends, plus the suite's own front ends (``jax-functional``: me.jax inside
    jit; ``torch-module``/``torch-module-compiled``: me.torch.EmbeddingCollection, eager and
    under torch.compile; ``torch-ranks``: torch.distributed ranks, only under
    ``python -m conformance.distributed``)."""
    import meshembed as me
    from meshembed.backend import registry
    from meshembed.errors import BackendUnavailableError

    names = list(registry._targets())
    try:
        from conformance import distributed, functional_jax, functional_torch

        names += [functional_jax.NAME, *functional_torch.NAMES, distributed.BACKEND_NAME]
        inner = {functional_jax.NAME: functional_jax.INNER,
                 **{n: functional_torch.INNER for n in functional_torch.NAMES}}
        distributed.register()
    except ImportError:  # pragma: no cover - the suite is installed with meshembed
        inner = {}
    found: dict[str, str | None] = {}
    for name in dict.fromkeys(names):
        try:
            me.get_backend(inner.get(name, name))
            found[name] = None
        except BackendUnavailableError as exc:
            found[name] = str(exc)
    return found


def check_backends(names: list[str]) -> str | None:
    """None when every requested backend can run here, else the message to exit with."""
    known = suite_backends()
    problems = [f"  {n}: {known[n] if n in known else 'unknown backend'}" for n in names if known.get(n, "?")]
    if names and not problems:
        return None
    usable = ", ".join(n for n, why in known.items() if why is None)
    other = ", ".join(n for n, why in known.items() if why is not None)
    return ("meshembed conformance: " + ("no backend given" if not names else "these backends cannot run here:")
            + ("\n" + "\n".join(problems) if problems else "")
            + f"\nBackends available here: {usable}." + (f" Known but unavailable: {other}." if other else "")
            + "\nFix: pass some of the available ones to --backends (comma-separated), or omit --backends.")


def run(backends: list[str] | None = None, extra_args: list[str] | None = None) -> Report:
    """Run the installed conformance suite on ``backends`` (default: every available one)."""
    try:
        import pytest
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SystemExit("`meshembed conformance` needs pytest and hypothesis: pip install 'meshembed[dev]'") from exc
    import conformance
    import meshembed as me

    names = backends or list(me.available_backends())
    report = Report(backends=names + ["all"])
    suite = pathlib.Path(conformance.__file__).parent
    args = [str(suite), "-q", "-p", "no:cacheprovider", "--no-header", "-rN",
            *(arg for w in _IGNORED_WARNINGS for arg in ("-W", w)), *(extra_args or [])]
    # the suite reads its backends from the environment; set only for the run, then restored
    before = os.environ.get("MESHEMBED_TEST_BACKENDS")
    os.environ["MESHEMBED_TEST_BACKENDS"] = ",".join(names)
    try:
        pytest.main(args, plugins=[_Collector(report)])
    finally:
        if before is None:
            del os.environ["MESHEMBED_TEST_BACKENDS"]
        else:
            os.environ["MESHEMBED_TEST_BACKENDS"] = before
    if not any("all" in row for row in report.rows.values()):
        report.backends.remove("all")
    return report


def _config_inputs(cfg: Any, steps: int, seed: int = 0) -> list[dict[str, Any]]:
    """Per step: ids per feature (rank 1: ragged bags of 0-3 ids with duplicates, sequences:
    dense ids), gradients and learning rates (step counters get the step, rates 0.05-0.1)."""
    import numpy as np

    from meshembed.embedding import RaggedIds

    rng = np.random.default_rng(seed)
    counters = {d.tag for t in cfg.tables if t.optimizer is not None for d in t.optimizer.dynamic_inputs()}
    out = []
    for step in range(steps):
        ids, grads = [], []
        for f in cfg.effective_features:
            vocab, dim = cfg.table(f.table_name).vocabulary_size, cfg.table(f.table_name).dimension
            if len(f.input_shape) == 1:
                rows = [list(rng.integers(0, vocab, size=int(rng.integers(0, 4)))) for _ in range(f.input_shape[0])]
                ids.append(RaggedIds.from_lists(rows))
            else:
                ids.append(rng.integers(0, vocab, size=f.input_shape))
            grads.append(rng.standard_normal(f.input_shape + (dim,)).astype(np.float32))
        lrs = [float(step + 1) if tag in counters else 0.05 * (1 + rng.random())
               for tag in range(cfg.num_dynamic_inputs)]
        out.append({"ids": ids, "grads": grads, "learning_rates": lrs})
    return out


def _run_engine(cfg: Any, backend: str, batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per step: activations by feature and, after the update, every table's arrays."""
    import numpy as np

    import meshembed as me

    emb = me.TPUEmbedding(cfg, backend=backend, seed=0)
    training = cfg.mode != "inference"
    names = [f.name or f"feature_{i}" for i, f in enumerate(cfg.effective_features)]
    out = []
    for batch in batches:
        emb.enqueue(batch["ids"], training=training)
        acts = emb.dequeue()
        acts = list(acts.values()) if isinstance(acts, dict) else list(acts)
        record = {f"activations:{n}": np.asarray(emb.backend.to_numpy(a)) for n, a in zip(names, acts)}
        if training:
            emb.apply_gradients(batch["grads"], learning_rates=batch["learning_rates"])
            for t in emb.table_names:
                record.update({f"{t}:{k}": v for k, v in emb.retrieve_parameters(t).items()})
        out.append(record)
    return out


def _dense_activations(cfg: Any, batch: dict[str, Any], tables: dict[str, Any]) -> dict[str, Any]:
    """The activations by the dense transcription: ``A_f @ E`` per feature."""
    import numpy as np

    from conformance import reference

    out = {}
    for i, (f, ids) in enumerate(zip(cfg.effective_features, batch["ids"])):
        t = cfg.table(f.table_name)
        if hasattr(ids, "row_splits"):
            splits = np.asarray(ids.row_splits)
            values = np.asarray(ids.values)
            slots = np.repeat(np.arange(len(splits) - 1), np.diff(splits))
            n = len(splits) - 1
        else:
            values = np.asarray(ids).reshape(-1)
            slots, n = np.arange(values.size), values.size
        a = reference.combination_matrix(slots, values, np.ones(values.size), n, t.vocabulary_size, t.combiner)
        out[f"activations:{f.name or f'feature_{i}'}"] = (a @ tables[t.name]).reshape(f.input_shape + (t.dimension,))
    return out


def _compare(actual: Any, expected: Any) -> Cell:
    """A cell by the suite's rule: ``|a - e| <= rtol (max|e| + |e|)``, rtol of float32."""
    import numpy as np

    from conformance.tolerances import RTOL_BACKEND

    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if a.shape != e.shape:
        return Cell("failed", message=f"shape {a.shape}, expected {e.shape}")
    rtol = RTOL_BACKEND["float32"]
    scale = float(np.nanmax(np.abs(e))) if e.size else 0.0
    diff = np.abs(a - e)
    same = np.isnan(a) & np.isnan(e)
    ok = bool(np.all(same | (diff <= rtol * (scale + np.abs(e)))))
    worst = float(np.max(np.where(same, 0.0, diff))) if diff.size else 0.0
    return Cell("passed" if ok else "failed", reference=(worst, worst / scale if scale else worst),
                message="" if ok else f"largest difference {worst:.3g} > rtol {rtol:g} of max |expected| {scale:.3g}")


def run_config(path: str, backends: list[str] | None = None, steps: int = 3) -> Report:
    """The suite's engine checks on the user's config at ``path`` (see the module doc): rows
    ``config[<feature or table:array>]``, the NumPy column against the dense transcription
    (activations) and every other column against the NumPy backend."""
    import meshembed as me
    from meshembed.config import EmbeddingConfig

    cfg = EmbeddingConfig.from_proto(path)
    cfg.check_domains()
    names = backends or list(me.available_backends())
    if "numpy" not in names:
        names = ["numpy", *names]  # the reference every other backend is compared with
    report = Report(backends=names)
    batches = _config_inputs(cfg, steps)
    runs: dict[str, Any] = {}
    for name in names:
        try:
            runs[name] = _run_engine(cfg, name, batches)
        except NotImplementedError as exc:  # e.g. MDLAdagradLight: no public formula
            runs[name] = Cell("skipped", message=str(exc))
        except Exception as exc:  # noqa: BLE001 - a backend failing on a valid config is a result
            runs[name] = Cell("failed", message=f"{type(exc).__name__}: {exc}"[-300:])
    ref = runs["numpy"]
    keys = list(ref[0]) if isinstance(ref, list) else ["engine"]
    initial = _initial_tables(cfg) if isinstance(ref, list) else {}
    for name, result in runs.items():
        for key in keys:
            if isinstance(result, Cell):
                cell = result
            elif isinstance(ref, Cell):
                cell = Cell("skipped", message=f"no NumPy reference: {ref.message}")
            elif name != "numpy":
                cell = Cell()
                for mine, theirs in zip(result, ref):
                    cell.merge(_compare(mine[key], theirs[key]))
            elif key.startswith("activations:"):
                cell = Cell()
                for k, batch in enumerate(batches):  # step k looks up the tables after step k - 1
                    tables = initial if k == 0 or cfg.mode == "inference" else {
                        t: ref[k - 1][f"{t}:parameters"] for t in initial}
                    cell.merge(_compare(ref[k][key], _dense_activations(cfg, batch, tables)[key]))
            else:
                cell = Cell("passed", message="the reference the other backends are compared with")
            report.rows.setdefault(f"config[{key}]", {})[name] = cell
    return report


def _initial_tables(cfg: Any) -> dict[str, Any]:
    """The tables a fresh NumPy engine starts with (seed 0, as every run)."""
    import meshembed as me

    emb = me.TPUEmbedding(cfg, backend="numpy", seed=0)
    return {t: emb.retrieve_parameters(t)["parameters"] for t in emb.table_names}


def main(args: Any) -> int:
    backends = [b.strip() for b in args.backends.split(",") if b.strip()] if args.backends is not None else None
    if backends is not None:
        problem = check_backends(backends)
        if problem:
            print(problem, file=sys.stderr)
            return 2
    if getattr(args, "config", None):
        from meshembed.errors import MeshembedError

        try:
            report = run_config(args.config, backends, steps=args.steps)
        except MeshembedError as exc:  # the config itself is invalid: no backend can run it
            print(f"meshembed conformance --config {args.config}: {exc}", file=sys.stderr)
            return 2
    else:
        report = run(backends, ["-k", args.select] if args.select else None)
    table = report.markdown()
    print(table)
    if args.markdown:
        pathlib.Path(args.markdown).write_text(table + "\n")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report.to_json(), indent=1) + "\n")
    if not report.rows:
        print("no conformance test ran")
        return 1
    return 1 if report.failed else 0
