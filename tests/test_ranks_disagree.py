"""Ranks that disagree fail loudly on every rank, at once (issue #31 item 6), over 2 real
``gloo`` ranks: a different config, seed, learning rate or training mode, a NaN in one rank's
loaded arrays — every rank raises before anything changes, none trains on; a rank that
skips a step fails the others within ``MESHEMBED_AGREE_TIMEOUT`` seconds, not the process
group's 30 minutes."""

from __future__ import annotations

import os
import pathlib
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch backend needs torch (pip install 'meshembed[torch]')")
import torch.distributed as dist  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)

from tests.test_torch_distributed import _launch  # noqa: E402

HERE = "tests.test_ranks_disagree"
B, V = 4, 16


def _config(lr=0.1, vocab=V, combiner="mean", dynamic=False):
    import meshembed as me

    rate = me.embedding.DynamicLearningRate(0) if dynamic else lr
    return me.EmbeddingConfig(
        tables=[me.TableConfig("t", vocab, 4, optimizer=me.embedding.Adagrad(learning_rate=rate), combiner=combiner)],
        features=[me.FeatureConfig("t", (B,), name="a")])


def _outcome(out: dict, label: str, call) -> None:
    """Run ``call``; record its error type and message (or none) under ``label``."""
    from meshembed.errors import MeshembedError

    try:
        call()
        out[f"{label}/error"] = np.array("")
    except MeshembedError as exc:
        out[f"{label}/error"] = np.array(type(exc).__name__)
        out[f"{label}/message"] = np.array(str(exc))


def scenario_disagree(rank: int, world: int, tmp: pathlib.Path) -> dict[str, np.ndarray]:
    import meshembed as me

    out: dict[str, np.ndarray] = {}
    other = rank == world - 1
    for label, kwargs in {"lr": dict(lr=0.2 if other else 0.1), "vocab": dict(vocab=V + 2 if other else V),
                          "combiner": dict(combiner="sum" if other else "mean")}.items():
        _outcome(out, f"build_{label}", lambda: me.TPUEmbedding(_config(**kwargs), backend="torch", num_shards=world))
    _outcome(out, "build_seed", lambda: me.TPUEmbedding(_config(), backend="torch", num_shards=world, seed=rank))
    emb = me.TPUEmbedding(_config(dynamic=True), backend="torch", num_shards=world)
    ids = np.arange(B) + rank
    before = emb.retrieve_parameters("t")["parameters"]

    def step(lr):
        emb.enqueue([ids])
        acts = emb.dequeue()
        emb.apply_gradients([np.ones(tuple(a.shape), np.float32) for a in acts], [lr])

    _outcome(out, "learning_rate", lambda: step(0.5 if other else 0.1))
    out["learning_rate/unchanged"] = np.array(np.array_equal(before, emb.retrieve_parameters("t")["parameters"]))
    emb.discard()
    _outcome(out, "mode", lambda: emb.enqueue([ids], training=not other))
    out["mode/nothing_pending"] = np.array(emb.pending is None)
    table = emb.retrieve_parameters("t")["parameters"]
    bad = table.copy()
    if other:
        bad[0, 0] = np.nan
    _outcome(out, "nan_load", lambda: emb.load_parameters("t", bad))
    out["nan_load/unchanged"] = np.array(np.array_equal(table, emb.retrieve_parameters("t")["parameters"]))
    step(0.1)  # the ranks are still in step: the same call everywhere goes through
    out["final"] = emb.retrieve_parameters("t")["parameters"]
    return out


def scenario_skipped_step(rank: int, world: int, tmp: pathlib.Path) -> dict[str, np.ndarray]:
    """The last rank skips ``apply_gradients`` (and then waits): the others must fail within
    the agreement timeout. Writes its own results and leaves without tearing the group down
    (it is broken by the timed-out collective)."""
    os.environ["MESHEMBED_AGREE_TIMEOUT"] = "5"
    import meshembed as me

    emb = me.TPUEmbedding(_config(), backend="torch", num_shards=world)
    out: dict[str, np.ndarray] = {}
    emb.enqueue([np.arange(B)])
    acts = emb.dequeue()
    start = time.monotonic()
    if rank < world - 1:
        _outcome(out, "skipped", lambda: emb.apply_gradients([np.ones(tuple(a.shape), np.float32) for a in acts]))
    else:
        time.sleep(12)
        out["skipped/error"] = np.array("skipper")
    out["skipped/elapsed"] = np.array(time.monotonic() - start)
    np.savez(tmp / f"rank{rank}.npz", **out)
    os._exit(0)


def test_ranks_that_disagree_all_fail_and_change_nothing(tmp_path):
    results, codes = _launch(f"{HERE}:scenario_disagree", 2, tmp_path, deadline_s=180.0)
    assert codes == [0, 0]
    for label in ("build_lr", "build_vocab", "build_combiner", "build_seed"):
        for r in (0, 1):
            assert str(results[r][f"{label}/error"]) == "ConfigError", (label, r)
            assert "disagree" in str(results[r][f"{label}/message"]), (label, r)
    for label in ("learning_rate", "mode"):
        for r in (0, 1):
            assert str(results[r][f"{label}/error"]) == "InputError", (label, r, results[r].get(f"{label}/message"))
            assert "disagree" in str(results[r][f"{label}/message"])
    assert all(bool(results[r]["learning_rate/unchanged"]) and bool(results[r]["mode/nothing_pending"]) for r in (0, 1))
    assert [str(results[r]["nan_load/error"]) for r in (0, 1)] == ["InputError", "InputError"]
    assert "rank 1" in str(results[0]["nan_load/message"]) and "NaN" in str(results[1]["nan_load/message"])
    assert all(bool(results[r]["nan_load/unchanged"]) for r in (0, 1))
    np.testing.assert_array_equal(results[0]["final"], results[1]["final"])  # one table, gathered on both


def test_a_rank_that_skips_a_step_fails_the_others_within_the_agreement_timeout(tmp_path):
    results, _ = _launch(f"{HERE}:scenario_skipped_step", 2, tmp_path, deadline_s=120.0)
    assert str(results[0]["skipped/error"]) == "RankFailureError"
    assert "MESHEMBED_AGREE_TIMEOUT" in str(results[0]["skipped/message"])
    assert float(results[0]["skipped/elapsed"]) < 11.0  # the 5 s timeout, not the group's
