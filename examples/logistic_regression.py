"""Train a logistic regression with ``me.optimizers.Adadelta.minimize`` on torch or JAX.

    python examples/logistic_regression.py --backend torch
    python examples/logistic_regression.py --backend jax --steps 300

The loss is a Keras-style zero-argument callable that reads ``w.value``; ``minimize`` takes
its gradient with the backend's own autodiff (torch autograd, ``jax.grad``). On NumPy, which
has no autodiff, compute gradients yourself and call ``apply_gradients``.
"""

from __future__ import annotations

import argparse
from typing import Callable

import numpy as np

import meshembed as me


def make_data(n: int = 512, d: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Linearly separable-ish data: labels from a hidden weight vector plus label noise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    w_true = rng.normal(size=(d, 1)).astype(np.float32)
    y = (x @ w_true + 0.3 * rng.normal(size=(n, 1)) > 0).astype(np.float32)
    return x, y


def make_loss(backend: me.backend.Backend, x: np.ndarray, y: np.ndarray,
              w: me.Variable, b: me.Variable) -> Callable[[], object]:
    """Mean binary cross-entropy from logits, written once over the Array API."""
    xp = backend.xp
    xb, yb = backend.asarray(x), backend.asarray(y)

    def loss():
        z = xp.matmul(xb, w.value) + b.value
        # log(1 + e^z) - y·z, computed without overflow
        return xp.mean(xp.maximum(z, 0.0) - z * yb + xp.log1p(xp.exp(-xp.abs(z))))

    return loss


def train(backend_name: str = "torch", steps: int = 200, log_every: int = 0) -> list[float]:
    """Return the loss before each step (and after the last)."""
    backend = me.get_backend(backend_name)
    x, y = make_data()
    w = me.Variable(np.zeros((x.shape[1], 1), np.float32), name="dense/kernel", backend=backend)
    b = me.Variable(np.zeros((1,), np.float32), name="dense/bias", backend=backend)
    loss = make_loss(backend, x, y, w, b)
    opt = me.optimizers.Adadelta(learning_rate=1.0, rho=0.9, epsilon=1e-3)
    losses = []
    for step in range(steps):
        losses.append(float(backend.to_numpy(loss())))
        opt.minimize(loss, [w, b])
        if log_every and step % log_every == 0:
            print(f"step {step:4d}  loss {losses[-1]:.4f}")
    losses.append(float(backend.to_numpy(loss())))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torch", choices=["torch", "jax"])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    losses = train(args.backend, args.steps, log_every=max(1, args.steps // 10))
    print(f"{args.backend}: loss {losses[0]:.4f} -> {losses[-1]:.4f} after {args.steps} steps")


if __name__ == "__main__":
    main()
