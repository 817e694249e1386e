"""The embedding conformance suite through ``me.torch.EmbeddingCollection``: the entries
``torch-module`` (eager) and ``torch-module-compiled`` (``torch.compile``).

The torch module is a front end over the registry's ``torch`` backend, certified as
``jax-functional`` certifies ``me.jax``: for these backend names the conftest swaps
``me.TPUEmbedding`` for :class:`ModuleEngine` (or :class:`CompiledModuleEngine`) and the tests
run unchanged. Each wrapper holds one ``EmbeddingCollection`` of the same config (built as a
user builds it, on the same device and shard count) and, on the torch backend,

* ``enqueue`` runs the engine's enqueue; when that refuses the batch (``InputError``), the
  module's forward must refuse the same inputs with the same error class;
* ``dequeue`` gives the activations of the module's training forward (``module(features,
  weights)``; ``torch.no_grad()`` for an inference batch) run on a copy of the engine's tables;
* ``apply_gradients`` feeds the test's activation gradients to autograd as the upstream
  gradient of the module's outputs (``torch.autograd.backward(outputs, gradients)``), after
  ``set_learning_rates(learning_rates)``: the module's own backward applies the update (the
  fused optimizer); a refused step (NaN gradient, bad learning rate) must be refused by the
  module too, with the same error class, leaving its tables as they were. The engine's step
  runs beside it on the engine's own tables;

and each step asserts that both give the same raw bits (activations, every table and slot, NaN
payloads and signs of zero included; the step counter); the wrapper then keeps the module's tables. Inputs reach the module as a torch user
passes them: NumPy arrays become tensors (``me.RaggedIds``/``me.SparseIds`` of tensors).

The engine's state machine (call order, pending batches) and the shape checks of the
gradients stay the engine's: the module has no enqueue/dequeue, and autograd hands it
gradients of its outputs' shapes only. ``backward_pass_only`` batches run the module's forward
and backward at ``apply_gradients`` (the module has no backward without a forward).

``torch-module-compiled`` calls ``torch.compile(module, fullgraph=True, dynamic=False)``
(a graph break raises) for every forward and asserts each training forward ran as one compiled
graph; the backward runs the compiled graph's backward. Dynamo is reset for each new module (its
op handle is a constant of the graph: modules of many tests would fill one code object's
recompile budget). Compiling costs a second or more per new module, so by default it runs a
subset of the engine tests (:func:`compiled_subset`); ``MESHEMBED_TEST_COMPILED=all`` runs every
one.

Only ``conformance/test_engine*.py`` run here; the backend-protocol and dense-optimizer tests
would repeat the ``torch`` entry exactly.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Collection, Iterable

import numpy as np

from meshembed.embedding import batch as batches
from meshembed.embedding import step as steps
from meshembed.embedding.batch import resolve_mode
from meshembed.embedding.engine import TPUEmbedding
from meshembed.embedding.inputs import RaggedIds, SparseIds
from meshembed.errors import InputError, MeshembedError

NAME = "torch-module"
COMPILED_NAME = "torch-module-compiled"
NAMES = (NAME, COMPILED_NAME)
#: The registry backend underneath.
INNER = "torch"
SKIP_REASON = ("me.torch.EmbeddingCollection is an embedding front end: only conformance/test_engine*.py run "
               "through it (the backend-protocol and dense tests would repeat the 'torch' entry)")

#: ``MESHEMBED_TEST_COMPILED=all``: every engine test on ``torch-module-compiled`` (else the subset below).
_COMPILED = os.environ.get("MESHEMBED_TEST_COMPILED", "").strip().lower()
if _COMPILED not in ("", "subset", "all"):
    raise ValueError(f"MESHEMBED_TEST_COMPILED={_COMPILED!r}: expected 'all' or 'subset' (the default)")
COMPILE_ALL = _COMPILED == "all"

COMPILED_SUBSET_SKIP = ("not in torch-module-compiled's default subset (the first case of each engine test, and "
                        "every combiner: compiling costs a second or more per new module); "
                        "MESHEMBED_TEST_COMPILED=all runs every engine test compiled")
#: Tests whose every case runs in the compiled subset: one case per combiner.
COMPILED_EVERY_CASE = ("test_combiner_backward_matches_finite_differences",)


def _is_engine_test(nodeid: str) -> bool:
    return "/test_engine" in nodeid.replace("\\", "/") or nodeid.startswith("test_engine")


def compiled_subset(nodeids: Iterable[str]) -> set[str]:
    """The engine tests ``torch-module-compiled`` runs without ``MESHEMBED_TEST_COMPILED=all``
    (given the node ids of that entry in collection order): the first case of every test
    function (each behaviour: input forms, modes, refusals, checkpoints, SGD against the
    reference, SGD against TensorFlow, 16-bit tables, quantization), and every case of
    :data:`COMPILED_EVERY_CASE` (the three combiners). The other cases differ only in the
    optimizer or its options, the shard count or the data: code that runs eagerly inside the
    module's lookup/update ops, the same under compile (the eager entry runs them all)."""
    chosen, seen = set(), set()
    for nodeid in nodeids:
        if not _is_engine_test(nodeid):
            continue
        func = nodeid.split("[", 1)[0]
        if func not in seen or func.rsplit("::", 1)[-1] in COMPILED_EVERY_CASE:
            chosen.add(nodeid)
        seen.add(func)
    return chosen


def covers(nodeid: str, name: str = NAME, subset: Collection[str] | None = None) -> bool:
    """Whether a conformance test runs on entry ``name`` (else it is skipped, see
    :func:`skip_reason`); ``subset``: :func:`compiled_subset` of the compiled entry's tests."""
    if not _is_engine_test(nodeid):
        return False
    return name != COMPILED_NAME or COMPILE_ALL or subset is None or nodeid in subset


def skip_reason(nodeid: str) -> str:
    return SKIP_REASON if not _is_engine_test(nodeid) else COMPILED_SUBSET_SKIP


# -- bits -------------------------------------------------------------------------------------

def _bits(x: Any) -> np.ndarray:
    """The raw bits of a tensor (bfloat16 too: NumPy has none) as integers of its width."""
    import torch

    x = x.detach().cpu().contiguous()
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return x.view(width).numpy() if x.dtype.is_floating_point else x.numpy()


def _same_bits(got: Any, want: Any, what: str, name: str) -> None:
    import torch

    ok = (got.shape == want.shape and got.dtype == want.dtype
          and np.array_equal(_bits(got), _bits(want)))
    if not ok:
        diff = None
        if got.shape == want.shape:
            d = (got.detach().double() - want.detach().double()).abs()
            diff = float(torch.nan_to_num(d, nan=0.0).max()) if d.numel() else 0.0
        raise AssertionError(f"[{name}] EmbeddingCollection and TPUEmbedding(torch) differ in {what}: shapes "
                             f"{tuple(got.shape)}/{tuple(want.shape)}, dtypes {got.dtype}/{want.dtype}, "
                             f"max |diff| {diff}")


# -- inputs as a torch user passes them -----------------------------------------------------------

def _tensor(x: Any) -> Any:
    import torch

    if x is None or isinstance(x, torch.Tensor):
        return x
    arr = np.asarray(x)
    if arr.dtype.kind not in "biuf":
        return x  # the module names what is wrong
    return torch.from_numpy(np.array(arr, copy=True))


def _feature_input(x: Any) -> Any:
    if isinstance(x, RaggedIds):
        return RaggedIds(_tensor(x.row_splits), _tensor(x.values))
    if isinstance(x, SparseIds):
        shape = x.dense_shape
        shape = tuple(int(s) for s in np.asarray(shape).reshape(-1)) if not isinstance(shape, tuple) else shape
        return SparseIds(_tensor(x.indices), _tensor(x.values), shape)
    return _tensor(x)


def _torch_inputs(values: Any) -> Any:
    if values is None:
        return None
    if isinstance(values, dict):
        return {k: _feature_input(v) for k, v in values.items()}
    if isinstance(values, (list, tuple)):
        return [_feature_input(v) for v in values]
    return _feature_input(values)


# -- the wrapper --------------------------------------------------------------------------------

@dataclass
class _Step:
    batch: Any  # the engine's pending batch these inputs belong to
    features: Any
    weights: Any
    outputs: list | None = None  # the module's activations (config order), graph attached


class ModuleEngine(TPUEmbedding):
    """``TPUEmbedding`` whose steps on the torch backend also run through
    ``me.torch.EmbeddingCollection`` (see the module docstring); on any other backend it is the
    plain engine (the tests' references)."""

    compiled = False
    entry = NAME

    def __init__(self, config: Any, backend: Any = None, num_shards: int | None = None, mesh: Any = None,
                 seed: int = 0, **kwargs: Any) -> None:
        super().__init__(config, backend, num_shards, mesh, seed, **kwargs)
        self._num_shards_arg = num_shards
        self._module: Any = None
        self._call: Any = None
        self._step: _Step | None = None

    # -- the module beside the engine ---------------------------------------------------------
    def _front(self) -> bool:
        from meshembed_torch.backend import TorchBackend

        return isinstance(self.backend, TorchBackend) and self.backend.processes == 1

    def _collection(self) -> Any:
        if self._module is None:
            import pytest
            import torch

            from meshembed_torch.frontend.module import EmbeddingCollection

            if self.pipelined:
                pytest.skip(f"[{self.entry}] pipelined engines: the wrapper copies the engine's tables into the "
                            "module every step, which would drop the module's kept (deferred) update")
            if self.vocabularies:
                pytest.skip(f"[{self.entry}] dynamic vocabularies: the module's key-to-row state is its own; "
                            "conformance/test_dynamic_vocab.py is not run through the module")
            module = EmbeddingCollection(self.config, num_shards=self._num_shards_arg, device=self.backend.device,
                                         seed=self.seed, initializers={t: "zeros" for t in self.table_names})
            self._module = module
            if self.compiled:
                torch._dynamo.reset()  # one module's graphs at a time: no recompile limit reached across tests
                self._call = torch.compile(module, fullgraph=True, dynamic=False)
            else:
                self._call = module
        return self._module

    def _copy_state(self) -> None:
        """The module's tables become a copy of the engine's (the same bits, separate tensors)."""
        from meshembed_torch.table import TorchShardedTable

        module = self._collection()
        tables = {i: tuple(TorchShardedTable(t.data.clone(), t.placement, t.rowmap, t.group) for t in ts)
                  for i, ts in self.state.tables.items()}
        module.engine.state = steps.EngineState(tables, self.state.step, module.engine.layout)

    def _same_state(self, what: str) -> None:
        got = self._module.engine.state
        for t in self.layout.tables:
            names = ("parameters",) + self.table_slot_names(t.index)
            for n, a, b in zip(names, got.tables[t.index], self.state.tables[t.index]):
                _same_bits(a.data, b.data, f"table {t.name!r} {n!r} {what}", self.entry)
        if got.step != self.step:
            raise AssertionError(f"[{self.entry}] the module's step counter {got.step} != the engine's {self.step} "
                                 f"{what}")

    def _forward(self, features: Any, weights: Any, training: bool) -> list:
        """The module's activations in config order (a training forward keeps its graph)."""
        import torch

        module = self._collection()
        module.train(training)
        with torch.set_grad_enabled(training):
            out = self._call(_torch_inputs(features), _torch_inputs(weights))
        keys = self.layout.keys
        outs = [out[k] for k in keys] if keys else [out[f.name] for f in self.layout.features]
        if self.compiled:  # fullgraph=True raises on a graph break; this catches a silent eager fallback
            from torch._dynamo.utils import counters

            eager = [type(o.grad_fn).__name__ for o in outs if training and type(o.grad_fn).__name__ !=
                     "CompiledFunctionBackward"]
            if counters["graph_break"] or eager:
                raise AssertionError(f"[{self.entry}] the forward did not run as one compiled graph: graph breaks "
                                     f"{dict(counters['graph_break'])}, eager outputs {eager}")
        return outs

    def _run_forward(self, step: _Step) -> list:
        self._copy_state()
        step.outputs = self._forward(step.features, step.weights, step.batch.mode != "inference")
        return step.outputs

    def _current(self) -> _Step | None:
        step = self._step
        return step if step is not None and step.batch is not None and step.batch is self.pending else None

    # -- the TPUEmbedding API -----------------------------------------------------------------
    def enqueue(self, features: Any, weights: Any = None, *, training: bool | None = None,
                mode_override: str | None = None) -> None:
        if not self._front():
            return super().enqueue(features, weights, training=training, mode_override=mode_override)
        mode = resolve_mode(self.layout, training, mode_override)  # the engine's own mode and order errors first
        self._check_can_enqueue()
        try:
            super().enqueue(features, weights, training=training, mode_override=mode_override)
        except InputError as exc:
            self._refused_by_module(features, weights, mode != "inference", exc)
            raise
        self._step = _Step(self.pending, features, weights)

    def _refused_by_module(self, features: Any, weights: Any, training: bool, exc: Exception) -> None:
        self._copy_state()
        try:
            outs = self._forward(features, weights, training)
        except MeshembedError as got:
            if type(got) is not type(exc):
                raise AssertionError(f"[{self.entry}] enqueue raised {type(exc).__name__}: {exc}\nbut the module's "
                                     f"forward raised {type(got).__name__}: {got}") from got
            return
        del outs
        raise AssertionError(f"[{self.entry}] enqueue raised {type(exc).__name__}: {exc}\nbut the module's forward "
                             "accepted the same inputs") from exc

    def dequeue(self) -> Any:
        want = super().dequeue()  # the engine's state checks; the pending batch is marked read
        step = self._current() if self._front() else None
        if step is None:
            return want
        got = self._run_forward(step)
        keys = self.layout.keys
        pairs = list(zip(keys, keys)) if keys else list(enumerate(f.name for f in self.layout.features))
        out: Any = {} if keys else [None] * len(self.layout.features)
        for (k, name), g in zip(pairs, got):
            _same_bits(g, want[k], f"the activations of {name!r}", self.entry)
            out[k] = g.detach()
        return out

    def apply_gradients(self, gradients: Any, learning_rates: Any = (), *, allow_nonfinite: bool | None = None) -> None:
        step = self._current() if self._front() else None
        if step is None:
            return super().apply_gradients(gradients, learning_rates, allow_nonfinite=allow_nonfinite)
        import torch

        p = self._check_can_apply()  # the engine's order errors, as the engine's
        if p.batch.mode == "inference":
            return super().apply_gradients(gradients, learning_rates, allow_nonfinite=allow_nonfinite)
        try:  # shapes and count: autograd hands the module gradients of its outputs' shapes only
            grads = steps.check_gradients(self.backend, self.layout, gradients, check_now=False)
            allow = self.allow_nonfinite if allow_nonfinite is None else batches.check_bool(
                allow_nonfinite, "allow_nonfinite", InputError)
        except MeshembedError:
            return super().apply_gradients(gradients, learning_rates, allow_nonfinite=allow_nonfinite)
        module = self._collection()
        outputs = step.outputs if step.outputs is not None else self._run_forward(step)
        step.outputs = None  # consumed: a backward ran (or its batch is dropped); a retry forwards again
        module.engine.allow_nonfinite = allow
        refused: MeshembedError | None = None
        try:
            module.set_learning_rates(learning_rates)
            torch.autograd.backward(outputs, [g.reshape(o.shape) for g, o in zip(grads, outputs)])
        except MeshembedError as exc:
            refused = exc
        try:
            super().apply_gradients(gradients, learning_rates, allow_nonfinite=allow_nonfinite)
        except MeshembedError as exc:
            if refused is None or type(refused) is not type(exc):
                raise AssertionError(f"[{self.entry}] apply_gradients raised {type(exc).__name__}: {exc}\nbut the "
                                     f"module's backward {'applied the step' if refused is None else repr(refused)}"
                                     ) from exc
            self._same_state("after a refused step (the module must change nothing)")
            raise
        if refused is not None:
            raise AssertionError(f"[{self.entry}] apply_gradients applied the step but the module's backward raised "
                                 f"{type(refused).__name__}: {refused}") from refused
        self._same_state(f"after step {self.step}")
        self.state = steps.EngineState(self._module.engine.state.tables, self.step, self.layout)
        self._step = None


class CompiledModuleEngine(ModuleEngine):
    """:class:`ModuleEngine` calling ``torch.compile(module, fullgraph=True, dynamic=False)``."""

    compiled = True
    entry = COMPILED_NAME


def engine_class(name: str) -> type:
    return CompiledModuleEngine if name == COMPILED_NAME else ModuleEngine
