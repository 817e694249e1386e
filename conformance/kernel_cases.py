"""The cases and reference helpers the generated-kernel tests share: the codegen's own tests
(``tests/test_codegen.py``) and the fused-kernel conformance module (``test_fused_kernels.py``),
which runs them through every backend whose ``capabilities.generated_kernels`` is set.

* every element-wise optimizer's rule (``RULES``/``IDS``: the algorithms x {none, gradient
  clipping, weight clipping, weight decay, weight decay x lr} x float32/float64, and the static
  variants that change the generated code), with values for their dynamic parameters;
* ``LIBM_NUMPY``: NumPy with the pow/exp/log the kernels call (the C library's in float64, the
  generated float32 ones), so a reference of a formula that calls them is still exact;
* inputs that reach the edge cases (``mixture``), a distance in ulps (``ulp_distance``);
* the engine training run of the fused-versus-core comparisons (``OPTIMIZERS``, ``train``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from typing import Any

import numpy as np

import meshembed as me
from meshembed.math.registry import OPTIMIZERS as MATH
from meshembed.math.rule import UpdateRule
from meshembed_native import codegen

#: The C library (its float64 pow/exp/log are what the generated float64 kernels call).
LIBM = ctypes.CDLL(ctypes.util.find_library("m"))


def libm(name: str, *args):
    """Element-wise ``name`` as the kernels compute it, NumPy's result dtype (Python numbers
    weak): the generated float32 math for float32, the C library's for float64."""
    dtype = np.result_type(*args)
    if dtype == np.float32:
        return codegen.float32_math(name, *(np.asarray(a, dtype=dtype) for a in args))
    fn = getattr(LIBM, name)
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_double] * len(args)
    arrays = np.broadcast_arrays(*(np.asarray(a, dtype=dtype) for a in args))
    flat = [a.ravel().tolist() for a in arrays]
    return np.array([fn(*v) for v in zip(*flat)], dtype=dtype).reshape(arrays[0].shape)


class LibmNumpy:
    """NumPy, but with the C library's pow, exp and log: what the generated kernels call."""

    def __getattr__(self, name):
        return getattr(np, name)

    def pow(self, x, y):
        return libm("pow", x, y)

    def exp(self, x):
        return libm("exp", x)

    def log(self, x):
        return libm("log", x)


LIBM_NUMPY = LibmNumpy()


#: Static hyper-parameters per algorithm (and the dynamic ones besides lr).
BASE: dict[str, tuple[dict, tuple[str, ...]]] = {
    "stochastic_gradient_descent": ({}, ()),
    "assign": ({}, ()),
    "adagrad": ({}, ()),
    "adagrad_momentum": (dict(momentum=0.9, use_nesterov=False, exponent=2.0, beta2=0.99, epsilon=1e-7), ()),
    "bounded_adagrad": (dict(update_accumulator_first=False, max_var_update=0.05, max_accumulator=5.0), ()),
    "frequency_aware_adagrad": (dict(l1_regularization_strength=0.001, l2_regularization_strength=0.002,
                                     max_lr_multiplier=4.0, probability_exponent=0.5, accumulator_decay=0.95,
                                     initial_accumulator_value=0.1), ("step_counter",)),
    "ftrl": (dict(l1=0.01, l2=0.02, lr_power=-0.5, beta=0.1, multiply_linear_by_lr=False,
                  allow_zero_accumulator=False), ()),
    "adam": (dict(beta1=0.9, beta2=0.999, epsilon=1e-8, use_non_lazy_adam=False, use_sum_inside_sqrt=False), ()),
    "momentum": (dict(momentum=0.9, use_nesterov=False), ()),
    "lion": (dict(beta1=0.9, beta2=0.99, use_non_lazy_lion=False), ()),
    "rms_prop": (dict(rho=0.9, momentum=0.5, epsilon=1e-7), ()),
    "centered_rms_prop": (dict(rho=0.9, momentum=0.5, epsilon=1e-7), ()),
    "adadelta": (dict(rho=0.9, epsilon=1e-6), ()),
    "proximal_adagrad": (dict(l1=0.01, l2=0.02), ()),
    "online_yogi": (dict(l1=0.01, l2=0.02, beta2=0.99), ()),
    "proximal_yogi": (dict(l1=0.01, l2=0.02, beta1=0.9, beta2=0.99, epsilon=1e-3), ()),
    "frequency_estimator": (dict(tau=0.1, max_delta=100.0, outlier_threshold=2.0, weight_exponent=1.0), ()),
}
#: Static variants that change the generated code, and hyper-parameters made dynamic (their
#: Python arithmetic, e.g. 1 - rho, then runs in double inside the kernel).
VARIANTS: list[tuple[str, dict, tuple[str, ...]]] = [
    ("adam", dict(use_sum_inside_sqrt=True), ()),
    ("adam", dict(use_non_lazy_adam=True), ()),
    ("adam", {}, ("beta1", "beta2", "epsilon")),
    ("ftrl", dict(multiply_linear_by_lr=True), ()),
    ("ftrl", dict(lr_power=-0.7), ()),
    ("ftrl", dict(lr_power=-0.7, multiply_linear_by_lr=True), ()),
    ("ftrl", dict(lr_power=0.0), ()),
    ("momentum", dict(use_nesterov=True), ()),
    ("adagrad_momentum", dict(use_nesterov=True), ()),
    ("adagrad_momentum", dict(beta2=1.0), ()),
    ("adagrad_momentum", {}, ("beta2", "momentum")),
    # pow(x, -1/2) as a constant (the square-root path) above; a runtime -1/2 and another exponent:
    ("adagrad_momentum", {}, ("exponent",)),
    ("adagrad_momentum", dict(exponent=2.5), ()),
    ("frequency_aware_adagrad", {}, ("probability_exponent",)),
    ("frequency_aware_adagrad", dict(probability_exponent=0.7), ()),
    ("bounded_adagrad", dict(update_accumulator_first=True), ()),
    ("bounded_adagrad", dict(max_var_update=0.0, max_accumulator=0.0), ()),
    ("lion", dict(use_non_lazy_lion=True), ()),
    ("adadelta", {}, ("rho", "epsilon")),
]
OPTIONS = {
    "none": {},
    "gradient_clip": dict(gradient_clip=(-0.5, 0.5)),
    "weight_clip": dict(weight_clip=(-math.inf, 0.4)),
    "weight_decay": dict(weight_decay=0.01),
    "weight_decay_lr": dict(weight_decay=0.02, multiply_weight_decay_by_lr=True),
}
DYNAMIC_VALUES = {"lr": 0.3, "step_counter": 7.0, "exponent": 2.0, "probability_exponent": 0.5, "beta1": 0.85, "beta2": 0.995, "epsilon": 1e-7, "rho": 0.93,
                  "momentum": 0.8}


def make_rule(algorithm: str, static: dict, dynamic: tuple[str, ...], option: dict, dtype: str) -> UpdateRule:
    math_ = MATH[algorithm]
    given = {**BASE[algorithm][0], **static}
    names = tuple(BASE[algorithm][1]) + tuple(n for n in dynamic if n not in BASE[algorithm][1])
    lazy = not (given.get("use_non_lazy_adam") or given.get("use_non_lazy_lion"))
    return UpdateRule(math=math_, slot_names=math_.slot_names,
                      static=tuple(sorted((k, v) for k, v in given.items() if k not in names)),
                      dynamic=("lr", *names), lazy=lazy, dtype=dtype, **option)


CASES = [(a, {}, (), o, d) for a in BASE for o in OPTIONS for d in ("float32", "float64")]
CASES += [(a, s, dyn, "none", d) for a, s, dyn in VARIANTS for d in ("float32", "float64")]
RULES = [make_rule(a, s, dyn, OPTIONS[o], d) for a, s, dyn, o, d in CASES]
IDS = [f"{a}-{'-'.join(f'{k}={v}' for k, v in s.items()) or ','.join(dyn) or 'base'}-{o}-{d}" for a, s, dyn, o, d in CASES]


def mixture(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, signed: bool = True) -> np.ndarray:
    """Normal values with zeros (both signs), tiny, subnormal and large ones mixed in."""
    x = rng.standard_normal(shape)
    pick = rng.integers(0, 8, size=shape)
    x = np.where(pick == 0, 0.0, x)
    x = np.where(pick == 1, -0.0, x)
    x = np.where(pick == 2, x * 1e-30, x)
    x = np.where(pick == 3, x * 1e-41 if dtype == "float32" else x * 1e-310, x)
    x = np.where(pick == 4, x * 1e4, x)
    x = x.astype(dtype)
    return x if signed else np.abs(x)


def values_for(rule: UpdateRule) -> tuple[float, ...]:
    return tuple(DYNAMIC_VALUES[n] for n in rule.dynamic)


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Ulps between a and b (0 where both are NaN; huge where only one is)."""
    int_t = np.int32 if a.dtype == np.float32 else np.int64
    ia, ib = a.view(int_t).astype(np.int64), b.view(int_t).astype(np.int64)
    ia = np.where(ia < 0, np.iinfo(int_t).min - ia, ia)  # monotone integer order of floats
    ib = np.where(ib < 0, np.iinfo(int_t).min - ib, ib)
    d = np.abs(ia - ib).astype(np.float64)
    both_nan = np.isnan(a) & np.isnan(b)
    one_nan = np.isnan(a) ^ np.isnan(b)
    return np.where(both_nan, 0, np.where(one_nan, np.inf, d))


#: The optimizers of the fused-versus-core training comparison (``train``).
TRAIN_OPTIMIZERS = {
    "stochastic_gradient_descent": lambda: me.embedding.SGD(learning_rate=0.05),
    "adagrad": lambda: me.embedding.Adagrad(learning_rate=0.05),
    "adadelta": lambda: me.embedding.Adadelta(learning_rate=1.0, rho=0.9, epsilon=1e-6),
}


def train(backend: Any, algorithm: str, combiner: str, shards: int, dim: int, strategy: str = "mod",
          steps: int = 3) -> dict:
    """The table and slots after ``steps`` steps of a 1000-row table, 64 samples of 0-8 ids."""
    rng = np.random.default_rng(5)
    vocab, batch = 1000, 64
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", vocab, dim, optimizer=TRAIN_OPTIMIZERS[algorithm](), combiner=combiner)],
        features=[me.FeatureConfig("t", (batch,), name="f")],
        sharding_strategy=strategy,
    )
    emb = me.TPUEmbedding(cfg, backend=backend, num_shards=shards, seed=3)
    for _ in range(steps):
        lengths = rng.integers(0, 9, size=batch)
        ids = (rng.zipf(1.3, size=int(lengths.sum())) - 1) % vocab  # hot ids repeat
        splits = np.concatenate([[0], np.cumsum(lengths)])
        emb.enqueue([me.RaggedIds(splits, ids)])
        emb.dequeue()
        emb.apply_gradients([emb.backend.asarray(rng.standard_normal((batch, dim)).astype(np.float32))])
    return {name: np.asarray(v) for name, v in emb.retrieve_parameters("t").items()}
