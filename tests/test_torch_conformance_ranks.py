"""The whole conformance suite on the torch backend over 2 and 4 real ``gloo`` ranks.

Each case launches the suite as N processes on loopback (``python -m conformance.distributed``,
see ``conformance/README.md``): every rank runs every test in lockstep on the ``torch-ranks``
backend — the distributed ``TorchBackend`` fed a data-parallel split of each batch — and the
numbers must equal the NumPy reference within the suite's tolerances. Every rank must exit 0
and report no failure. A negative control checks the harness is not vacuous: when every rank
feeds the whole batch (gradients ``world`` times too large) the suite must fail.

Marked ``ranks`` (and ``slow``): ``pytest -m "not ranks"`` deselects them; ``make test`` runs
them. Measured on the 2-core dev box (2026-11-30): the whole suite on 2 ranks ≈ 30 s, on
4 ranks ≈ 60–65 s; this whole file ≈ 2.5 min.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET

import pytest

torch = pytest.importorskip("torch", reason="the torch backend needs torch (pip install 'meshembed[torch]')")
import torch.distributed as dist  # noqa: E402

from conformance import distributed as ranks  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)

pytestmark = [pytest.mark.ranks, pytest.mark.slow]

DEADLINE_S = 900.0


def _counts(junit) -> dict[str, int]:
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def _run(world, tmp_path, args=(), **env):
    environ = {k: v for k, v in os.environ.items() if k not in ("MESHEMBED_TEST_BACKENDS", ranks.SPLIT_ENV)}
    environ.update(env)
    results = ranks.launch(world, ["-q", *args], workdir=tmp_path, deadline_s=DEADLINE_S,
                           rank0_to_stdout=False, env=environ)
    logs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n" + r.log.read_text(errors="replace")[-4000:]
                     for r in results if r.log and r.log.exists())
    return results, logs


@pytest.mark.parametrize("world", [2, 4])
def test_whole_conformance_suite_passes_on_gloo_ranks(world, tmp_path):
    # 4 ranks: the optimizer option variants are left out (conformance/README.md, "Repeats on 8 devices"):
    # per-row math after the owners' sum, the same on 2 ranks, where they all run
    results, logs = _run(world, tmp_path, **({"MESHEMBED_TEST_DEVICE_REPEATS": "0"} if world == 4 else {}))
    assert [r.returncode for r in results] == [0] * world, logs
    counts = [_counts(r.junit) for r in results]
    for r, c in enumerate(counts):
        assert c["failures"] == 0 and c["errors"] == 0, f"rank {r}: {c}\n{logs}"
    assert all(c == counts[0] for c in counts), counts  # every rank ran the same tests
    assert counts[0]["tests"] - counts[0]["skipped"] >= 200, counts[0]  # the whole suite, not a subset
    assert f"meshembed conformance: {world} ranks" in results[0].log.read_text()  # rank 0's summary
    on_ranks = [c for c in ET.parse(results[0].junit).iter("testcase") if "[torch-ranks" in c.get("name", "")]
    assert len(on_ranks) >= 200, len(on_ranks)  # they ran on the distributed backend


def test_every_rank_feeding_the_whole_batch_fails(tmp_path):
    """The mistake the harness exists to catch: without the split, every row gets ``world``
    times its gradient, and the suite must say so (on every rank)."""
    select = "update_rows_sums_duplicates or optimizer_matches_reference and (sgd-plain or adagrad-plain)"
    results, logs = _run(2, tmp_path, ["-k", select], **{ranks.SPLIT_ENV: "none"})
    assert all(r.returncode == 1 for r in results), logs
    counts = [_counts(r.junit) for r in results]
    assert all(c["failures"] >= 10 for c in counts), counts


def test_contiguous_blocks_split_passes(tmp_path):
    """Uneven contiguous blocks (some ranks get no ids at all) give the same numbers."""
    select = ("test_backend_protocol or sharding_changes or combiner_backward or optimizer_matches_reference and "
              "(adagrad-plain or adam_non_lazy_sum_inside_sqrt-plain or ftrl-dynamic_lr)")
    results, logs = _run(4, tmp_path, ["-k", select], **{ranks.SPLIT_ENV: "blocks"})
    assert [r.returncode for r in results] == [0] * 4, logs
    assert all(_counts(r.junit)["tests"] >= 65 for r in results), [_counts(r.junit) for r in results]


_LOCKSTEP_CONFTEST = """
from conformance import distributed
CTX = distributed.from_env()
def pytest_configure(config):
    config.pluginmanager.register(distributed.Lockstep(CTX), "meshembed-ranks")
"""
_LOCKSTEP_TESTS = """
import torch, torch.distributed as dist
def test_ok():
    dist.barrier()
def test_fails_on_rank_1_only():
    assert dist.get_rank() != 1, "deliberate failure on rank 1"
def test_still_paired():
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
def test_rank_1_skips_a_collective():
    if dist.get_rank() == 1:
        raise AssertionError("rank 1 leaves early")
    dist.barrier()
def test_never_runs():
    pass
"""


def test_lockstep_reports_other_ranks_failures_and_stops_when_ranks_diverge(tmp_path):
    """A failure on rank 1 alone fails the test on rank 0 too (rank 0 reports it); a rank that
    leaves a collective early makes the others time out, and every rank stops there."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(_LOCKSTEP_CONFTEST)
    (suite / "test_lockstep.py").write_text(_LOCKSTEP_TESTS)
    results, logs = _run(2, tmp_path / "run", [str(suite), "-rA"], **{ranks.PG_TIMEOUT_ENV: "5"})
    assert [r.returncode for r in results] == [2, 2], logs  # interrupted, with failures
    rank0 = results[0].log.read_text()
    assert "rank 1: failed — AssertionError: deliberate failure on rank 1" in rank0, rank0
    assert "PASSED" in rank0 and "test_still_paired" in rank0
    assert "the ranks diverged at" in rank0 and "test_never_runs" not in rank0.split("FAILURES")[0]
    for r in results:
        c = _counts(r.junit)
        assert (c["tests"], c["failures"]) == (4, 2), (r.rank, c)
