"""Regenerate meshembed's embedding golden vectors with TensorFlow / tf_keras on CPU.

    python conformance/golden/generate_embedding.py            # recompute outputs
    python conformance/golden/generate_embedding.py --fresh    # also draw new inputs

Needs the ``tf-interop`` extra (tensorflow-cpu 2.21, tf_keras 2.21). For every optimizer it
runs ``STEPS`` steps of: TF's CPU lookup for TPU-embedding configs
(``tf.tpu.experimental.embedding.serving_embedding_lookup``), loss
``Σ_f 0.5·Σ(act_f − target_f)²``, ``tf.GradientTape``, then the *legacy* tf_keras optimizer
on the IndexedSlices — the flavour that sums duplicate ids and updates only touched rows,
as the TPU does. It writes ``embedding/<config>/<optimizer>__tf_keras_legacy.npz`` (keys as
in ``embedding/manifest.json``) and, with ``--fresh``, ``inputs.npz``.

Known TF artifact (kept, and masked by the tests): ``safe_embedding_lookup_sparse`` gives an
empty sample id 0 with weight 0, so row 0 counts as touched with a zero gradient.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

HERE = pathlib.Path(__file__).parent / "embedding"

CONFIG = {
    "id": "emb_cfg_a",
    "batch_size": 8,
    "steps": 3,
    "seed": 101,
    "tables": [
        {"name": "t_user", "vocab": 64, "dim": 8, "combiner": "mean"},
        {"name": "t_item", "vocab": 1000, "dim": 4, "combiner": "sqrtn"},
        {"name": "t_ctx", "vocab": 32, "dim": 4, "combiner": "sum"},
    ],
    "features": [
        {"name": "f_user", "table": "t_user", "max_ids": 3, "max_seq": 0, "weighted": True},
        {"name": "f_user_friends", "table": "t_user", "max_ids": 5, "max_seq": 0, "weighted": False},
        {"name": "f_item", "table": "t_item", "max_ids": 4, "max_seq": 0, "weighted": True},
        {"name": "f_ctx", "table": "t_ctx", "max_ids": 3, "max_seq": 0, "weighted": True},
        {"name": "f_ctx_seq", "table": "t_ctx", "max_ids": 6, "max_seq": 4, "weighted": False},
    ],
}

OPTIMIZERS = {
    "sgd": ("SGD", {"learning_rate": 0.1}),
    "adagrad": ("Adagrad", {"learning_rate": 0.1, "initial_accumulator_value": 0.1, "epsilon": 1e-7}),
    "adagrad_bigeps": ("Adagrad", {"learning_rate": 0.1, "initial_accumulator_value": 0.1, "epsilon": 0.01}),
    "adam": ("Adam", {"learning_rate": 0.01, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}),
    "ftrl": ("Ftrl", {"learning_rate": 0.1, "learning_rate_power": -0.5, "initial_accumulator_value": 0.1,
                      "l1_regularization_strength": 0.001, "l2_regularization_strength": 0.001,
                      "l2_shrinkage_regularization_strength": 0.0, "beta": 0.0}),
    "adadelta": ("Adadelta", {"learning_rate": 1.0, "rho": 0.95, "epsilon": 1e-6}),
}

# tf_keras legacy slot name -> the golden key suffix.
SLOT_KEYS = {"accumulator": "accumulator", "m": "m", "v": "v", "linear": "linear",
             "accum_grad": "accum_grad", "accum_var": "accum_delta"}


def fresh_inputs(config: dict) -> dict[str, np.ndarray]:
    """Random COO ids (some samples empty, repeated ids), weights, targets and tables."""
    rng = np.random.default_rng(config["seed"])
    tables = {t["name"]: t for t in config["tables"]}
    out: dict[str, np.ndarray] = {}
    for t in config["tables"]:
        std = 1.0 / np.sqrt(t["dim"])
        out[f"table_init__{t['name']}"] = np.clip(rng.normal(0, std, (t["vocab"], t["dim"])), -2 * std, 2 * std).astype(np.float32)
    b = config["batch_size"]
    for s in range(config["steps"]):
        for f in config["features"]:
            t = tables[f["table"]]
            sample, position, ids = [], [], []
            for i in range(b):
                n = int(rng.integers(0, f["max_ids"] + 1)) if i != 2 else 0
                sample += [i] * n
                position += list(range(n))
                ids += rng.integers(0, min(t["vocab"], 64), n).tolist()
            n = len(ids)
            weights = rng.uniform(0.4, 1.9, n) if f["weighted"] else np.ones(n)
            p = f"s{s}__{f['name']}__"
            out[p + "sample"] = np.asarray(sample, np.int64)
            out[p + "position"] = np.asarray(position, np.int64)
            out[p + "id"] = np.asarray(ids, np.int64)
            out[p + "weight"] = weights.astype(np.float32)
            shape = (b, f["max_seq"], t["dim"]) if f["max_seq"] else (b, t["dim"])
            out[p + "target"] = rng.normal(0, 0.5, shape).astype(np.float32)
    return out


def run(config: dict, inputs: dict[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
    import tensorflow as tf
    import tf_keras

    cls, hparams = OPTIMIZERS[name]
    optimizer = getattr(tf_keras.optimizers.legacy, cls)(**hparams)
    emb = tf.tpu.experimental.embedding
    table_cfgs = {t["name"]: emb.TableConfig(t["vocab"], t["dim"], combiner=t["combiner"], name=t["name"])
                  for t in config["tables"]}
    feature_cfgs = [emb.FeatureConfig(table_cfgs[f["table"]], max_sequence_length=f["max_seq"], name=f["name"])
                    for f in config["features"]]
    variables = {t: tf.Variable(inputs[f"table_init__{t}"], name=t) for t in table_cfgs}
    b = config["batch_size"]
    out: dict[str, np.ndarray] = {}
    for s in range(config["steps"]):
        feats, weights = [], []
        for f in config["features"]:
            p = f"s{s}__{f['name']}__"
            idx = np.stack([inputs[p + "sample"], inputs[p + "position"]], axis=1)
            shape = [b, f["max_ids"]]
            feats.append(tf.SparseTensor(idx, inputs[p + "id"], shape))
            weights.append(None if f["max_seq"] else tf.SparseTensor(idx, inputs[p + "weight"], shape))
        with tf.GradientTape() as tape:
            by_config = {table_cfgs[t]: v for t, v in variables.items()}
            acts = emb.serving_embedding_lookup(feats, weights, by_config, feature_cfgs)
            loss = 0.0
            for f, a in zip(config["features"], acts):
                loss += 0.5 * tf.reduce_sum(tf.square(a - inputs[f"s{s}__{f['name']}__target"]))
        names = list(variables)
        grads = tape.gradient(loss, [variables[t] for t in names])
        out[f"s{s}__loss"] = np.float32(loss.numpy())
        for f, a in zip(config["features"], acts):
            out[f"s{s}__act__{f['name']}"] = a.numpy()
            out[f"s{s}__dact__{f['name']}"] = a.numpy() - inputs[f"s{s}__{f['name']}__target"]
        for t, g in zip(names, grads):
            vocab = variables[t].shape[0]
            out[f"s{s}__grad_indices__{t}"] = g.indices.numpy().astype(np.int64)
            out[f"s{s}__grad_values__{t}"] = g.values.numpy()
            out[f"s{s}__grad_dense__{t}"] = tf.math.unsorted_segment_sum(g.values, g.indices, vocab).numpy()
        optimizer.apply_gradients(zip(grads, [variables[t] for t in names]))
        for t in names:
            out[f"s{s}__table_after__{t}"] = variables[t].numpy()
            for slot in optimizer.get_slot_names():
                out[f"s{s}__slot_after__{t}__{SLOT_KEYS[slot]}"] = optimizer.get_slot(variables[t], slot).numpy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=HERE)
    parser.add_argument("--fresh", action="store_true", help="draw new inputs instead of reusing inputs.npz")
    parser.add_argument("--optimizers", nargs="*", default=list(OPTIMIZERS))
    args = parser.parse_args()
    folder = args.out / CONFIG["id"]
    folder.mkdir(parents=True, exist_ok=True)
    if args.fresh or not (folder / "inputs.npz").exists():
        np.savez(folder / "inputs.npz", **fresh_inputs(CONFIG))
    with np.load(folder / "inputs.npz") as npz:
        inputs = {k: npz[k] for k in npz.files}
    for name in args.optimizers:
        np.savez(folder / f"{name}__tf_keras_legacy.npz", **run(CONFIG, inputs, name))
        print(f"wrote {folder / f'{name}__tf_keras_legacy.npz'}")
    manifest = {"config": CONFIG, "optimizers": {k: {"class": v[0], "hparams": v[1]} for k, v in OPTIMIZERS.items()},
                "flavor": "tf_keras_legacy", "generator": "conformance/golden/generate_embedding.py"}
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
