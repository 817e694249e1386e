"""Torch ranks never fall out of step (issue #17 item 4), over 2 and 4 real ``gloo`` ranks.

1. Every rank takes part in every collective of a step whatever its local ids: one rank (or
   all but one, or all) with no ids, every id on one shard, every id the same, gradient accumulation
   off with a different number of occurrence rounds per rank, non-lazy Adam. The tables
   must equal the NumPy engine run in one process on the concatenated batch.
2. Validate, then agree: one rank's bad input (an id out of range, a NaN gradient, a wrong
   gradient shape, a call out of order) makes every rank raise the same error type at once —
   the bad rank its own message, the others one naming it — and no rank changes anything;
   the next good step then equals a run that never saw the bad input.

Ranks are spawned by ``tests/test_torch_distributed.py``'s launcher (loopback, a process-group
timeout of seconds). Before the fix, case 1 hung until that timeout (``RankFailureError``) and
case 2 left the good ranks waiting in the row exchange.
"""

from __future__ import annotations

import pathlib
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch backend needs torch (pip install 'meshembed[torch]')")
import torch.distributed as dist  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)

from tests.test_torch_distributed import PG_TIMEOUT_S, _launch  # noqa: E402
from tests.test_torch_distributed import _engine_config as _config  # noqa: E402  (two features on t, one on u)

VOCAB, DIM, SAMPLES = 37, 4, 4  # SAMPLES per rank; the global batch is SAMPLES * world
HERE = "tests.test_torch_ranks_agree"


def _optimizers() -> dict:
    import meshembed as me

    return {
        "sgd": me.embedding.SGD(learning_rate=0.1),
        "adagrad": me.embedding.Adagrad(learning_rate=0.1, initial_accumulator_value=0.1),
        "adadelta": me.embedding.Adadelta(learning_rate=0.5, rho=0.9, epsilon=1e-6),
        "adagrad_noacc": me.embedding.Adagrad(learning_rate=0.1, initial_accumulator_value=0.1,
                                              use_gradient_accumulation=False),
        "adadelta_noacc": me.embedding.Adadelta(learning_rate=0.5, rho=0.9, epsilon=1e-6,
                                                use_gradient_accumulation=False),
        "adam_nonlazy": me.embedding.Adam(learning_rate=0.1, lazy_adam=False),
    }


def _case_ids(case: str, world: int) -> list[list[list[list[int]]]]:
    """Per rank: per feature (a, b, c): SAMPLES per-sample id lists (a RaggedIds.from_lists)."""
    def ragged(rank: int, vocab: int, salt: int) -> list[list[int]]:
        if case == "one_rank_has_ids":  # the example: rank 0 has ids, the others none
            return [[1, 2], [3], [4, 5], [6]] if rank == 0 else [[] for _ in range(SAMPLES)]
        if case == "all_empty":  # no rank has an id: every exchange is empty everywhere
            return [[] for _ in range(SAMPLES)]
        if case == "one_rank_empty":  # only the last rank has nothing
            return [[] for _ in range(SAMPLES)] if rank == world - 1 else \
                [[(rank + 3 * s + salt) % vocab, (7 * s + salt) % vocab] for s in range(SAMPLES)]
        if case == "one_shard":  # MOD over `world` shards: every id is a multiple of world -> shard 0
            return [[(world * (rank + s + salt)) % (vocab - vocab % world)] for s in range(SAMPLES)]
        if case == "all_duplicates":  # the same id everywhere, several times per sample
            return [[5, 5, 5] if vocab > 5 else [2, 2, 2] for _ in range(SAMPLES)]
        if case == "rounds_differ":  # rank r repeats id 5 (r + 1) * 2 times: rounds 2..2·world
            return [[5] * (rank + 1), [5] * (rank + 1), [(rank + salt) % vocab], []]
        raise AssertionError(case)

    return [[ragged(r, VOCAB, 0), ragged(r, VOCAB, 1), ragged(r, 11, 2)] for r in range(world)]


CASES = ("one_rank_has_ids", "all_empty", "one_rank_empty", "one_shard", "all_duplicates", "rounds_differ")


def _grads(world: int, step: int) -> list[np.ndarray]:
    """Global gradients (one row per sample of every feature), fixed by the step."""
    rng = np.random.default_rng(100 + step)
    return [rng.standard_normal((SAMPLES * world, d)).astype(np.float32) for d in (DIM, DIM, 3)]


def _step(emb, ids, grads) -> None:
    import meshembed as me

    emb.enqueue([me.RaggedIds.from_lists(f) for f in ids])
    emb.dequeue()
    emb.apply_gradients(grads)


def _local(world: int, rank: int, arrays: list[np.ndarray]) -> list[np.ndarray]:
    return [a[rank * SAMPLES:(rank + 1) * SAMPLES] for a in arrays]


def _tables(emb) -> dict[str, np.ndarray]:
    return {f"{t}.{slot}": arr for t in ("t", "u") for slot, arr in emb.retrieve_parameters(t).items()}


# -- scenarios, run inside each rank --------------------------------------------------------------
def scenario_in_step(rank: int, world: int, tmp: pathlib.Path) -> dict[str, np.ndarray]:
    """Every case x optimizer: two steps on this rank's ids; the tables afterwards."""
    import meshembed as me

    out = {}
    for case in CASES:
        ids = _case_ids(case, world)[rank]
        for name, opt in _optimizers().items():
            emb = me.TPUEmbedding(_config(SAMPLES, opt), backend="torch", num_shards=world)
            for step in range(2):
                _step(emb, ids, _local(world, rank, _grads(world, step)))
            for k, v in _tables(emb).items():
                out[f"{case}/{name}/{k}"] = v
    return out


def _bad_calls(bad: int) -> dict:
    """label -> (make(rank, ids, grads) -> (stage, ids, grads, learning_rates), error type):
    what each rank passes; only rank ``bad`` passes something invalid."""

    def out_of_range(rank, ids, grads):
        return "enqueue", [ids[0], [[VOCAB + 3]] + ids[1][1:], ids[2]] if rank == bad else ids, grads, ()

    def negative_id(rank, ids, grads):
        return "enqueue", [[[-1]] + ids[0][1:], ids[1], ids[2]] if rank == bad else ids, grads, ()

    def nan_gradient(rank, ids, grads):
        if rank == bad:
            grads = [g.copy() for g in grads]
            grads[1][0, 1] = np.nan
        return "apply", ids, grads, ()

    def wrong_shape(rank, ids, grads):
        return "apply", ids, [grads[0], grads[1][:, :-1], grads[2]] if rank == bad else grads, ()

    def extra_learning_rate(rank, ids, grads):  # the config has no dynamic learning rate
        return "apply", ids, grads, [0.1] if rank == bad else ()

    return {"out_of_range": (out_of_range, "InputError"), "negative_id": (negative_id, "InputError"),
            "nan_gradient": (nan_gradient, "InputError"), "wrong_shape": (wrong_shape, "InputError"),
            "extra_learning_rate": (extra_learning_rate, "InputError")}


def scenario_bad_input(rank: int, world: int, tmp: pathlib.Path) -> dict[str, np.ndarray]:
    """A good step, then for each bad input: the failing call on every rank (its error, how
    long it took, the tables before and after), then the good version of that step."""
    import meshembed as me
    from meshembed.errors import MeshembedError

    out = {}
    emb = me.TPUEmbedding(_config(SAMPLES, _optimizers()["adagrad"]), backend="torch", num_shards=world)
    good_ids = _case_ids("one_rank_empty", world)[rank]
    _step(emb, good_ids, _local(world, rank, _grads(world, 0)))
    for n, (label, (make, _)) in enumerate(_bad_calls(world - 1).items()):
        good_grads = _local(world, rank, _grads(world, n + 1))
        stage, ids, grads, lrs = make(rank, good_ids, good_grads)
        before = _tables(emb)
        start = time.monotonic()
        try:
            emb.enqueue([me.RaggedIds.from_lists(f) for f in ids])
            if stage == "apply":
                emb.dequeue()
                emb.apply_gradients(grads, lrs)
            out[f"{label}/error"] = np.array("")
        except MeshembedError as exc:
            out[f"{label}/error"] = np.array(type(exc).__name__)
            out[f"{label}/message"] = np.array(str(exc))
        out[f"{label}/elapsed"] = np.array(time.monotonic() - start)
        after = _tables(emb)
        out[f"{label}/unchanged"] = np.array(all(np.array_equal(before[k], after[k]) for k in before))
        # the good step: from scratch after a refused enqueue, the same batch after a refused update
        if stage == "enqueue":
            _step(emb, good_ids, good_grads)
        else:
            emb.apply_gradients(good_grads)
    for k, v in _tables(emb).items():
        out[f"final/{k}"] = v
    return out


BACKEND_CALLS = ("gather", "gather_combine", "scatter", "update_rows", "update_rows_in_order")


def scenario_backend_refusals(rank: int, world: int, tmp: pathlib.Path) -> dict[str, np.ndarray]:
    """The backend's own row operations, called directly: one rank passes an id out of range
    (or gradients of the wrong shape); its refusal travels with the first exchange's counts."""
    from meshembed.errors import MeshembedError
    from meshembed.sharding import Placement
    from meshembed_torch import TorchBackend

    b = TorchBackend()
    values = (np.arange(VOCAB)[:, None] * np.ones(DIM)).astype(np.float32)
    table = b.create_table(values, Placement(VOCAB, world, "mod"))
    bad = rank == world - 1
    ids = np.array([VOCAB + 2 if bad else 1, 3])
    rows = np.ones((2, DIM), np.float32)

    from meshembed.math import UpdateRule, get_math

    fn = UpdateRule(get_math("stochastic_gradient_descent"), ())  # p - 0.5 g with values=(0.5,)

    calls = {
        "gather": lambda: b.gather(table, b.asarray(ids)),
        "gather_combine": lambda: b.gather_combine(table, b.asarray(ids), b.asarray(np.array([0, 1])), 2),
        "scatter": lambda: b.scatter(table, b.asarray(ids), b.asarray(rows)),
        "update_rows": lambda: b.update_rows([table], b.asarray(np.array([1, 3])),
                                             b.asarray(rows[:1] if bad else rows), fn, values=(0.5,)),
        "update_rows_in_order": lambda: b.update_rows_in_order([table], ids, b.asarray(rows), fn, values=(0.5,)),
    }
    out = {}
    for what in BACKEND_CALLS:
        start = time.monotonic()
        try:
            calls[what]()
            out[f"backend/{what}/error"] = np.array("")
        except MeshembedError as exc:
            out[f"backend/{what}/error"] = np.array(type(exc).__name__)
            out[f"backend/{what}/message"] = np.array(str(exc))
        out[f"backend/{what}/elapsed"] = np.array(time.monotonic() - start)
    out["backend/table"] = b.unshard(table)  # nothing moved; the ranks are still in step
    return out


def scenario_all(rank: int, world: int, tmp: pathlib.Path) -> dict[str, np.ndarray]:
    """Every scenario in one launch (process start-up is most of a launch's time)."""
    return {**scenario_in_step(rank, world, tmp), **scenario_bad_input(rank, world, tmp),
            **scenario_backend_refusals(rank, world, tmp)}


# -- the tests --------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def ranks(request, tmp_path_factory):
    """``(world, results by rank)`` of one launch of :func:`scenario_all`."""
    world = request.param
    start = time.monotonic()
    results, codes = _launch(f"{HERE}:scenario_all", world, tmp_path_factory.mktemp(f"ranks{world}"), deadline_s=120.0)
    assert codes == [0] * world
    assert time.monotonic() - start < 120.0
    return world, results


def _numpy_run(world: int, optimizer, steps: list[tuple[list, list[np.ndarray]]]) -> dict[str, np.ndarray]:
    """The NumPy engine in one process on the concatenated (global) batches."""
    import meshembed as me

    emb = me.TPUEmbedding(_config(SAMPLES * world, optimizer), backend="numpy", num_shards=world)
    for per_rank, grads in steps:
        ids = [sum((per_rank[r][f] for r in range(world)), []) for f in range(3)]
        _step(emb, ids, grads)
    return _tables(emb)


@pytest.mark.slow  # multi-process
def test_ranks_with_uneven_ids_stay_in_step_and_equal_numpy(ranks):
    world, results = ranks
    for case in CASES:
        per_rank = _case_ids(case, world)
        for name, opt in _optimizers().items():
            want = _numpy_run(world, opt, [(per_rank, _grads(world, s)) for s in range(2)])
            for k, v in want.items():
                for r in range(world):
                    np.testing.assert_allclose(results[r][f"{case}/{name}/{k}"], v, rtol=2e-6, atol=2e-6,
                                               err_msg=f"{case} {name} {k} rank {r}")


def test_rounds_case_really_differs_per_rank_and_across_ranks():
    """The accumulation-off case is not vacuous: ranks need different round counts, and the
    same id occurs on several ranks (summing across ranks would give other numbers)."""
    from meshembed.embedding.updates import occurrence_rounds

    per_rank = _case_ids("rounds_differ", 4)
    counts = [int(occurrence_rounds(np.array(sum(r[0], []))).max()) + 1 for r in per_rank]
    assert len(set(counts)) == 4, counts
    import meshembed as me

    opt = _optimizers()["adagrad_noacc"]
    summed = me.TPUEmbedding(_config(SAMPLES * 4, me.embedding.Adagrad(learning_rate=0.1,
                                                                    initial_accumulator_value=0.1)),
                             backend="numpy")
    ordered = me.TPUEmbedding(_config(SAMPLES * 4, opt), backend="numpy")
    ids = [sum((per_rank[r][f] for r in range(4)), []) for f in range(3)]
    for emb in (summed, ordered):
        _step(emb, ids, _grads(4, 0))
    assert not np.allclose(summed.retrieve_parameters("t")["parameters"][5],
                           ordered.retrieve_parameters("t")["parameters"][5], rtol=1e-4)


@pytest.mark.slow  # multi-process
def test_one_rank_bad_input_fails_every_rank_at_once_and_nothing_moves(ranks):
    world, results = ranks
    bad = world - 1
    calls = _bad_calls(bad)
    for label, (_, kind) in calls.items():
        for r in range(world):
            res = results[r]
            assert str(res[f"{label}/error"]) == kind, (label, r, res[f"{label}/error"])
            msg = str(res[f"{label}/message"])
            if r == bad:  # its own error, saying what is wrong
                assert "Invalid" in msg and "failed on rank" not in msg, (label, msg)
            else:
                assert f"failed on rank {bad} of {world} ({kind})" in msg, (label, msg)
            assert float(res[f"{label}/elapsed"]) < PG_TIMEOUT_S / 2, (label, r, res[f"{label}/elapsed"])
            assert bool(res[f"{label}/unchanged"]), (label, r)
    # every rank ends with the tables of a run that only ever saw the good steps
    per_rank = _case_ids("one_rank_empty", world)
    want = _numpy_run(world, _optimizers()["adagrad"], [(per_rank, _grads(world, s)) for s in range(len(calls) + 1)])
    for k, v in want.items():
        for r in range(world):
            np.testing.assert_allclose(results[r][f"final/{k}"], v, rtol=2e-6, atol=2e-6, err_msg=f"{k} rank {r}")


# -- the agreement itself, in one process (a backend whose peers are simulated) -------------------
class _Peers:
    """Stands in for ``Backend.agree``: records each call's status, answers with this
    process's status at ``rank`` among the simulated peers' ``statuses``."""

    def __init__(self, statuses=(0, 0), rank=0, fail=False):
        self.statuses, self.rank, self.fail, self.calls = list(statuses), rank, fail, []

    def __call__(self, status=0):
        self.calls.append(status)
        if self.fail:
            raise RuntimeError("peer died (simulated)")
        # a valid peer passes what a valid call passes here (0, or the same -(1 + fingerprint))
        out = [min(status, 0) if s == 0 else s for s in self.statuses]
        out[self.rank] = status
        return tuple(out)


def _numpy_engine():
    import meshembed as me

    return me.TPUEmbedding(_config(SAMPLES, _optimizers()["adagrad"]), backend="numpy", num_shards=2)


def _feats(ids=None):
    import meshembed as me

    return [me.RaggedIds.from_lists(f) for f in (ids or _case_ids("one_rank_empty", 2)[0])]


def test_single_process_backends_agree_without_communication():
    import meshembed as me

    for name in ("numpy", "torch"):
        b = me.get_backend(name)
        assert b.processes == 1 and b.agree(0) == (0,) and b.agree(3) == (3,)


def test_every_valid_call_agrees_exactly_once(monkeypatch):
    emb = _numpy_engine()
    peers = _Peers()
    monkeypatch.setattr(emb.backend, "agree", peers)
    emb.enqueue(_feats())  # enqueue -> _enqueue_batches: nested, still one agreement
    emb.dequeue()
    emb.apply_gradients(_local(2, 0, _grads(2, 0)))
    assert len(peers.calls) == 2 and all(c <= 0 for c in peers.calls)  # valid: 0 or a fingerprint


def test_a_peer_failure_refuses_the_call_here_with_its_type_and_nothing_changes(monkeypatch):
    from meshembed.embedding.agreement import status_of
    from meshembed.errors import CapacityError, InputError, StateError

    emb = _numpy_engine()
    before = _tables(emb)
    monkeypatch.setattr(emb.backend, "agree", _Peers(statuses=(0, status_of(InputError()))))
    with pytest.raises(InputError, match=r"`enqueue` failed on rank 1 of 2 \(InputError\)"):
        emb.enqueue(_feats())
    assert emb.pending is None
    monkeypatch.setattr(emb.backend, "agree", _Peers())
    emb.enqueue(_feats())
    emb.dequeue()
    pending = emb.pending
    monkeypatch.setattr(emb.backend, "agree", _Peers(statuses=(0, 0, status_of(CapacityError()), status_of(StateError())), rank=1))
    with pytest.raises(CapacityError, match=r"failed on rank 2, 3 of 4 \(CapacityError\).*Fix: correct the input on rank 2"):
        emb.apply_gradients(_local(2, 0, _grads(2, 0)))
    assert emb.pending is pending and emb.step == 0
    after = _tables(emb)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    monkeypatch.setattr(emb.backend, "agree", _Peers(statuses=(0, status_of(StateError()))))
    with pytest.raises(StateError, match="failed on rank 1 of 2"):
        emb.apply_gradients(_local(2, 0, _grads(2, 0)))
    monkeypatch.setattr(emb.backend, "agree", _Peers())
    emb.apply_gradients(_local(2, 0, _grads(2, 0)))  # the same batch, now agreed
    fresh = _numpy_engine()
    fresh.enqueue(_feats())
    fresh.dequeue()
    fresh.apply_gradients(_local(2, 0, _grads(2, 0)))
    assert all(np.array_equal(v, _tables(fresh)[k]) for k, v in _tables(emb).items())


def test_a_local_failure_is_announced_once_and_raised_as_is(monkeypatch):
    from meshembed.embedding.agreement import KINDS, status_of
    from meshembed.errors import InputError

    emb = _numpy_engine()
    peers = _Peers()
    monkeypatch.setattr(emb.backend, "agree", peers)
    with pytest.raises(InputError, match="Invalid") as info:
        emb.enqueue(_feats([[[VOCAB]] + [[1]] * 3, [[1]] * 4, [[1]] * 4]))
    assert "failed on rank" not in str(info.value)
    assert peers.calls == [status_of(info.value)] and KINDS[peers.calls[0] - 1] is InputError
    emb.enqueue(_feats())
    emb.dequeue()
    bad = _local(2, 0, _grads(2, 0))
    bad[2][0, 0] = np.inf
    with pytest.raises(InputError, match="NaN or Inf"):
        emb.apply_gradients(bad)
    assert peers.calls[-1] == status_of(InputError()) and len(peers.calls) == 3
    # a peer that died while this process failed: the local error is the one reported
    monkeypatch.setattr(emb.backend, "agree", _Peers(fail=True))
    with pytest.raises(InputError, match="NaN or Inf"):
        emb.apply_gradients(bad)


def test_status_codes_name_the_most_specific_error_type():
    from meshembed.embedding.agreement import KINDS, peer_error, status_of
    from meshembed.errors import CapacityError, ConfigError, MeshembedError

    assert KINDS[status_of(CapacityError("x")) - 1] is CapacityError
    assert KINDS[status_of(ConfigError("x")) - 1] is ConfigError
    assert KINDS[status_of(ValueError("x")) - 1] is MeshembedError  # not ours: the base class
    err = peer_error("apply_gradients", (0, status_of(ConfigError("x"))))
    assert type(err) is ConfigError and "rank 1 of 2" in str(err)


@pytest.mark.slow  # multi-process
def test_a_backend_call_refused_on_one_rank_fails_on_every_rank_at_once(ranks):
    world, results = ranks
    bad = world - 1
    for what in BACKEND_CALLS:
        for r in range(world):
            res = results[r]
            assert str(res[f"backend/{what}/error"]) == "InputError", (what, r, res[f"backend/{what}/error"])
            msg = str(res[f"backend/{what}/message"])
            if r == bad:
                assert "Invalid" in msg and "failed on rank" not in msg, (what, msg)
            else:
                assert f"`{what}` failed on rank {bad} of {world} (InputError)" in msg, (what, msg)
            assert float(res[f"backend/{what}/elapsed"]) < PG_TIMEOUT_S / 2, (what, r)
    want = (np.arange(VOCAB)[:, None] * np.ones(DIM)).astype(np.float32)
    for r in range(world):
        np.testing.assert_array_equal(results[r]["backend/table"], want)


def test_raw_op_enqueue_and_send_agree_too(monkeypatch):
    """The me.ops enqueue/send ops validate before reaching the engine: their errors are
    agreed as well, so one process's wrong count never leaves its peers waiting."""
    import meshembed as me
    from meshembed.embedding.agreement import status_of
    from meshembed.errors import InputError

    emb = me.ops.configure_tpu_embedding(_config(SAMPLES, _optimizers()["sgd"]), backend="numpy")
    try:
        peers = _Peers()
        monkeypatch.setattr(emb.backend, "agree", peers)
        ids = [np.arange(SAMPLES) % 11] * 3
        with pytest.raises(InputError, match="embedding_indices"):
            me.ops.enqueue_tpu_embedding_arbitrary_tensor_batch([[]] * 3, ids[:2], [])
        assert peers.calls == [status_of(InputError())] and emb.pending is None
        monkeypatch.setattr(emb.backend, "agree", _Peers(statuses=(0, status_of(InputError()))))
        with pytest.raises(InputError, match=r"`enqueue` failed on rank 1 of 2"):
            me.ops.enqueue_tpu_embedding_arbitrary_tensor_batch([[]] * 3, ids, [])
        assert emb.pending is None
        monkeypatch.setattr(emb.backend, "agree", peers)
        me.ops.enqueue_tpu_embedding_arbitrary_tensor_batch([[]] * 3, ids, [])
        acts = me.ops.recv_tpu_embedding_activations(3)
        before = _tables(emb)
        with pytest.raises(InputError, match="inputs"):
            me.ops.send_tpu_embedding_gradients(acts[:2])
        assert peers.calls[-1] == status_of(InputError())
        assert all(np.array_equal(v, _tables(emb)[k]) for k, v in before.items())
    finally:
        me.ops.shutdown_tpu_embedding()
