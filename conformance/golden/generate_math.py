#!/usr/bin/env python
"""Regenerate meshembed's Adadelta golden data from the frameworks themselves.

Reads ``adadelta_dense/cases.json`` and ``adadelta_sparse/cases.json`` next to this file,
takes each case's ``inputs.npz`` (initial variables and per-step gradients) and reruns
every listed framework call, writing ``<framework>.npz`` with the same keys:
``var_i, accum_grad_i, accum_delta_i`` (dense, stacked per step) or
``var, accum_grad, accum_delta`` (sparse). ``x[s]`` is the value after step ``s+1``.

    python conformance/golden/generate_math.py                  # rewrite in place
    python conformance/golden/generate_math.py --out /tmp/g --frameworks torch optax

Needs tensorflow-cpu + tf-keras (the ``tf-interop`` extra), torch and optax for the
respective frameworks; a framework whose library is missing is skipped with a message.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import numpy as np

HERE = Path(__file__).resolve().parent
Arrays = dict[str, np.ndarray]


def _stack(per_step: list[Arrays]) -> Arrays:
    return {k: np.stack([s[k] for s in per_step]) for k in per_step[0]}


# --- dense -------------------------------------------------------------------------------
def dense_tf_raw(case: dict, inputs: Arrays) -> Arrays:
    import tensorflow as tf

    hp, out = case["hparams"], []
    n = len(case["shapes"])
    var = [tf.Variable(inputs[f"init_var_{i}"]) for i in range(n)]
    acc = [tf.Variable(tf.zeros_like(v)) for v in var]
    upd = [tf.Variable(tf.zeros_like(v)) for v in var]
    dtype = var[0].dtype
    for s in range(case["steps"]):
        row: Arrays = {}
        for i in range(n):
            tf.raw_ops.ResourceApplyAdadelta(
                var=var[i].handle, accum=acc[i].handle, accum_update=upd[i].handle,
                lr=tf.constant(hp["learning_rate"], dtype), rho=tf.constant(hp["rho"], dtype),
                epsilon=tf.constant(hp["epsilon"], dtype),
                grad=tf.constant(inputs[f"grads_{i}"][s]), use_locking=False)
            row |= {f"var_{i}": var[i].numpy(), f"accum_grad_{i}": acc[i].numpy(),
                    f"accum_delta_{i}": upd[i].numpy()}
        out.append(row)
    return _stack(out)


def _keras(case: dict, inputs: Arrays, legacy: bool) -> Arrays:
    import tensorflow as tf
    import tf_keras

    hp, options = case["hparams"], dict(case["options"])
    kwargs = dict(learning_rate=hp["learning_rate"], rho=hp["rho"], epsilon=hp["epsilon"],
                  **options)
    if legacy:
        opt = tf_keras.optimizers.legacy.Adadelta(**kwargs)
    else:
        opt = tf_keras.optimizers.Adadelta(jit_compile=False, **kwargs)
    n = len(case["shapes"])
    var = [tf.Variable(inputs[f"init_var_{i}"]) for i in range(n)]
    out = []
    for s in range(case["steps"]):
        opt.apply_gradients([(tf.constant(inputs[f"grads_{i}"][s]), var[i]) for i in range(n)])
        row: Arrays = {}
        for i in range(n):
            if legacy:
                a, u = opt.get_slot(var[i], "accum_grad"), opt.get_slot(var[i], "accum_var")
            else:
                a, u = opt._accumulated_grads[i], opt._accumulated_delta_vars[i]
            row |= {f"var_{i}": var[i].numpy(), f"accum_grad_{i}": a.numpy(),
                    f"accum_delta_{i}": u.numpy()}
        out.append(row)
    result = _stack(out)
    if not legacy:
        result["iterations"] = np.asarray(opt.iterations.numpy(), np.int64)
        result["learning_rate_variable_dtype"] = np.asarray(opt._learning_rate.dtype.name)
    return result


def dense_torch(case: dict, inputs: Arrays) -> Arrays:
    import torch

    hp, clip = case["hparams"], case["options"].get("clipvalue")
    n = len(case["shapes"])
    params = [torch.nn.Parameter(torch.asarray(inputs[f"init_var_{i}"]).clone())
              for i in range(n)]
    opt = torch.optim.Adadelta(params, lr=hp["learning_rate"], rho=hp["rho"],
                               eps=hp["epsilon"], foreach=False)
    out = []
    for s in range(case["steps"]):
        for i, p in enumerate(params):
            p.grad = torch.asarray(inputs[f"grads_{i}"][s]).clone()
        if clip is not None:
            torch.nn.utils.clip_grad_value_(params, clip_value=clip)
        opt.step()
        row: Arrays = {}
        for i, p in enumerate(params):
            st = opt.state[p]
            row |= {f"var_{i}": p.detach().numpy().copy(),
                    f"accum_grad_{i}": st["square_avg"].numpy().copy(),
                    f"accum_delta_{i}": st["acc_delta"].numpy().copy()}
        out.append(row)
    return _stack(out)


def _optax(case: dict, inputs: Arrays, lr_none: bool) -> Arrays:
    import jax
    import optax

    hp, clip = case["hparams"], case["options"].get("clipvalue")
    with jax.enable_x64(case["dtype"] == "float64"):
        tx = optax.adadelta(learning_rate=None if lr_none else hp["learning_rate"],
                            rho=hp["rho"], eps=hp["epsilon"])
        if clip is not None:
            tx = optax.chain(optax.clip(clip), tx)
        n = len(case["shapes"])
        params = [jax.numpy.asarray(inputs[f"init_var_{i}"]) for i in range(n)]
        state = tx.init(params)
        update = jax.jit(tx.update)
        out = []
        for s in range(case["steps"]):
            grads = [jax.numpy.asarray(inputs[f"grads_{i}"][s]) for i in range(n)]
            updates, state = update(grads, state, params)
            params = optax.apply_updates(params, updates)
            ada = next(x for x in jax.tree_util.tree_leaves(
                state, is_leaf=lambda x: hasattr(x, "e_g")) if hasattr(x, "e_g"))
            row: Arrays = {}
            for i in range(n):
                row |= {f"var_{i}": np.asarray(params[i]), f"accum_grad_{i}": np.asarray(ada.e_g[i]),
                        f"accum_delta_{i}": np.asarray(ada.e_x[i])}
            out.append(row)
    return _stack(out)


DENSE: dict[str, Callable[[dict, Arrays], Arrays]] = {
    "tf_raw_ResourceApplyAdadelta": dense_tf_raw,
    "tf_keras_new": lambda c, i: _keras(c, i, legacy=False),
    "tf_keras_legacy": lambda c, i: _keras(c, i, legacy=True),
    "torch": dense_torch,
    "optax": lambda c, i: _optax(c, i, lr_none=False),
    "optax_lr_none": lambda c, i: _optax(c, i, lr_none=True),
}


# --- sparse ------------------------------------------------------------------------------
def sparse_tf_raw_dedup(case: dict, inputs: Arrays) -> Arrays:
    import tensorflow as tf

    hp = case["hparams"]
    var = tf.Variable(inputs["init_var"])
    acc, upd = tf.Variable(tf.zeros_like(var)), tf.Variable(tf.zeros_like(var))
    out = []
    for s in range(len(case["steps_indices"])):
        uniq, pos = tf.unique(tf.constant(inputs[f"indices_{s}"]))
        values = tf.math.unsorted_segment_sum(tf.constant(inputs[f"values_{s}"]), pos,
                                              tf.size(uniq))
        tf.raw_ops.ResourceSparseApplyAdadelta(
            var=var.handle, accum=acc.handle, accum_update=upd.handle,
            lr=tf.constant(hp["learning_rate"], var.dtype), rho=tf.constant(hp["rho"], var.dtype),
            epsilon=tf.constant(hp["epsilon"], var.dtype), grad=values, indices=uniq)
        out.append({"var": var.numpy(), "accum_grad": acc.numpy(), "accum_delta": upd.numpy()})
    return _stack(out)


def sparse_keras_legacy(case: dict, inputs: Arrays) -> Arrays:
    import tensorflow as tf
    import tf_keras

    hp = case["hparams"]
    opt = tf_keras.optimizers.legacy.Adadelta(hp["learning_rate"], hp["rho"], hp["epsilon"])
    var = tf.Variable(inputs["init_var"])
    out = []
    for s in range(len(case["steps_indices"])):
        slices = tf.IndexedSlices(tf.constant(inputs[f"values_{s}"]),
                                  tf.constant(inputs[f"indices_{s}"]),
                                  tf.constant(var.shape, tf.int64))
        opt.apply_gradients([(slices, var)])
        out.append({"var": var.numpy(), "accum_grad": opt.get_slot(var, "accum_grad").numpy(),
                    "accum_delta": opt.get_slot(var, "accum_var").numpy()})
    return _stack(out)


SPARSE: dict[str, Callable[[dict, Arrays], Arrays]] = {
    "tf_raw_ResourceSparseApplyAdadelta_dedup": sparse_tf_raw_dedup,
    "tf_keras_legacy": sparse_keras_legacy,
}


def generate(out_dir: Path, frameworks: set[str] | None = None) -> list[Path]:
    """Write every (case, framework) file under ``out_dir``; returns the files written."""
    written = []
    for kind, runners in (("adadelta_dense", DENSE), ("adadelta_sparse", SPARSE)):
        cases = json.loads((HERE / kind / "cases.json").read_text())["cases"]
        for case in cases:
            inputs = dict(np.load(HERE / case["inputs_file"]))
            for result in case["results"]:
                name = result["framework"]
                if frameworks is not None and name not in frameworks:
                    continue
                try:
                    arrays = runners[name](case, inputs)
                except ImportError as exc:
                    print(f"skip {case['id']}/{name}: {exc}", file=sys.stderr)
                    continue
                path = out_dir / result["file"]
                path.parent.mkdir(parents=True, exist_ok=True)
                np.savez(path, **arrays)
                written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="output root (default: here)")
    parser.add_argument("--frameworks", nargs="*", default=None,
                        help=f"subset of {sorted(set(DENSE) | set(SPARSE))}")
    args = parser.parse_args(argv)
    files = generate(args.out, None if args.frameworks is None else set(args.frameworks))
    print(f"wrote {len(files)} files under {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
