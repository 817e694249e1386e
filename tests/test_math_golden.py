"""meshembed.math.adadelta against the framework vectors kept in conformance/golden.

Dense: TF raw ``ResourceApplyAdadelta``, tf_keras (new and legacy), torch and optax
trajectories; the clipvalue case runs through ``apply_update(gradient_clip=...)``.
Sparse: the ``_dedup``/``tf_keras_legacy`` flavour (duplicates summed, one update per
touched row, untouched rows unchanged) = TPU embedding semantics.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import array_api_compat.numpy as xp
from meshembed.math import AdadeltaSlots, adadelta, apply_update

GOLDEN = Path(__file__).resolve().parents[1] / "conformance" / "golden"
#: Per-dtype rtol from the vectors' README; atol = rtol·max|expected| per array.
RTOL = {"float32": 1e-5, "float64": 1e-12}
#: Keras keeps its learning rate in a float32 variable, so float64 Keras runs need this.
RTOL_KERAS_F64 = 2e-11

DENSE = json.loads((GOLDEN / "adadelta_dense" / "cases.json").read_text())["cases"]
SPARSE = json.loads((GOLDEN / "adadelta_sparse" / "cases.json").read_text())["cases"]


def assert_close(actual, expected, rtol: float, what: str) -> None:
    expected = np.asarray(expected)
    atol = rtol * float(np.max(np.abs(expected))) if expected.size else 0.0
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=rtol, atol=atol, err_msg=what)


def _dense_params():
    for case in DENSE:
        for result in case["results"]:
            yield pytest.param(case, result, id=f"{case['id']}-{result['framework']}")


def run_dense(case: dict, framework: str) -> dict[str, np.ndarray]:
    """Trajectory of every variable through meshembed, stacked like the vectors."""
    inputs = np.load(GOLDEN / case["inputs_file"])
    hp = case["hparams"]
    # optax with learning_rate=None moves *along* the Adadelta step: p' = p + d, i.e. lr = -1
    lr = -1.0 if framework == "optax_lr_none" else hp["learning_rate"]
    clip = case["options"].get("clipvalue")
    out: dict[str, list[np.ndarray]] = {}
    for i in range(len(case["shapes"])):
        p = inputs[f"init_var_{i}"]
        slots = AdadeltaSlots(np.zeros_like(p), np.zeros_like(p))
        for g in inputs[f"grads_{i}"]:
            if clip is None:
                p, slots = adadelta(xp, p, g, slots, lr=lr, rho=hp["rho"],
                                    epsilon=hp["epsilon"])
            else:
                p, slots = apply_update(xp, "adadelta", p, g, slots, lr=lr,
                                        hyperparameters={"rho": hp["rho"],
                                                         "epsilon": hp["epsilon"]},
                                        gradient_clip=(-clip, clip))
            assert p.dtype == inputs[f"init_var_{i}"].dtype
            for key, value in ((f"var_{i}", p), (f"accum_grad_{i}", slots.accumulators),
                               (f"accum_delta_{i}", slots.updates)):
                out.setdefault(key, []).append(value)
    return {k: np.stack(v) for k, v in out.items()}


@pytest.mark.parametrize(("case", "result"), list(_dense_params()))
def test_dense_adadelta_matches_frameworks(case: dict, result: dict) -> None:
    expected = np.load(GOLDEN / result["file"])
    actual = run_dense(case, result["framework"])
    rtol = RTOL[case["dtype"]]
    if case["dtype"] == "float64" and "keras" in result["framework"]:
        rtol = RTOL_KERAS_F64
    for key, value in actual.items():
        assert value.dtype == expected[key].dtype
        assert_close(value, expected[key], rtol, f"{case['id']} {result['framework']} {key}")


def run_sparse(case: dict) -> dict[str, np.ndarray]:
    """Sum duplicates, update touched rows once; untouched rows and slots stay put."""
    inputs = np.load(GOLDEN / case["inputs_file"])
    hp = case["hparams"]
    table = inputs["init_var"]
    acc, upd = np.zeros_like(table), np.zeros_like(table)
    out: dict[str, list[np.ndarray]] = {"var": [], "accum_grad": [], "accum_delta": []}
    for s in range(len(case["steps_indices"])):
        ids, values = inputs[f"indices_{s}"], inputs[f"values_{s}"]
        uniq, pos = np.unique(ids, return_inverse=True)
        summed = np.zeros((len(uniq),) + table.shape[1:], table.dtype)
        np.add.at(summed, pos, values)
        rows, slots = adadelta(xp, table[uniq], summed, AdadeltaSlots(acc[uniq], upd[uniq]),
                               lr=hp["learning_rate"], rho=hp["rho"], epsilon=hp["epsilon"])
        table, acc, upd = table.copy(), acc.copy(), upd.copy()
        table[uniq], acc[uniq], upd[uniq] = rows, slots.accumulators, slots.updates
        out["var"].append(table)
        out["accum_grad"].append(acc)
        out["accum_delta"].append(upd)
    return {k: np.stack(v) for k, v in out.items()}


@pytest.mark.parametrize(
    ("case", "result"),
    [pytest.param(c, r, id=f"{c['id']}-{r['framework']}") for c in SPARSE for r in c["results"]],
)
def test_sparse_adadelta_dedup_semantics(case: dict, result: dict) -> None:
    expected = np.load(GOLDEN / result["file"])
    actual = run_sparse(case)
    for key, value in actual.items():
        assert value.dtype == expected[key].dtype
        assert_close(value, expected[key], RTOL[case["dtype"]], f"{case['id']} {key}")


def test_golden_data_is_small_and_complete() -> None:
    """The project carries its own copies; every referenced file exists."""
    files = [GOLDEN / c["inputs_file"] for c in DENSE + SPARSE]
    files += [GOLDEN / r["file"] for c in DENSE + SPARSE for r in c["results"]]
    assert all(f.is_file() for f in files)
    assert sum(f.stat().st_size for f in files) < 200_000
