"""The demo learns the planted signal and its checkpoint restores on another shard count."""

from meshembed import demo


def test_demo_trains_and_restores():
    assert demo.main(backend="numpy", steps=150, quiet=True) == 0


def test_auc():
    import numpy as np

    assert demo.auc(np.array([0, 0, 1, 1.0]), np.array([0.1, 0.4, 0.35, 0.8])) == 0.75
