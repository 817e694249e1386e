"""TensorFlow and Keras peers: W1 sparse step with TF's ResourceSparseApply* kernels and
W2 with TF's fused C++ ``ResourceApplyAdadelta`` and tf_keras' Adadelta.

The W1 TF step deduplicates ids first (``tf.unique`` + ``unsorted_segment_sum``), because
TF's sparse kernels apply duplicates one after another, which is not the TPU semantics.
"""

from __future__ import annotations

import numpy as np

from benchmarks.common import Row, timeit, w1_bytes, w2_bytes, zipf_ids


def _tf():
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    return tf


def w1(sizes: dict, repeats: int = 7) -> list[Row]:
    tf = _tf()
    v, d, b, k = sizes["vocab"], sizes["dim"], sizes["batch"], sizes["ids_per_sample"]
    ids_np = zipf_ids(b * k, v, sizes["zipf"])
    ids = tf.constant(ids_np)
    segments = tf.constant(np.repeat(np.arange(b), k))
    rng = np.random.default_rng(0)
    table = tf.Variable(rng.standard_normal((v, d), dtype=np.float32) * 0.01)
    acc = tf.Variable(np.full((v, d), 0.1, np.float32))
    upd = tf.Variable(np.zeros((v, d), np.float32))
    target = tf.constant(rng.standard_normal((b, d), dtype=np.float32))
    rows = []
    for case, n_slots in (("sgd", 0), ("adagrad", 1), ("adadelta", 2)):

        @tf.function
        def step(case=case):
            acts = tf.math.segment_sum(tf.gather(table, ids), segments)
            grad_acts = acts - target
            uids, inverse = tf.unique(ids)
            grads = tf.math.unsorted_segment_sum(tf.gather(grad_acts, segments), inverse, tf.shape(uids)[0])
            if case == "sgd":
                tf.raw_ops.ResourceScatterSub(resource=table.handle, indices=uids, updates=0.01 * grads)
            elif case == "adagrad":
                tf.raw_ops.ResourceSparseApplyAdagradV2(var=table.handle, accum=acc.handle, lr=0.01, epsilon=0.0,
                                                        grad=grads, indices=uids, update_slots=True)
            else:
                tf.raw_ops.ResourceSparseApplyAdadelta(var=table.handle, accum=acc.handle, accum_update=upd.handle,
                                                       lr=1.0, rho=0.95, epsilon=1e-6, grad=grads, indices=uids)
            return acts

        med, lo, hi = timeit(lambda: step().numpy(), repeats=repeats)
        uniq = len(np.unique(ids_np))
        rows.append(Row("W1", "TensorFlow (unique + ResourceSparseApply*)", case, med, lo, hi,
                        w1_bytes(uniq, b * k, d, n_slots), v * d * 4 * (1 + n_slots)))
    return rows


def w2(sizes: dict, repeats: int = 7) -> list[Row]:
    tf = _tf()
    n = sizes["params"]
    rows = []
    for tensors in (1, 64):
        m = n // tensors
        rng = np.random.default_rng(0)
        vars_ = [tf.Variable(rng.standard_normal(m, dtype=np.float32)) for _ in range(tensors)]
        accs = [tf.Variable(tf.zeros(m)) for _ in range(tensors)]
        upds = [tf.Variable(tf.zeros(m)) for _ in range(tensors)]
        grads = [tf.constant(rng.standard_normal(m, dtype=np.float32)) for _ in range(tensors)]

        @tf.function
        def raw_step():
            for v, a, u, g in zip(vars_, accs, upds, grads):
                tf.raw_ops.ResourceApplyAdadelta(var=v.handle, accum=a.handle, accum_update=u.handle,
                                                 lr=1e-3, rho=0.95, epsilon=1e-7, grad=g)
            return tf.constant(0)

        med, lo, hi = timeit(lambda: raw_step().numpy(), repeats=repeats)
        case = f"adadelta {tensors} tensor{'s' if tensors > 1 else ''}"
        rows.append(Row("W2", "TensorFlow ResourceApplyAdadelta (C++)", case, med, lo, hi, w2_bytes(n), 3 * n * 4))
        try:
            import tf_keras
        except ImportError:
            continue
        opt = tf_keras.optimizers.Adadelta(learning_rate=1e-3, rho=0.95, epsilon=1e-7)
        pairs = list(zip(grads, vars_))
        opt.build(vars_)

        @tf.function(jit_compile=True)
        def keras_step():
            opt.apply_gradients(pairs)
            return tf.constant(0)

        med, lo, hi = timeit(lambda: keras_step().numpy(), repeats=repeats)
        rows.append(Row("W2", "tf_keras Adadelta (XLA)", case, med, lo, hi, w2_bytes(n), 3 * n * 4))
    return rows
