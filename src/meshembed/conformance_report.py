"""``meshembed conformance``: run the conformance suite per backend and print one table.

Rows are test groups (the test name with its non-backend parameters: optimizer, combiner,
sharding, dtype, ...), columns are backends; each cell says pass/fail/skip/xfail and the
largest absolute/relative error against the golden data and against the NumPy reference.
The suite runs from the installed ``conformance`` package, so a third-party backend
registered by entry point is certified with the same command.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from dataclasses import dataclass, field

_BACKEND_IN_ID = re.compile(r"(^|-)({names})(-|$)")


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

    def text(self) -> str:
        parts = [{"passed": "pass", "failed": "FAIL", "skipped": "skip", "xfailed": "xfail"}.get(self.outcome, "-")]
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
        for group in sorted(self.rows):
            cells = [self.rows[group].get(b, Cell()).text() for b in self.backends]
            lines.append(f"| {group} | " + " | ".join(cells) + " |")
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
        self.pattern = re.compile(
            r"(^|-)(" + "|".join(re.escape(b) for b in report.backends) + r")(-|$)"
        )

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
        cell = Cell(outcome=outcome, message=str(report.longrepr)[-300:] if report.failed else "")
        for key, value in report.user_properties:
            if key == "err_golden":
                cell.golden = tuple(value)
            elif key == "err_reference":
                cell.reference = tuple(value)
        self.report.rows.setdefault(group, {}).setdefault(backend, Cell()).merge(cell)


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
    args = [str(suite), "-q", "-p", "no:cacheprovider", "--no-header", "-rN", *(extra_args or [])]
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


def main(args) -> int:
    backends = [b.strip() for b in args.backends.split(",")] if args.backends else None
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
