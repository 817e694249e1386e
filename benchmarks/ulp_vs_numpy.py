"""Largest difference of each backend's tables and slots from the NumPy engine after 5 steps:
"Nu" = ulps over elements >= 1e-3 of the largest, then max|diff| / max|numpy|.
Usage: python -m benchmarks.ulp_vs_numpy torch|jax (MESHEMBED_TORCH_FUSED=0 / MESHEMBED_JAX_FUSED=0 for the core paths)."""
import os, sys, numpy as np, meshembed as me

def ulps(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = float(np.max(np.abs(b))) or 1.0
    big = np.abs(b) >= 1e-3 * scale
    rel = float(np.max(np.abs(a - b)) / scale)
    a, b = a[big], b[big]
    return f"{_ulps(a, b)}u/{rel:.1e}"

def _ulps(a, b):
    a = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    b = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    a = np.where(a < 0, -(a & 0x7FFFFFFF), a); b = np.where(b < 0, -(b & 0x7FFFFFFF), b)
    return int(np.max(np.abs(a - b))) if a.size else 0

E = me.embedding
OPTS = {
 "sgd": E.SGD(learning_rate=0.1), "adagrad": E.Adagrad(learning_rate=0.1),
 "adadelta": E.Adadelta(learning_rate=0.5, rho=0.9, epsilon=1e-6),
 "adam": E.Adam(learning_rate=0.01), "ftrl": E.FTRL(learning_rate=0.1),
 "momentum": E.Momentum(learning_rate=0.1, momentum=0.9), "rmsprop": E.RMSProp(learning_rate=0.01, rho=0.9, momentum=0.5, epsilon=1e-6),
 "lion": E.Lion(learning_rate=0.01), "adagrad_clip_wd": E.Adagrad(learning_rate=0.1, clip_weight_min=-0.5, clip_weight_max=0.5, weight_decay_factor=0.01),
}
backend = sys.argv[1]
rng = np.random.default_rng(0)
ids = [rng.zipf(1.1, size=(5, 256)) % 1000 for _ in range(1)][0]
grads = rng.standard_normal((5, 256, 16)).astype(np.float32)
for name, opt in OPTS.items():
    cfg = me.EmbeddingConfig(tables=[me.TableConfig(name="t", vocabulary_size=1000, dimension=16, optimizer=opt, combiner="sum")],
                             features=[me.FeatureConfig(table="t", input_shape=(256,), name="f")])
    out = []
    for b in ("numpy", backend):
        emb = me.TPUEmbedding(cfg, backend=b, num_shards=2)
        for s in range(5):
            emb.enqueue([ids[s]]); emb.dequeue(); emb.apply_gradients([grads[s]])
        out.append(emb.retrieve_parameters("t"))
    print(f"{backend:6s} fused={os.environ.get('MESHEMBED_TORCH_FUSED', os.environ.get('MESHEMBED_JAX_FUSED', '1'))} {name:16s}",
          {k: ulps(out[0][k], out[1][k]) for k in out[0]})
