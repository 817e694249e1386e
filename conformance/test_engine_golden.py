"""End-to-end engine numbers against TensorFlow's CPU reference (golden/embedding/).

The golden run (``golden/generate_embedding.py``): TF's serving lookup with mean / sqrtn /
sum combiners, two features sharing a table, weighted multi-hot ids, an empty sample,
repeated ids and a truncated sequence feature; loss ``Σ 0.5·(act − target)²``; tf_keras
*legacy* optimizers (duplicates summed, only touched rows updated = TPU semantics).

* SGD, Adagrad (ε = 1e-7, negligible), FTRL, Adadelta: activations, tables and slots after
  every step match TF within the float32 framework tolerance.
* TF's empty-sample artifact (row 0 "touched" with a zero gradient) is masked for the
  optimizers whose state moves on a zero gradient, as the golden README prescribes.
* Adagrad with a large ε and Adam are compared with the TPU formula (no ε for Adagrad; lazy,
  no bias correction for Adam) from ``conformance.reference``; the reference itself is
  first checked against TF where the two agree (step-0 activations and gradients).
"""

from __future__ import annotations

import numpy as np
import pytest

import meshembed as me
from conformance.tolerances import assert_close
from conformance import reference

CASE = "emb_cfg_a"
B = 8
TABLES = [("t_user", 64, 8, "mean"), ("t_item", 1000, 4, "sqrtn"), ("t_ctx", 32, 4, "sum")]
FEATURES = [("f_user", "t_user", 3, 0), ("f_user_friends", "t_user", 5, 0), ("f_item", "t_item", 4, 0),
            ("f_ctx", "t_ctx", 3, 0), ("f_ctx_seq", "t_ctx", 6, 4)]
STEPS = 3
SLOT_NAMES = {"accumulator": "accumulators", "linear": "linears", "accum_grad": "accumulators",
              "accum_delta": "updates", "m": "momenta", "v": "velocities"}


def optimizer(name: str):
    emb = me.embedding
    return {
        "sgd": lambda: emb.SGD(0.1),
        "adagrad": lambda: emb.Adagrad(0.1, initial_accumulator_value=0.1),
        "adagrad_bigeps": lambda: emb.Adagrad(0.1, initial_accumulator_value=0.1),
        "adam": lambda: emb.Adam(0.01, beta_1=0.9, beta_2=0.999, epsilon=1e-7),
        "ftrl": lambda: emb.FTRL(0.1, learning_rate_power=-0.5, l1_regularization_strength=0.001,
                                 l2_regularization_strength=0.001, beta=0.0, initial_accumulator_value=0.1),
        "adadelta": lambda: emb.Adadelta(learning_rate=1.0, rho=0.95, epsilon=1e-6),
    }[name]()


def golden_config(opt, strategy: str = "div") -> "me.EmbeddingConfig":
    tables = [me.TableConfig(name=n, vocabulary_size=v, dimension=d, combiner=c, optimizer=opt)
              for n, v, d, c in TABLES]
    features = [me.FeatureConfig(t, (B, m) if m else (B,), name=n) for n, t, _, m in FEATURES]
    return me.EmbeddingConfig(tables=tables, features=features, sharding_strategy=strategy)


def load_case(golden, name: str | None = None):
    folder = golden / "embedding" / CASE
    with np.load(folder / "inputs.npz") as npz:
        inputs = {k: npz[k] for k in npz.files}
    if name is None:
        return inputs, None
    with np.load(folder / f"{name}__tf_keras_legacy.npz") as npz:
        return inputs, {k: npz[k] for k in npz.files}


def step_inputs(inputs, s):
    """(features as SparseIds, weights as SparseIds) of step ``s``, config order."""
    feats, weights = [], []
    for n, _, k, _ in FEATURES:
        p = f"s{s}__{n}__"
        idx = np.stack([inputs[p + "sample"], inputs[p + "position"]], axis=1)
        feats.append(me.SparseIds(idx, inputs[p + "id"], [B, k]))
        weights.append(me.SparseIds(idx, inputs[p + "weight"], [B, k]))
    return feats, weights


def initializers(inputs):
    return {n: inputs[f"table_init__{n}"] for n, *_ in TABLES}


def make_engine(backend, name, num_shards=1, strategy="div", golden_dir=None, inputs=None):
    return me.TPUEmbedding(golden_config(optimizer(name), strategy), backend=backend, num_shards=num_shards,
                           initializers=initializers(inputs))


def train(emb, inputs, steps=STEPS, gold=None):
    """Run the golden loop; yields (step, activations as NumPy) after each apply.

    With ``gold``, TF's own ``d loss/d act`` is sent, so TF's row-0 artifact (which moves
    row 0 and, through shared slots, the gradient of its neighbours) cannot leak into
    other rows; otherwise the engine's ``act − target``."""
    for s in range(steps):
        feats, weights = step_inputs(inputs, s)
        emb.enqueue(feats, weights)
        acts = [emb.backend.to_numpy(a) for a in emb.dequeue()]
        if gold is not None:
            grads = [gold[f"s{s}__dact__{n}"] for n, *_ in FEATURES]
        else:
            grads = [a - inputs[f"s{s}__{n}__target"] for a, (n, *_) in zip(acts, FEATURES)]
        emb.apply_gradients(grads)
        yield s, acts


def artifact_rows(inputs):
    """{table: first step at which TF's empty-sample row-0 artifact moves row 0}."""
    out = {}
    for s in range(STEPS):
        for n, t, _, m in FEATURES:
            if m or t in out:
                continue
            samples = set(inputs[f"s{s}__{n}__sample"].tolist())
            looked_up = any(0 in inputs[f"s{s}__{g}__id"].tolist() for g, tt, *_ in FEATURES if tt == t)
            if len(samples) < B and not looked_up:
                out[t] = s
    return out


def act_mask(inputs, s, feature_index, moved):
    """Rows of a feature's activation that read a row 0 moved by the artifact."""
    n, t, _, m = FEATURES[feature_index]
    shape = (B, m) if m else (B,)
    mask = np.ones(shape, dtype=bool)
    if t in moved and moved[t] < s:
        p = f"s{s}__{n}__"
        hit = inputs[p + "id"] == 0
        for b, pos in zip(inputs[p + "sample"][hit], inputs[p + "position"][hit]):
            if m:
                if pos < m:
                    mask[b, pos] = False
            else:
                mask[b] = False
    return mask


TF_MATCHES = ["sgd", "adagrad", "ftrl", "adadelta"]


@pytest.mark.parametrize("name", TF_MATCHES)
@pytest.mark.parametrize("num_shards,strategy", [(1, "div"), (3, "mod")])
def test_matches_tensorflow(backend, golden, name, num_shards, strategy):
    inputs, gold = load_case(golden, name)
    emb = make_engine(backend, name, num_shards, strategy, inputs=inputs)
    state_moves_on_zero_grad = name in ("ftrl", "adadelta")
    moved = artifact_rows(inputs) if state_moves_on_zero_grad else {}
    for s, acts in train(emb, inputs, gold=gold if state_moves_on_zero_grad else None):
        for k, (a, (n, *_)) in enumerate(zip(acts, FEATURES)):
            keep = act_mask(inputs, s, k, moved)
            assert_close(a[keep], gold[f"s{s}__act__{n}"][keep], against="golden", what=f"step {s} act {n}")
        for t, v, *_ in TABLES:
            rows = np.ones(v, dtype=bool)
            if t in moved and moved[t] <= s:
                rows[0] = False
            got = emb.retrieve_parameters(t)
            assert_close(got["parameters"][rows], gold[f"s{s}__table_after__{t}"][rows], against="golden",
                         what=f"step {s} table {t}")
            for key in gold:
                prefix = f"s{s}__slot_after__{t}__"
                if key.startswith(prefix):
                    slot = SLOT_NAMES[key[len(prefix):]]
                    assert_close(got[slot][rows], gold[key][rows], against="golden", what=f"step {s} {t}/{slot}")


def _reference_run(inputs, update, hp, slot_init, steps=STEPS):
    """The dense NumPy transcription, step by step: yields (acts, tables, slots)."""
    tables = {t: inputs[f"table_init__{t}"].astype(np.float64) for t, *_ in TABLES}
    slots = {t: tuple(np.full(tables[t].shape, x) for x in slot_init) for t, *_ in TABLES}
    dims = {t: (v, d, c) for t, v, d, c in TABLES}
    for s in range(steps):
        acts, grads, looked = [], {t: 0.0 for t in tables}, {t: [] for t in tables}
        for n, t, _, m in FEATURES:
            v, d, c = dims[t]
            p = f"s{s}__{n}__"
            sample, pos, ids, w = (inputs[p + k] for k in ("sample", "position", "id", "weight"))
            if m:
                keep = pos < m
                slots_ = sample[keep] * m + pos[keep]
                a = reference.combination_matrix(slots_, ids[keep], w[keep], B * m, v, c)
                looked[t].append(ids[keep])
            else:
                a = reference.combination_matrix(sample, ids, w, B, v, c)
                looked[t].append(ids)
            act = a @ tables[t]
            acts.append(act.reshape(((B, m) if m else (B,)) + (d,)))
            grads[t] = grads[t] + a.T @ (act - inputs[p + "target"].reshape(act.shape))
        for t, v, *_ in TABLES:
            mask = reference.touched(looked[t], v)
            tables[t], slots[t] = reference.lazy_step(update, tables[t], slots[t], grads[t], mask, **hp)
        yield acts, dict(tables), dict(slots)


def test_reference_matches_tensorflow(golden):
    """The independent transcription reproduces TF's SGD run, so it can judge Adam."""
    inputs, gold = load_case(golden, "sgd")
    for s, (acts, tables, _) in enumerate(_reference_run(inputs, reference.sgd, {"lr": 0.1}, ())):
        for a, (n, *_) in zip(acts, FEATURES):
            assert_close(a, gold[f"s{s}__act__{n}"], against="golden", what=n)
        for t, *_ in TABLES:
            assert_close(tables[t], gold[f"s{s}__table_after__{t}"], against="golden", what=t)


@pytest.mark.parametrize("name", ["adam", "adagrad_bigeps"])
def test_tpu_formula_where_keras_differs(backend, golden, name):
    """TPU Adam (lazy, no bias correction, m/sqrt(v+ε²)) and TPU Adagrad (no ε): the engine
    follows the spec formula; step-0 activations still match TF."""
    inputs, gold = load_case(golden, name)
    if name == "adam":
        update, hp, init = reference.adam, {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7}, (0.0, 0.0)
    else:
        update, hp, init = reference.adagrad, {"lr": 0.1}, (0.1,)
    emb = make_engine(backend, name, 2, "mod", inputs=inputs)
    ref = _reference_run(inputs, update, hp, init)
    for (s, acts), (ref_acts, ref_tables, ref_slots) in zip(train(emb, inputs), ref):
        for a, r, (n, *_) in zip(acts, ref_acts, FEATURES):
            assert_close(a, r, against="reference", rtol=1e-5, what=f"step {s} act {n}")
            if s == 0:
                assert_close(a, gold[f"s0__act__{n}"], against="golden", what=n)
        for t, *_ in TABLES:
            got = emb.retrieve_parameters(t)
            assert_close(got["parameters"], ref_tables[t], against="reference", rtol=1e-5, what=t)
            for slot, value in zip(emb.table_slot_names(t), ref_slots[t]):
                assert_close(got[slot], value, against="reference", rtol=1e-5, what=f"{t}/{slot}")
    # Keras' flavour really is different (bias correction / ε), so this test means something.
    last = emb.retrieve_parameters("t_user")["parameters"]
    assert not np.allclose(last, gold[f"s{STEPS - 1}__table_after__t_user"], rtol=1e-5, atol=1e-6)


def test_gradients_match_tensorflow(backend, golden):
    """Summed per-row table gradients of step 0 equal TF's (via SGD with lr 1: Δtable = −g)."""
    inputs, gold = load_case(golden, "sgd")
    emb = me.TPUEmbedding(golden_config(me.embedding.SGD(1.0)), backend=backend,
                          initializers=initializers(inputs))
    next(train(emb, inputs, steps=1))
    for t, *_ in TABLES:
        grad = inputs[f"table_init__{t}"] - emb.retrieve_parameters(t)["parameters"]
        assert_close(grad, gold[f"s0__grad_dense__{t}"], against="golden", rtol=2e-5, what=t)
