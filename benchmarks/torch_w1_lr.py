"""W1 on torch with a learning rate that changes every step vs a constant one (issue #18).

The engine's full step (enqueue → dequeue → apply_gradients) with ``DynamicLearningRate(0)``,
``learning_rates=[0.01]`` or ``[0.01 / (1 + k)]``; the two are timed in alternating blocks
(``--rounds``) on one engine, medians over the timed steps after ``--warmup`` steps per block.
The update rule's learning rate is an input of the compiled update, so both should cost the same.

Run: ``python -m benchmarks.torch_w1_lr [--tiny] [--optimizer adam] [--steps 10] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import TINY_W1, W1, zipf_ids


def _optimizer(name: str):
    import meshembed as me

    lr = me.embedding.DynamicLearningRate(0)
    return {"adam": lambda: me.embedding.Adam(learning_rate=lr),
            "ftrl": lambda: me.embedding.FTRL(learning_rate=lr),
            "adagrad": lambda: me.embedding.Adagrad(learning_rate=lr),
            "sgd": lambda: me.embedding.SGD(learning_rate=lr)}[name]()


def run(sizes: dict, optimizer: str = "adam", steps: int = 10, rounds: int = 2, warmup: int = 3) -> dict:
    """{"constant": [ms...], "changing": [ms...], "first": {mode: [ms of the warm-up steps]}}."""
    import torch

    import meshembed as me

    rng = np.random.default_rng(1)
    b, k = sizes["batch"], sizes["ids_per_sample"]
    ids = zipf_ids(b * k, sizes["vocab"], sizes["zipf"], 0)
    feat = me.RaggedIds(np.arange(0, ids.size + 1, k, dtype=np.int64), ids)
    grad = torch.from_numpy(rng.standard_normal((b, sizes["dim"])).astype(np.float32) * 0.01)
    init = (rng.standard_normal((sizes["vocab"], sizes["dim"])) * 0.05).astype(np.float32)
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig(name="t", vocabulary_size=sizes["vocab"], dimension=sizes["dim"],
                               optimizer=_optimizer(optimizer), combiner="sum")],
        features=[me.FeatureConfig(table="t", input_shape=(b,), name="f")])
    emb = me.TPUEmbedding(cfg, backend="torch", initializers={"t": init})
    out: dict = {"constant": [], "changing": [], "first": {}}
    for _ in range(rounds):
        for mode in ("constant", "changing"):
            times = []
            for s in range(warmup + steps):
                lr = 0.01 if mode == "constant" else 0.01 / (1 + s)
                t0 = time.perf_counter()
                emb.enqueue([feat])
                emb.dequeue()
                emb.apply_gradients([grad], learning_rates=[lr])
                times.append((time.perf_counter() - t0) * 1e3)
            out[mode] += times[warmup:]
            out["first"].setdefault(mode, times[:warmup])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CI sizes")
    ap.add_argument("--optimizer", default="adam", choices=("adam", "ftrl", "adagrad", "sgd"))
    ap.add_argument("--steps", type=int, default=10, help="timed steps per block")
    ap.add_argument("--rounds", type=int, default=2, help="alternating constant/changing blocks")
    args = ap.parse_args(argv)
    res = run(TINY_W1 if args.tiny else W1, args.optimizer, args.steps, args.rounds)
    print(f"| W1 {args.optimizer} (torch engine) | median ms | min–max ms | first steps ms |")
    print("|---|---|---|---|")
    for mode in ("constant", "changing"):
        t = res[mode]
        first = ", ".join(f"{x:.0f}" for x in res["first"][mode])
        print(f"| lr {mode} | {np.median(t):.1f} | {min(t):.1f}–{max(t):.1f} | {first} |")
    print(f"changing / constant: {np.median(res['changing']) / np.median(res['constant']):.3f}")


if __name__ == "__main__":
    main()
