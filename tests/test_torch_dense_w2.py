"""The torch backend's W2 path (``meshembed_torch.native``, ``dense_*``) after #36 item 3:

* the tensors are checked and their pointers collected in one loop (``dense_pointers``): whatever
  the kernel may not take (another dtype, a non-contiguous or differently shaped target, a
  non-tensor) gives None, so the compiled core function runs instead;
* tensors with the same values share one parameter block (stride 0), tensors with their own
  values keep theirs: both give the bits of one call per tensor and of the NumPy kernel;
* the all-finite pass (last chunk first) finds a NaN / Inf in the first and the last element
  of a tensor of many chunks, and in a small tensor after a large one.
"""

from __future__ import annotations

import numpy as np
import pytest

import meshembed as me

torch = pytest.importorskip("torch")


def _kernel():
    from meshembed_torch import native

    opt = me.optimizers.Adadelta(learning_rate=1.0, rho=0.95, epsilon=1e-6)
    kernel = native.dense_kernel_for(opt._rule(me.Variable(np.ones(1, np.float32), backend="torch"), folded=True))
    if kernel is None:
        pytest.skip("no generated kernel here (no compiler)")
    return kernel


def _arrays(sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=gen) * 0.1 for n in sizes]
    targets = [[torch.randn(n, generator=gen) for n in sizes],
               [torch.rand(n, generator=gen) for n in sizes],
               [torch.rand(n, generator=gen) for n in sizes]]
    return grads, targets


@pytest.mark.parametrize("shared", [True, False])
def test_one_call_equals_a_call_per_tensor_and_numpy(shared):
    from meshembed_torch import native

    kernel = _kernel()
    sizes = [600_003, 70, 1 << 16, 5]  # several chunks, chunk tails, tensors smaller than a chunk
    values = [(0.5,)] * len(sizes) if shared else [(0.5 + 0.25 * n,) for n in range(len(sizes))]
    grads, targets = _arrays(sizes)
    alone = [[x.clone() for x in t] for t in targets]
    ref = [[x.numpy().copy() for x in t] for t in targets]
    native.dense_update(kernel, grads, values, targets, torch.get_num_threads())
    for n in range(len(sizes)):
        native.dense_update(kernel, [grads[n]], [values[n]], [[t[n]] for t in alone], torch.get_num_threads())
        kernel.apply([r[n] for r in ref], grads[n].numpy(), values[n])
        for k in range(3):
            np.testing.assert_array_equal(targets[k][n].numpy(), alone[k][n].numpy())
            np.testing.assert_array_equal(targets[k][n].numpy(), ref[k][n])


def test_pointers_refuses_what_the_kernel_cannot_take():
    from meshembed_torch import native

    kernel = _kernel()
    grads, targets = _arrays([64, 32])
    assert native.dense_pointers(kernel, grads, targets) is not None
    params = [[torch.nn.Parameter(x) for x in targets[0]], *targets[1:]]
    assert native.dense_pointers(kernel, grads, params) is not None
    cases = {
        "float64 gradient": ([grads[0].double(), grads[1]], targets),
        "non-contiguous target": (grads, [targets[0], [torch.randn(64, 2)[:, 0], targets[1][1]], targets[2]]),
        "target of another shape": (grads, [targets[0], [targets[1][0].reshape(8, 8), targets[1][1]], targets[2]]),
        "not a tensor": (grads, [targets[0], [targets[1][0].numpy(), targets[1][1]], targets[2]]),
        "a target list too short": (grads, [targets[0], targets[1][:1], targets[2]]),
        "two arrays for three": (grads, targets[:2]),
    }
    for what, (g, t) in cases.items():
        assert native.dense_pointers(kernel, g, t) is None, what
        assert not native.dense_fits(kernel, g, t), what


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_all_finite_last_chunk_first_finds_every_position(bad):
    from meshembed_torch import native

    big = torch.randn(5 * native.DENSE_CHUNK + 17)
    small = torch.randn(100)
    if native.all_finite([big, small], 2) is None:
        pytest.skip("no C library here")
    assert native.all_finite([big, small], 2)
    for which, j in ((0, 0), (0, -1), (0, native.DENSE_CHUNK), (1, 0), (1, -1)):
        arrays = [big.clone(), small.clone()]
        arrays[which][j] = bad
        assert native.all_finite(arrays, 2) is False, (which, j)
