"""Which tests ``MESHEMBED_TEST_DEVICE_REPEATS=0`` leaves out of a many-device run (README,
"Repeats on 8 devices").

Why: an optimizer option (gradient clip, weight clip, weight decay, dynamic learning rate, a
formula variant) is per-row math inside the update, after the owners' sum, so it gives the same
numbers on 1 device as on 8. The 1-device runs keep every variant; a many-device run (8 JAX
devices, 4 gloo ranks) keeps each rule's plain case and every variant of ``adagrad``, so each
kind of update and each option is still routed over the sharded tables. Likewise the
16-bit every-optimizer case keeps its rules with a division, a pow or every row updated.

In one process with many JAX devices (not over ranks), a table of one shard lives on one
device whatever the device count (``ShardLayout``: the largest divisor of the shard count the
devices allow), so its programs are the 1-device run's: the cases of one shard are repeats
there. Over ranks they are not (the other ranks route their ids to the owner).
"""

from __future__ import annotations

from typing import Any

#: Tests parametrised by ``name`` (the optimizer) and ``option`` (``"plain"`` or a variant).
BY_OPTION = ("test_optimizer_matches_reference", "test_every_optimizer_through_the_engine_equals_numpy",
             "test_engine_optimizers_through_update_rows")
#: Tests over the generated kernel cases: ``index`` into the module's ``IDS``, each
#: ``"<algorithm>-<variant>-<option>-<dtype>"`` (``option`` "none" for the plain case).
BY_CASE = ("test_every_generated_case_through_update_rows",)
#: Tests parametrised by ``optimizer`` (a class name) over every optimizer, whose module's
#: ``SUBSET`` names those that keep running on many devices.
BY_OPTIMIZER = ("test_every_optimizer_gives_the_numpy_backends_bits",)
#: The rule whose every variant still runs on many devices.
KEPT = "adagrad"
#: Parameters that name a test's shard count.
SHARDS = ("shards", "num_shards")


def is_repeat(item: Any, one_process: bool) -> bool:
    """An option variant of a rule other than :data:`KEPT`: the same math on 1 device; with
    ``one_process`` (many devices, no ranks), also a case of one shard."""
    name = getattr(item, "originalname", None)
    params = getattr(getattr(item, "callspec", None), "params", {})
    if one_process and (any(params.get(k) == 1 for k in SHARDS) or name in BY_OPTIMIZER):
        return True  # one shard: one device (BY_OPTIMIZER's test trains tables of one shard)
    if name in BY_OPTION:
        return params.get("option", "plain") != "plain" and params.get("name") != KEPT
    if name in BY_CASE and "index" in params:
        algorithm, *_, option, _dtype = item.module.IDS[params["index"]].split("-")
        return option != "none" and algorithm != KEPT
    if name in BY_OPTIMIZER and "optimizer" in params:
        return params["optimizer"] not in item.module.SUBSET
    return False
