"""``TPUEmbedding(pipelined=True)``: the TPU's pipelined schedule (each step's gradients are
applied right after the next step's lookup), checked against the step functions run in that
order, bit for bit, and the same bits on every backend."""

from __future__ import annotations

import numpy as np
import pytest

import meshembed as me
from meshembed.embedding import batch as batches
from meshembed.embedding import step as steps
from meshembed.errors import InputError, StateError

B, V = 8, 40


def config(optimizer=None, lr=0.1):
    optimizer = optimizer or me.embedding.Adagrad(learning_rate=lr)
    return me.EmbeddingConfig(
        tables=[me.TableConfig("t", V, 4, optimizer=optimizer, combiner="mean"),
                me.TableConfig("u", V, 8, optimizer=me.embedding.SGD(learning_rate=0.5), combiner="sum")],
        features=[me.FeatureConfig("t", (B,), name="a"), me.FeatureConfig("t", (B, 3), name="seq"),
                  me.FeatureConfig("u", (B,), name="c")])


def inputs(step):
    rng = np.random.default_rng(step)
    rows = [list(rng.integers(0, V, int(k))) for k in rng.integers(0, 5, B)]
    seq = me.RaggedIds.from_lists([list(rng.integers(0, V, int(k))) for k in rng.integers(0, 4, B)])
    return [rng.integers(0, V, B), seq, me.RaggedIds.from_lists(rows)]


def grads_of(engine, acts):
    """A deterministic gradient of the activations (the 'model'), computed in NumPy."""
    return [np.asarray(engine.backend.to_numpy(a)) * 0.5 - 0.25 for a in acts]


def run(backend, n=5, optimizer=None, **kw):
    emb = me.TPUEmbedding(config(optimizer), backend=backend, num_shards=2, seed=7, pipelined=True, **kw)
    acts_seen = []
    for k in range(n):
        emb.enqueue(inputs(k))
        acts = emb.dequeue()
        acts_seen.append([np.asarray(emb.backend.to_numpy(a)) for a in acts])
        emb.apply_gradients(grads_of(emb, acts))
    return emb, acts_seen


def test_the_schedule_is_lookup_then_the_previous_steps_gradients():
    emb, acts_seen = run("numpy")
    ref = me.TPUEmbedding(config(), backend="numpy", num_shards=2, seed=7)
    state, kept = ref.state, None
    for k in range(5):
        b = batches.prepare(ref.layout, inputs(k))
        acts = steps.lookup(ref.backend, state, b)  # step k looks up ...
        if kept is not None:  # ... then step k-1's gradients are applied
            state = steps.apply_gradients(ref.backend, state, *kept, rules=ref.rules)
        for x, y in zip(acts, acts_seen[k]):
            np.testing.assert_array_equal(np.asarray(x), y)
        kept = (b, grads_of(ref, acts))
    assert emb.step == 4 and state.step == 4  # the last step is kept until the next lookup or a flush
    assert emb.flush() is True and emb.step == 5 and emb.flush() is False
    state = steps.apply_gradients(ref.backend, state, *kept, rules=ref.rules)
    ref.state = state
    for t in ("t", "u"):
        for name, arr in ref.retrieve_parameters(t).items():
            np.testing.assert_array_equal(emb.retrieve_parameters(t)[name], arr, err_msg=f"{t}/{name}")


def test_pipelined_activations_are_one_step_stale():
    plain = me.TPUEmbedding(config(), backend="numpy", num_shards=2, seed=7)
    _, piped = run("numpy", n=2)
    plain.enqueue(inputs(0))
    plain.apply_gradients(grads_of(plain, plain.dequeue()))
    plain.enqueue(inputs(1))
    second = [np.asarray(a) for a in plain.dequeue()]
    # step 0 sees the initial tables either way; step 1 of the pipeline has not seen step 0's update
    assert not all(np.array_equal(x, y) for x, y in zip(second, piped[1]))


@pytest.mark.parametrize("optimizer", [None, me.embedding.SGD(learning_rate=0.3),
                                       me.embedding.Adam(learning_rate=0.01)], ids=["adagrad", "sgd", "adam"])
def test_pipelined_training_is_bit_identical_across_backends(optimizer):
    ref, ref_acts = run("numpy", optimizer=optimizer)
    ref.flush()
    others = [b for b in ("torch", "jax", "array_api_strict") if b in me.available_backends()]
    if not others:
        pytest.skip("neither torch nor jax is installed")
    for backend in others:
        emb, acts = run(backend, optimizer=optimizer)
        for k, (xs, ys) in enumerate(zip(acts, ref_acts)):
            for x, y in zip(xs, ys):
                np.testing.assert_array_equal(x, y, err_msg=f"{backend} step {k}")
        emb.flush()
        for t in ("t", "u"):
            for name, arr in ref.retrieve_parameters(t).items():
                np.testing.assert_array_equal(emb.retrieve_parameters(t)[name], arr, err_msg=f"{backend} {t}/{name}")


def test_gradients_are_checked_when_sent_and_kept_as_private_copies():
    emb = me.TPUEmbedding(config(), backend="numpy", num_shards=2, seed=7, pipelined=True)
    emb.enqueue(inputs(0))
    acts = emb.dequeue()
    with pytest.raises(InputError, match="shape"):
        emb.apply_gradients([np.zeros((3, 4), np.float32)] + grads_of(emb, acts)[1:])
    bad = grads_of(emb, acts)
    bad[0][0, 0] = np.nan
    with pytest.raises(InputError, match="NaN"):
        emb.apply_gradients(bad)
    grads = [g.astype(np.float32) for g in grads_of(emb, acts)]
    emb.apply_gradients(grads)  # accepted: the batch is consumed, its gradients kept
    expected = me.TPUEmbedding(config(), backend="numpy", num_shards=2, seed=7)
    expected.enqueue(inputs(0))
    expected.dequeue()
    expected.apply_gradients([g.copy() for g in grads])
    for g in grads:
        g[...] = 1e6  # the caller reuses its buffers: the kept step must not change
    np.testing.assert_array_equal(emb.embedding_tables["t"], expected.embedding_tables["t"])  # flushes


def test_save_retrieve_and_load_flush_the_kept_step(tmp_path):
    emb, _ = run("numpy", n=2)
    assert emb.step == 1
    path = emb.save(tmp_path / "ckpt")
    assert emb.step == 2
    restored = me.TPUEmbedding.restore(path, backend="numpy", num_shards=2)
    np.testing.assert_array_equal(restored.embedding_tables["t"], emb.embedding_tables["t"])
    emb2, _ = run("numpy", n=2)
    emb2.retrieve_parameters("u")
    assert emb2.step == 2
    emb3, _ = run("numpy", n=2)
    emb3.load_parameters("u", parameters=np.zeros((V, 8), np.float32))
    assert emb3.step == 2  # the kept step went into the old table, then the load replaced it
    np.testing.assert_array_equal(emb3.embedding_tables["u"], 0)


def test_backward_pass_only_steps_apply_in_order():
    emb = me.TPUEmbedding(config(), backend="numpy", num_shards=2, seed=7, pipelined=True)
    ref = me.TPUEmbedding(config(), backend="numpy", num_shards=2, seed=7)
    grads = [np.full(emb.output_shape(f), 0.1 * (k + 1), np.float32) for k, f in enumerate(emb.feature_names)]
    for k in range(3):
        for e in (emb, ref):
            e.enqueue(inputs(k), mode_override="backward_pass_only")
            e.apply_gradients(grads)
    assert emb.step == 2  # each send applies the one before it
    emb.flush()
    for t in ("t", "u"):
        np.testing.assert_array_equal(emb.embedding_tables[t], ref.embedding_tables[t])


def test_learning_rate_callables_are_read_when_the_step_is_sent():
    rates = iter([0.5, 0.25, 0.125])
    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", V, 4, optimizer=me.embedding.SGD(
        learning_rate=lambda: next(rates)))], features=[me.FeatureConfig("t", (B,), name="a")])
    emb = me.TPUEmbedding(cfg, backend="numpy", num_shards=2, seed=1, pipelined=True)
    ref = me.TPUEmbedding(cfg.to_proto(), backend="numpy", num_shards=2, seed=1)
    ids = np.arange(B)
    for k, lr in enumerate((0.5, 0.25, 0.125)):
        emb.enqueue([ids])
        emb.dequeue()
        emb.apply_gradients([np.ones((B, 4), np.float32)])
        ref.enqueue([ids])
        ref.dequeue()
        ref.apply_gradients([np.ones((B, 4), np.float32)], [lr])
    np.testing.assert_array_equal(emb.embedding_tables["t"], ref.embedding_tables["t"])


def test_inference_batches_are_refused_and_the_flag_is_checked():
    emb = me.TPUEmbedding(config(), backend="numpy", num_shards=2, seed=7, pipelined=True)
    emb.enqueue(inputs(0), training=False)
    acts = emb.dequeue()
    with pytest.raises(StateError, match="inference"):
        emb.apply_gradients(grads_of(emb, acts))
    assert emb.pipelined is True
    with pytest.raises(me.ConfigError, match="pipelined"):
        me.TPUEmbedding(config(), backend="numpy", pipelined="yes")


def test_me_tpu_pipeline_execution_with_tensor_core_runs_the_pipelined_schedule():
    """TF's flag: me.tpu's engine is then one step stale, as the core engine with pipelined=True."""
    E = me.tpu
    table = E.TableConfig(vocabulary_size=V, dim=4, name="t")
    outs = {}
    for flag in (False, True):
        emb = E.TPUEmbedding({"a": E.FeatureConfig(table)}, optimizer=E.SGD(learning_rate=0.5),
                             pipeline_execution_with_tensor_core=flag)
        acts = []
        for k in range(3):
            emb.enqueue({"a": np.arange(B) % 3})
            a = emb.dequeue()["a"]
            acts.append(np.asarray(a).copy())
            emb.apply_gradients({"a": np.ones_like(a)})
        outs[flag] = acts
    np.testing.assert_array_equal(outs[True][1], outs[False][0])  # step 2 still sees step 0's tables
    np.testing.assert_array_equal(outs[True][2], outs[False][1])


def test_me_torch_module_pipelined_equals_the_pipelined_engine():
    torch = pytest.importorskip("torch")
    emb = me.TPUEmbedding(config(), backend="torch", seed=7, pipelined=True)
    ec = me.torch.EmbeddingCollection(config(), seed=7, pipelined=True)
    for s in range(4):
        x = inputs(s)
        emb.enqueue(x)
        want = emb.dequeue()
        emb.apply_gradients(grads_of(emb, want))
        got = ec(dict(zip(["a", "seq", "c"], x)))
        for k, name in enumerate(["a", "seq", "c"]):
            np.testing.assert_array_equal(got[name].detach().numpy(), emb.backend.to_numpy(want[k]), err_msg=name)
        torch.autograd.backward([got[n] for n in ("a", "seq", "c")],
                                [torch.as_tensor(g) for g in grads_of(emb, [got[n].detach() for n in ("a", "seq", "c")])])
    assert ec.engine.flush() and emb.flush()
    for t in ("t", "u"):
        for name, arr in emb.retrieve_parameters(t).items():
            np.testing.assert_array_equal(ec.engine.retrieve_parameters(t)[name], arr, err_msg=f"{t}/{name}")


def test_me_jax_pipelined_is_an_order_of_the_pure_functions():
    """me.jax has no flag: the pipelined schedule is the order a jitted step calls the pure
    functions in (look up batch t+1 on the state before batch t's update, then update) —
    the same bits as the pipelined engine (README, me.jax)."""
    pytest.importorskip("jax")
    emb = me.TPUEmbedding(config(), backend="jax", seed=7, pipelined=True)
    state = me.jax.from_engine(me.TPUEmbedding(config(), backend="jax", seed=7))
    previous = None
    for s in range(4):
        emb.enqueue(inputs(s))
        want = emb.dequeue()
        emb.apply_gradients(grads_of(emb, want))
        batch = me.jax.prepare(config(), inputs(s))
        acts = me.jax.lookup(state, batch)  # on the tables before the previous step's update
        if previous is not None:
            state = me.jax.apply_gradients(state, *previous)
        previous = (batch, grads_of(emb, [acts[n] for n in ("a", "seq", "c")]))
        for k, name in enumerate(["a", "seq", "c"]):
            np.testing.assert_array_equal(np.asarray(acts[name]), emb.backend.to_numpy(want[k]), err_msg=name)
    state = me.jax.apply_gradients(state, *previous)
    emb.flush()
    for t in ("t", "u"):
        for name, arr in emb.retrieve_parameters(t).items():
            np.testing.assert_array_equal(state.parameters(t)[name], arr, err_msg=f"{t}/{name}")
