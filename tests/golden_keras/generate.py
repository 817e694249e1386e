"""Write the golden Keras configs and trajectories of ``tests/test_keras3_adadelta.py``.

Run with the real libraries (``python tests/golden_keras/generate.py``: Keras 3 on its
TensorFlow backend, and tf_keras). Each case is one JSON file: the library and version, the
optimizer config exactly as ``get_config()`` wrote it, two float32 variables, the gradients
of each step, the variables after every step, and the optimizer's variable store
(``save_own_variables``: Keras 3's ``[iteration, learning_rate, ...]``) after step 3 and at
the end. The tests read these files and need neither library.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
STEPS, MID = 6, 3
ARGS = {"learning_rate": 0.5, "rho": 0.9, "epsilon": 1e-3}

KERAS3_CASES = {
    "defaults": {},
    "plain": ARGS,
    "clipnorm": {**ARGS, "clipnorm": 1.0},
    "global_clipnorm": {**ARGS, "global_clipnorm": 1.5},
    "clipvalue": {**ARGS, "clipvalue": 0.3},
    "ema": {**ARGS, "use_ema": True, "ema_momentum": 0.8},
    "ema_overwrite": {**ARGS, "use_ema": True, "ema_momentum": 0.7, "ema_overwrite_frequency": 2},
    "weight_decay": {**ARGS, "weight_decay": 0.1},
    "loss_scale": {**ARGS, "loss_scale_factor": 4.0},
    "accumulation": {**ARGS, "gradient_accumulation_steps": 2},
    "accumulation_ema": {**ARGS, "gradient_accumulation_steps": 3, "use_ema": True, "ema_momentum": 0.5},
    "everything": {**ARGS, "weight_decay": 0.05, "global_clipnorm": 2.0, "use_ema": True, "ema_momentum": 0.9},
    "schedule": {**ARGS, "learning_rate": "exponential"},
    "sparse": {**ARGS, "sparse": True},
    "sparse_accumulation": {**ARGS, "sparse": True, "gradient_accumulation_steps": 2},
}
TF_KERAS_CASES = {
    "defaults": {},
    "plain": ARGS,
    "clipnorm": {**ARGS, "clipnorm": 1.0},
    "global_clipnorm": {**ARGS, "global_clipnorm": 1.5},
    "clipvalue": {**ARGS, "clipvalue": 0.3},
    "ema": {**ARGS, "use_ema": True, "ema_momentum": 0.8},
    "ema_overwrite": {**ARGS, "use_ema": True, "ema_momentum": 0.7, "ema_overwrite_frequency": 2},
    "weight_decay": {**ARGS, "weight_decay": 0.1},
    "schedule": {**ARGS, "learning_rate": "exponential"},
}


def problem(seed: int = 0, sparse: bool = False) -> tuple[dict, list]:
    """Two variables and STEPS gradients; ``sparse``: w's gradient is rows of some ids, as
    ``(indices, values)`` (an IndexedSlices). No id repeats within a step: Keras 3 on
    TensorFlow squares each slice before duplicates are summed, meshembed sums them first
    (the documented difference in docs/optimizers.md)."""
    rng = np.random.default_rng(seed)
    initial = {"w": rng.normal(size=(3, 2)).astype(np.float32), "b": rng.normal(size=(2,)).astype(np.float32)}
    grads = [[(3.0 * rng.normal(size=(3, 2))).astype(np.float32), (3.0 * rng.normal(size=(2,))).astype(np.float32)]
             for _ in range(STEPS)]
    if sparse:
        ids = [np.array([0]), np.array([2]), np.array([0, 2]), np.array([1]), np.array([2, 0]), np.array([0])]
        grads = [[(i, (3.0 * rng.normal(size=(len(i), 2))).astype(np.float32)), g[1]] for i, g in zip(ids, grads)]
    return initial, grads


def _tf_grad(tf, x):
    if isinstance(x, tuple):
        return tf.IndexedSlices(tf.constant(x[1]), tf.constant(x[0]), tf.constant([3, 2]))
    return tf.constant(x)


def _json_grad(x):
    if isinstance(x, tuple):
        return {"indices": x[0].tolist(), "values": x[1].tolist(), "dense_shape": [3, 2]}
    return x.tolist()


def run(module, cases: dict, tag: str) -> None:
    import tensorflow as tf

    for name, kwargs in cases.items():
        kwargs = dict(kwargs)
        sparse = kwargs.pop("sparse", False)
        if kwargs.get("learning_rate") == "exponential":
            kwargs["learning_rate"] = module.optimizers.schedules.ExponentialDecay(0.5, decay_steps=2, decay_rate=0.7)
        opt = module.optimizers.Adadelta(**kwargs)
        initial, grads = problem(sparse=sparse)
        if tag == "keras3":
            variables = [module.Variable(initial["w"], name="w"), module.Variable(initial["b"], name="b")]
        else:
            variables = [tf.Variable(initial["w"], name="w"), tf.Variable(initial["b"], name="b")]
        trajectory, stores = [], {}
        for step, g in enumerate(grads, start=1):
            opt.apply_gradients(list(zip([_tf_grad(tf, x) for x in g], variables)))
            trajectory.append([np.asarray(v.numpy()).tolist() for v in variables])
            if step in (MID, STEPS):
                stores["mid" if step == MID else "end"] = store_of(opt, tag)
        case = {
            "library": f"{module.__name__} {module.__version__}",
            "config": opt.get_config(),
            "initial": {k: v.tolist() for k, v in initial.items()},
            "grads": [[_json_grad(x) for x in g] for g in grads],
            "trajectory": trajectory,
            "store_mid": stores["mid"],
            "store_end": stores["end"],
            "store_names": [v.name for v in opt.variables],
        }
        (HERE / f"{tag}_{name}.json").write_text(json.dumps(case, indent=1, default=_plain) + "\n")


def store_of(opt, tag: str) -> list:
    if tag == "keras3":
        store: dict = {}
        opt.save_own_variables(store)
        return [np.asarray(store[str(i)]).tolist() for i in range(len(store))]
    return [np.asarray(v.numpy()).tolist() for v in opt.variables]


def _plain(x):
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(type(x))


if __name__ == "__main__":
    import keras
    import tf_keras

    run(keras, KERAS3_CASES, "keras3")
    run(tf_keras, TF_KERAS_CASES, "tf_keras")
