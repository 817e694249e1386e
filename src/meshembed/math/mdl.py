"""MDLAdagradLight: declared by the proto, not implementable from public sources."""

from __future__ import annotations

from typing import Any, NamedTuple

from meshembed.math.common import Array, Scalar


class MdlAdagradLightSlots(NamedTuple):
    accumulators: Array
    weights: Array
    benefits: Array


def mdl_adagrad_light(
    xp: Any, params: Array, grads: Array, slots: MdlAdagradLightSlots, *, lr: Scalar,
    **hyperparameters: Any,
) -> tuple[Array, MdlAdagradLightSlots]:
    """Always raises: no public formula exists (spec §4.2 MdlAdagradLight).

    The proto lists twelve fields (l2, lr_power, min_servable_mdl_benefit, mdl_mix_in_margin,
    ...) and the slots accumulators/weights/benefits, but neither TF's proto comments, its
    C++ kernels nor its tests say how benefits are computed or mixed in. Configs that name it
    still load, save and round-trip; only the update cannot run. Use CustomOptimizer for a
    known rule.
    """
    raise NotImplementedError(
        "MDLAdagradLight has no public update formula (the TPU kernel is closed source and "
        "optimization_parameters.proto gives only field names), so meshembed cannot run it. "
        "Its configs load, save and round-trip; to train, choose another optimizer or a "
        "meshembed.math.custom.CustomOptimizer with your own rule."
    )
