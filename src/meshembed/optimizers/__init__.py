"""Keras-style dense optimizers that respect a mesh (``me.optimizers.Adadelta``)."""

from meshembed.optimizers import schedules
from meshembed.optimizers.adadelta import Adadelta
from meshembed.optimizers.base import Optimizer
from meshembed.optimizers.options import EMAOption, GradientsClipOption

__all__ = ["Adadelta", "EMAOption", "GradientsClipOption", "Optimizer", "schedules"]
