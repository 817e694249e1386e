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


#: Slots of each TF W1 case (the meshembed optimizer it stands beside).
W1_SLOTS = {"sgd": 0, "adagrad": 1, "adadelta": 2, "adam": 2, "ftrl": 2}
_ALIASES = {"stochastic_gradient_descent": "sgd"}


def w1_step(sizes: dict, case: str, lr: float = 0.01):
    """One TF W1 step of ``case`` (a ``tf.function``; returns the activations): gather +
    segment sum, the loss gradient, ``tf.unique`` + ``unsorted_segment_sum``, then the sparse
    apply — ``ResourceScatterSub`` (SGD), ``ResourceSparseApplyAdagradV2``,
    ``ResourceSparseApplyAdadelta``, ``ResourceSparseApplyFtrl``, or for Adam the lazy
    scatter form of TF's sparse Adam (gather m, v; update; ``ResourceScatterUpdate`` ×2 and
    ``ResourceScatterSub``: TF has no fused sparse Adam kernel)."""
    tf = _tf()
    case = _ALIASES.get(case, case)
    if case not in W1_SLOTS:
        raise ValueError(f"Invalid `case`. Expected one of {sorted(W1_SLOTS)}. Received: case={case!r}")
    v, d, b, k = sizes["vocab"], sizes["dim"], sizes["batch"], sizes["ids_per_sample"]
    ids = tf.constant(zipf_ids(b * k, v, sizes["zipf"]))
    segments = tf.constant(np.repeat(np.arange(b), k))
    rng = np.random.default_rng(0)
    table = tf.Variable(rng.standard_normal((v, d), dtype=np.float32) * 0.01)
    init = {"adagrad": (0.1,), "adadelta": (0.0, 0.0), "adam": (0.0, 0.0), "ftrl": (0.1, 0.0)}.get(case, ())
    slots = [tf.Variable(np.full((v, d), x, np.float32)) for x in init]
    target = tf.constant(rng.standard_normal((b, d), dtype=np.float32))
    b1, b2, eps = 0.9, 0.999, 1e-7

    @tf.function
    def step():
        acts = tf.math.segment_sum(tf.gather(table, ids), segments)
        grad_acts = acts - target
        uids, inverse = tf.unique(ids)
        grads = tf.math.unsorted_segment_sum(tf.gather(grad_acts, segments), inverse, tf.shape(uids)[0])
        if case == "sgd":
            tf.raw_ops.ResourceScatterSub(resource=table.handle, indices=uids, updates=lr * grads)
        elif case == "adagrad":
            tf.raw_ops.ResourceSparseApplyAdagradV2(var=table.handle, accum=slots[0].handle, lr=lr, epsilon=0.0,
                                                    grad=grads, indices=uids, update_slots=True)
        elif case == "adadelta":
            tf.raw_ops.ResourceSparseApplyAdadelta(var=table.handle, accum=slots[0].handle,
                                                   accum_update=slots[1].handle, lr=1.0, rho=0.95, epsilon=1e-6,
                                                   grad=grads, indices=uids)
        elif case == "ftrl":
            tf.raw_ops.ResourceSparseApplyFtrl(var=table.handle, accum=slots[0].handle, linear=slots[1].handle,
                                               grad=grads, indices=uids, lr=lr, l1=0.01, l2=0.01, lr_power=-0.5)
        else:  # adam, lazy: only the looked-up rows of m and v move
            m = b1 * tf.gather(slots[0], uids) + (1 - b1) * grads
            vv = b2 * tf.gather(slots[1], uids) + (1 - b2) * tf.square(grads)
            tf.raw_ops.ResourceScatterUpdate(resource=slots[0].handle, indices=uids, updates=m)
            tf.raw_ops.ResourceScatterUpdate(resource=slots[1].handle, indices=uids, updates=vv)
            tf.raw_ops.ResourceScatterSub(resource=table.handle, indices=uids, updates=lr * m / (tf.sqrt(vv) + eps))
        return acts

    return step


def w1(sizes: dict, repeats: int = 7, cases: tuple[str, ...] = ("sgd", "adagrad", "adadelta")) -> list[Row]:
    v, d, b, k = sizes["vocab"], sizes["dim"], sizes["batch"], sizes["ids_per_sample"]
    uniq = len(np.unique(zipf_ids(b * k, v, sizes["zipf"])))
    rows = []
    for case in cases:
        step = w1_step(sizes, case)
        med, lo, hi = timeit(lambda: step().numpy(), repeats=repeats)
        n_slots = W1_SLOTS[case]
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
