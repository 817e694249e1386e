"""me.torch: EmbeddingCollection (eager and torch.compile) against TPUEmbedding(backend="torch")."""

from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import meshembed as me  # noqa: E402

VOCAB, DIM, BATCH, SEQ = 50, 4, 6, 3

OPTIMIZERS = {
    "sgd": lambda: me.embedding.SGD(learning_rate=0.1),
    "adagrad": lambda: me.embedding.Adagrad(learning_rate=0.1),
    "adadelta": lambda: me.embedding.Adadelta(learning_rate=1.0, rho=0.9, epsilon=1e-6),
    "adam": lambda: me.embedding.Adam(learning_rate=0.01),
    "ftrl": lambda: me.embedding.FTRL(learning_rate=0.1),
    "momentum": lambda: me.embedding.Momentum(learning_rate=0.1, momentum=0.9),
}


def config(optimizer="adagrad", combiner="mean"):
    """A shared table under a pooled multi-hot feature and a sequence feature."""
    opt = OPTIMIZERS[optimizer]() if isinstance(optimizer, str) else optimizer
    return me.EmbeddingConfig(
        tables=[me.TableConfig("t", VOCAB, DIM, optimizer=opt, combiner=combiner)],
        features=[me.FeatureConfig("t", (BATCH,), name="bag"), me.FeatureConfig("t", (BATCH, SEQ), name="seq")],
    )


def batch(rng):
    lengths = rng.integers(0, 5, size=BATCH)
    values = (rng.zipf(1.3, size=int(lengths.sum())) - 1) % VOCAB
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    weights = rng.uniform(0.5, 2.0, size=values.shape[0]).astype(np.float32)
    seq = rng.integers(0, VOCAB, size=(BATCH, SEQ))
    return values, offsets, weights, seq


def loss_of(acts):
    return sum(((a - 0.3) ** 2).sum() for a in acts)


def engine_step(emb, values, offsets, weights, seq):
    emb.enqueue([me.RaggedIds(offsets, values), seq], [me.RaggedIds(offsets, weights), None])
    acts = [a.requires_grad_() for a in emb.dequeue()]
    loss_of(acts).backward()
    emb.apply_gradients([a.grad for a in acts])
    return acts


def module_inputs(values, offsets, weights, seq):
    feats = {"bag": (torch.from_numpy(values), torch.from_numpy(offsets)), "seq": torch.from_numpy(seq)}
    return feats, {"bag": torch.from_numpy(weights)}


def assert_same_tables(ec, emb):
    for name in emb.table_names:
        a, b = ec.engine.retrieve_parameters(name), emb.retrieve_parameters(name)
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("shards", [1, 3])
def test_training_bit_identical_to_engine(optimizer, shards):
    rng = np.random.default_rng(0)
    ec = me.torch.EmbeddingCollection(config(optimizer), num_shards=shards, seed=4)
    emb = me.TPUEmbedding(config(optimizer), backend="torch", num_shards=shards, seed=4)
    for _ in range(3):
        b = batch(rng)
        feats, ws = module_inputs(*b)
        out = ec(feats, ws)
        acts = engine_step(emb, *b)
        for a, name in zip(acts, ["bag", "seq"]):
            torch.testing.assert_close(out[name], a.detach(), rtol=0, atol=0)
        loss_of(out.values()).backward()
        assert_same_tables(ec, emb)
    assert ec._batches == {}


def test_unfused_keeps_gradients_until_apply_gradients():
    rng = np.random.default_rng(1)
    ec = me.torch.EmbeddingCollection(config("adagrad"), fused_optimizer=False)
    emb = me.TPUEmbedding(config("adagrad"), backend="torch")
    before = ec.engine.retrieve_parameters("t")["parameters"]
    b = batch(rng)
    out = ec(*module_inputs(*b))
    loss_of(out.values()).backward()
    np.testing.assert_array_equal(ec.engine.retrieve_parameters("t")["parameters"], before)
    ec.apply_gradients()
    engine_step(emb, *b)
    assert_same_tables(ec, emb)
    with pytest.raises(me.StateError, match="fused_optimizer=False"):
        me.torch.EmbeddingCollection(config()).apply_gradients()


def test_eval_and_no_grad_do_not_train_or_keep_batches():
    rng = np.random.default_rng(2)
    ec = me.torch.EmbeddingCollection(config())
    before = ec.engine.retrieve_parameters("t")["parameters"]
    feats, ws = module_inputs(*batch(rng))
    with torch.no_grad():
        ec(feats, ws)
    ec.eval()
    out = ec(feats, ws)
    assert not any(o.requires_grad for o in out.values())
    ec.train()
    ec(feats, ws)  # a training forward whose graph is dropped without backward
    assert ec._batches == {}
    np.testing.assert_array_equal(ec.engine.retrieve_parameters("t")["parameters"], before)


def test_every_input_form_equals_ragged_ids():
    rng = np.random.default_rng(3)
    values, offsets, weights, seq = batch(rng)
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", VOCAB, DIM, optimizer=me.embedding.SGD(learning_rate=0.1), combiner="sum")],
        features=[me.FeatureConfig("t", (BATCH,), name="bag")],
    )
    ec = me.torch.EmbeddingCollection(cfg).eval()
    emb = me.TPUEmbedding(cfg, backend="torch")
    emb.enqueue([me.RaggedIds(offsets, values)], [me.RaggedIds(offsets, weights)], training=False)
    want = emb.dequeue()[0]
    v, o, w = torch.from_numpy(values), torch.from_numpy(offsets), torch.from_numpy(weights)
    rows = np.repeat(np.arange(BATCH), np.diff(offsets))
    cols = np.arange(values.shape[0]) - offsets[rows]
    idx = torch.from_numpy(np.stack([rows, cols]))
    size = (BATCH, int(cols.max()) + 1 if cols.size else 1)
    forms = {
        "offsets": ((v, o), w),
        "lengths": ((v, torch.from_numpy(np.diff(offsets))), w),
        "offsets int32": ((v.int(), o.int()), w),
        "jagged": (torch.nested.nested_tensor_from_jagged(v, o), torch.nested.nested_tensor_from_jagged(w, o)),
        "coo": (torch.sparse_coo_tensor(idx, v, size), torch.sparse_coo_tensor(idx, w, size)),
        "RaggedIds": (me.RaggedIds(offsets, values), weights),
        "SparseIds of tensors": (me.SparseIds(idx.t(), v, size), me.SparseIds(idx.t(), w, size)),
        "RaggedIds of tensors": (me.RaggedIds(o, v), me.RaggedIds(o, w)),
    }
    for name, (x, wx) in forms.items():
        got = ec({"bag": x}, {"bag": wx})["bag"]
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    dense = torch.from_numpy(rng.integers(0, VOCAB, size=BATCH))
    emb.enqueue([dense.numpy()], training=False)
    torch.testing.assert_close(ec({"bag": dense.int()})["bag"], emb.dequeue()[0], rtol=0, atol=0)


def test_bad_input_names_the_feature_and_changes_nothing():
    rng = np.random.default_rng(4)
    ec = me.torch.EmbeddingCollection(config())
    before = ec.state_dict()
    values, offsets, weights, seq = batch(rng)
    bad = values.copy()
    bad[0] = VOCAB + 7
    feats, ws = module_inputs(bad, offsets, weights, seq)
    with pytest.raises(me.InputError, match="'bag'.*id=57"):
        ec(feats, ws)
    with pytest.raises(me.InputError, match="'bag'.*7 offsets or 6 lengths"):
        ec({"bag": (torch.from_numpy(values), torch.arange(3)), "seq": torch.from_numpy(seq)})
    with pytest.raises(me.InputError, match="ids for feature 'seq'.*dtype <U3"):
        ec({"bag": (torch.from_numpy(values), torch.from_numpy(offsets)), "seq": "abc"})
    with pytest.raises(me.InputError, match="'seq'.*integer"):
        ec({"bag": (torch.from_numpy(values), torch.from_numpy(offsets)), "seq": torch.ones(BATCH, SEQ)})
    with pytest.raises(me.InputError, match="Missing: \\['seq'\\]"):
        ec({"bag": feats["bag"]})
    with pytest.raises(me.InputError, match="'seq'.*expected shape"):
        ec({"bag": (torch.from_numpy(values), torch.from_numpy(offsets)), "seq": torch.from_numpy(seq[:, :2])})
    with pytest.raises(me.InputError, match="'seq'.*7 samples, more than the batch size 6"):
        ec({"bag": (torch.from_numpy(values), torch.from_numpy(offsets)), "seq": torch.zeros(BATCH + 1, SEQ).long()})
    for k, v in ec.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert ec._batches == {}


def test_state_dict_round_trip_across_shard_counts(tmp_path):
    rng = np.random.default_rng(5)
    ec = me.torch.EmbeddingCollection(config("adadelta"), num_shards=2, seed=1)
    loss_of(ec(*module_inputs(*batch(rng))).values()).backward()
    sd = ec.state_dict()
    assert sorted(sd) == ["t.accumulators", "t.parameters", "t.updates"]
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    b = batch(rng)
    for shards in (1, 4):
        other = me.torch.EmbeddingCollection(config("adadelta"), num_shards=shards, seed=9)
        other.load_state_dict(loaded)
        for k, v in other.state_dict().items():
            torch.testing.assert_close(v, sd[k], rtol=0, atol=0)
        loss_of(other(*module_inputs(*b)).values()).backward()
        if shards == 1:
            first = other.state_dict()
        else:
            for k, v in other.state_dict().items():
                torch.testing.assert_close(v, first[k], rtol=0, atol=0)
    # nested in a model: prefixed keys; a wrong shape is refused before anything is written
    model = torch.nn.ModuleDict({"emb": me.torch.EmbeddingCollection(config("adadelta")), "lin": torch.nn.Linear(2, 1)})
    full = model.state_dict()
    assert "emb.t.parameters" in full and "lin.weight" in full
    bad = dict(full, **{"emb.t.updates": torch.zeros(VOCAB - 1, DIM)})
    bad["emb.t.parameters"] = torch.ones(VOCAB, DIM)
    with pytest.raises(me.InputError, match="emb.t.updates"):
        model.load_state_dict(bad)
    torch.testing.assert_close(model["emb"].state_dict()["t.parameters"], full["emb.t.parameters"], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="Missing key.*emb.t.accumulators"):
        model.load_state_dict({k: v for k, v in full.items() if k != "emb.t.accumulators"})
    # portable checkpoints: the module's save restores into the engine and back
    path = ec.save(tmp_path / "ckpt")
    emb = me.TPUEmbedding.restore(path, backend="numpy")
    np.testing.assert_array_equal(emb.retrieve_parameters("t")["parameters"], sd["t.parameters"].numpy())
    back = me.torch.EmbeddingCollection.restore(path, num_shards=3)
    torch.testing.assert_close(back.state_dict()["t.updates"], sd["t.updates"], rtol=0, atol=0)


def test_dynamic_learning_rate():
    rng = np.random.default_rng(6)
    opt = me.embedding.Adagrad(learning_rate=me.embedding.DynamicLearningRate(0))
    ec = me.torch.EmbeddingCollection(config(opt))
    emb = me.TPUEmbedding(config(opt), backend="torch")
    for step, lr in enumerate([0.1, 0.05, 0.2]):
        b = batch(rng)
        feats, ws = module_inputs(*b)
        if step == 1:  # per batch, as a forward argument
            out = ec(feats, ws, learning_rates=torch.tensor([lr]))
        else:
            ec.set_learning_rates([lr])
            out = ec(feats, ws)
        loss_of(out.values()).backward()
        emb.enqueue([me.RaggedIds(b[1], b[0]), b[3]], [me.RaggedIds(b[1], b[2]), None])
        acts = [a.requires_grad_() for a in emb.dequeue()]
        loss_of(acts).backward()
        emb.apply_gradients([a.grad for a in acts], learning_rates=[lr])
        assert_same_tables(ec, emb)
    with pytest.raises(me.InputError, match="learning_rates"):
        ec.set_learning_rates([0.1, 0.2])


class Tower(torch.nn.Module):
    def __init__(self, ec):
        super().__init__()
        self.ec = ec
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(DIM * (1 + SEQ), 1)

    def forward(self, feats, ws, target, lrs=None):
        out = self.ec(feats, ws, learning_rates=lrs)
        x = torch.cat([out["bag"], out["seq"].flatten(1)], dim=1)
        return ((self.lin(x).squeeze(1) - target) ** 2).mean()


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_compiled_fullgraph_equals_eager_and_engine(combiner):
    torch._dynamo.reset()
    rng = np.random.default_rng(7)
    cfg = config("adagrad", combiner)
    eager, compiled = Tower(me.torch.EmbeddingCollection(cfg)), Tower(me.torch.EmbeddingCollection(cfg))
    step = torch.compile(compiled, fullgraph=True, dynamic=False)  # fullgraph: a graph break raises
    target = torch.linspace(-1, 1, BATCH)
    for _ in range(3):
        b = batch(rng)
        le, lc = eager(*module_inputs(*b), target), step(*module_inputs(*b), target)
        torch.testing.assert_close(lc, le)
        le.backward()
        lc.backward()
        torch.testing.assert_close(compiled.lin.weight.grad, eager.lin.weight.grad)
        assert_same_tables(compiled.ec, eager.ec.engine)


def test_no_graph_break_and_no_recompile_with_changing_learning_rate():
    from torch._dynamo.testing import CompileCounter

    for name in ("sgd", "adagrad", "adadelta"):
        torch._dynamo.reset()
        rng = np.random.default_rng(8)
        lr = me.embedding.DynamicLearningRate(0)
        opt = {"sgd": lambda: me.embedding.SGD(learning_rate=lr), "adagrad": lambda: me.embedding.Adagrad(learning_rate=lr),
               "adadelta": lambda: me.embedding.Adadelta(learning_rate=lr, rho=0.9, epsilon=1e-6)}[name]()
        model = Tower(me.torch.EmbeddingCollection(config(opt, "mean")))
        counter = CompileCounter()
        step = torch.compile(model, backend=counter, fullgraph=True)
        target = torch.zeros(BATCH)
        explained = torch._dynamo.explain(model)(*module_inputs(*batch(rng)), target, torch.tensor([0.1]))
        assert explained.graph_break_count == 0, explained.break_reasons
        for k in range(6):
            lr = 0.1 / (k + 1)
            if k % 2:
                model.ec.set_learning_rates([lr])
                loss = step(*module_inputs(*batch(rng)), target)
            else:
                loss = step(*module_inputs(*batch(rng)), target, torch.tensor([lr]))
            loss.backward()
            if k == 2:
                warm = counter.frame_count
        assert counter.frame_count == warm, f"{name}: recompiled after warm-up"


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]


def _grads(step, params):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def test_adadelta_matches_meshembed_optimizer_exactly_and_torch_optim_within_rounding():
    hyper = dict(lr=1.0, rho=0.9, eps=1e-6)
    ours, theirs, ref = _params(), _params(), _params()
    opt = me.torch.Adadelta(ours, **hyper)
    topt = torch.optim.Adadelta(theirs, **hyper)
    variables = [me.Variable(p.detach().clone(), name=f"v{k}", backend="torch") for k, p in enumerate(ref)]
    mopt = me.optimizers.Adadelta(learning_rate=1.0, rho=0.9, epsilon=1e-6)
    for step in range(10):
        grads = _grads(step, ours)
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        topt.step()
        mopt.apply_gradients([(g.clone(), v) for g, v in zip(grads, variables)])
        for p, q, v in zip(ours, theirs, variables):
            np.testing.assert_array_equal(p.detach().numpy(), v.numpy())
            torch.testing.assert_close(p.detach(), q.detach(), rtol=4e-6, atol=1e-6)
    for p, q in zip(ours, theirs):  # the state under torch's names
        s, t = opt.state_dict()["state"], topt.state_dict()["state"]
        for k in (0, 1):
            torch.testing.assert_close(s[k]["square_avg"], t[k]["square_avg"], rtol=4e-6, atol=1e-7)
            torch.testing.assert_close(s[k]["acc_delta"], t[k]["acc_delta"], rtol=4e-6, atol=1e-7)
    assert int(s[0]["step"]) == 10


def test_adadelta_defaults_state_dict_maximize_and_errors():
    ours, ref = _params(1), _params(1)
    opt = me.torch.Adadelta(ours)  # Keras' defaults
    mopt = me.optimizers.Adadelta()
    variables = [me.Variable(p.detach().clone(), backend="torch") for p in ref]
    for step in range(3):
        grads = _grads(step, ours)
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        opt.step()
        mopt.apply_gradients([(g.clone(), v) for g, v in zip(grads, variables)])
    for p, v in zip(ours, variables):
        np.testing.assert_array_equal(p.detach().numpy(), v.numpy())
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    again = me.torch.Adadelta(copies)
    again.load_state_dict(torch.load(buf, weights_only=True))
    grads = _grads(7, ours)
    for p, q, g in zip(ours, copies, grads):
        p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    again.step()
    for p, q in zip(ours, copies):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    # maximize: the same as minimizing the negated gradient
    a, b = _params(2), _params(2)
    oa, ob = me.torch.Adadelta(a, lr=1.0, maximize=True), me.torch.Adadelta(b, lr=1.0)
    for p, q, g in zip(a, b, _grads(0, a)):
        p.grad, q.grad = g.clone(), -g
    oa.step()
    ob.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    oa.zero_grad()
    assert all(p.grad is None for p in a)
    with pytest.raises(me.ConfigError, match="rho"):
        me.torch.Adadelta(_params(), rho=1.5)
    with pytest.raises(me.InputError, match="floating"):
        me.torch.Adadelta([torch.zeros(3, dtype=torch.int64)])


def test_compiled_jagged_input_and_compiled_autograd_equal_eager():
    """torch.nested jagged ids compile whole; torch's compiled autograd also takes the backward
    (the update op runs inside the compiled backward graph; with (values, offsets) inputs:
    torch 2.13's compiled autograd fails on jagged tensors' nested ints). Sparse COO tensors
    cannot enter torch.compile at all (dynamo refuses them): an eager-only form."""
    from torch._dynamo import compiled_autograd

    torch._dynamo.reset()
    rng = np.random.default_rng(9)
    cfg = config("adagrad", "sqrtn")
    eager, compiled = Tower(me.torch.EmbeddingCollection(cfg)), Tower(me.torch.EmbeddingCollection(cfg))
    step = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    target = torch.linspace(-1, 1, BATCH)
    for k in range(4):
        values, offsets, weights, seq = batch(rng)
        le = eager(*module_inputs(values, offsets, weights, seq), target)
        le.backward()
        if k % 2 == 0:
            v, o = torch.from_numpy(values), torch.from_numpy(offsets)
            feats = {"bag": torch.nested.nested_tensor_from_jagged(v, o), "seq": torch.from_numpy(seq)}
            ws = {"bag": torch.nested.nested_tensor_from_jagged(torch.from_numpy(weights), o)}
            lc = step(feats, ws, target)
            lc.backward()
        else:
            with compiled_autograd._enable(torch.compile(backend="aot_eager", fullgraph=True)):
                lc = step(*module_inputs(values, offsets, weights, seq), target)
                lc.backward()
        torch.testing.assert_close(lc, le)
        assert_same_tables(compiled.ec, eager.ec.engine)
    assert compiled.ec._batches == {}


def _conformance():
    from conformance import test_engine_optimizers as conf

    return conf


def _conformance_run(name, option, compiled):
    """The conformance optimizer case through the module, and through TPUEmbedding(torch)."""
    conf = _conformance()
    case = conf.CASES[name]
    table0 = np.random.default_rng(7).uniform(-0.5, 0.5, (conf.V, conf.D)).astype(np.float32)
    kw = dict(conf.OPTIONS[option])
    dynamic = option == "dynamic_lr"
    lr = me.embedding.DynamicLearningRate(0) if dynamic else conf.LRS[0]
    if case["dynamic"]:
        kw["_tag"] = int(dynamic)
    cfg = conf._config(case["spec"](lr, **kw))
    ec = me.torch.EmbeddingCollection(cfg, num_shards=2, initializers={"t": table0})
    emb = me.TPUEmbedding(cfg, backend="torch", num_shards=2, initializers={"t": table0})

    def step_fn(feats, weights, grads, lrs):
        out = ec(feats, weights, learning_rates=lrs)
        return (out["multi"] * grads[0]).sum() + (out["dense"] * grads[1]).sum()

    step = torch.compile(step_fn, fullgraph=True, backend="aot_eager") if compiled else step_fn
    for s in range(conf.STEPS):
        feats, weights = conf._inputs(s)
        grads = conf._gradients(s, case["grad_scale"])
        lrs = ([np.float32(conf.LRS[s])] if dynamic else []) + ([np.float32(10 + s)] if case["dynamic"] else [])
        tf = {"multi": (torch.from_numpy(np.asarray(feats[0].values)), torch.from_numpy(feats[0].row_splits)),
              "dense": torch.from_numpy(feats[1])}
        tw = {"multi": torch.from_numpy(np.asarray(weights[0].values))}
        step(tf, tw, [torch.from_numpy(g) for g in grads], torch.tensor(lrs, dtype=torch.float64) if lrs else None
             ).backward()
        emb.enqueue(feats, weights)
        emb.dequeue()
        emb.apply_gradients(grads, learning_rates=lrs)
        assert_same_tables(ec, emb)


def _conformance_params():
    try:
        return _conformance().PARAMS
    except Exception as exc:  # noqa: BLE001 - the suite's module must import here
        pytest.fail(f"conformance.test_engine_optimizers does not import: {exc}")


@pytest.mark.parametrize("name,option", _conformance_params(), ids=lambda v: str(v))
def test_conformance_training_cases_through_the_module(name, option):
    _conformance_run(name, option, compiled=False)


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adadelta", "ftrl", "adam_lazy_sum_inside_sqrt"])
def test_conformance_training_cases_through_the_compiled_module(name):
    torch._dynamo.reset()
    _conformance_run(name, "dynamic_lr", compiled=True)


def test_custom_ops_schema_and_fake_kernels():
    """torch.library.opcheck: schema and fake (meta) kernel agree with the real op (the
    AOT checks assume a stateless op; this one updates tables, so they do not apply)."""
    ec = me.torch.EmbeddingCollection(config())
    values, offsets, _, seq = batch(np.random.default_rng(10))
    tensors = [torch.from_numpy(values), torch.from_numpy(offsets), torch.from_numpy(seq)]
    for spec, anchor in (("o;d|T", ec.anchor), ("o;d|I", ec.anchor.detach())):
        spec = ec._signature + "/" + spec  # the compiled op's spec: the module's outputs first
        torch.library.opcheck(torch.ops.meshembed.ec_lookup.default, (ec._handle, spec, anchor, tensors, None),
                              test_utils=("test_schema", "test_faketensor"))
    assert ec._batches == {}


def test_backward_errors_leave_the_tables_unchanged():
    rng = np.random.default_rng(11)
    ec = me.torch.EmbeddingCollection(config())
    before = ec.state_dict()
    out = ec(*module_inputs(*batch(rng)))
    with pytest.raises(me.InputError, match="NaN or Inf"):
        (out["bag"].sum() * float("nan") + out["seq"].sum()).backward()
    for k, v in ec.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    out = ec(*module_inputs(*batch(rng)))
    loss = loss_of(out.values())
    loss.backward(retain_graph=True)
    after_one = ec.state_dict()
    with pytest.raises(me.StateError, match="one backward per training forward"):
        loss.backward()
    for k, v in ec.state_dict().items():
        torch.testing.assert_close(v, after_one[k], rtol=0, atol=0)
    assert not torch.equal(after_one["t.parameters"], before["t.parameters"])


def test_benchmark_runs_tiny():
    from benchmarks import torch_api_w1
    from benchmarks.common import TINY_W1, TINY_W2

    from benchmarks import torch_module_w1

    results, skipped = torch_module_w1.measure(TINY_W1, repeats=1, rounds=1, warmup=1, optimizers=("sgd",))
    for impl in ("module", "module+compile", "engine"):
        wall, lo, hi, cpu = results[("sgd", impl)]
        assert lo <= wall <= hi and cpu > 0
    assert ("sgd", "fbgemm") in results or "fbgemm" in skipped[("sgd", "fbgemm")]
    text = torch_module_w1.table(results, ("sgd",))  # the W1 script's side-by-side table
    assert text.splitlines()[0].split() == ["optimizer", *torch_api_w1.IMPLS]
    assert "module+compile  / engine" in text and ("skipped" in text) == (("sgd", "fbgemm") in skipped)
    rows = torch_api_w1.w2(TINY_W2, repeats=1, counts=(2,), warmup=1)
    assert all(r.median_ms > 0 for r in rows)


def test_deepcopy_is_an_independent_module():
    import copy

    rng = np.random.default_rng(12)
    ec = me.torch.EmbeddingCollection(config("adagrad"), num_shards=2)
    loss_of(ec(*module_inputs(*batch(rng))).values()).backward()
    twin = copy.deepcopy(ec)
    assert twin._handle != ec._handle and twin.engine is not ec.engine and twin.engine.step == ec.engine.step
    b = batch(rng)
    loss_of(ec(*module_inputs(*b)).values()).backward()
    loss_of(twin(*module_inputs(*b)).values()).backward()
    assert_same_tables(twin, ec.engine)
    before = ec.state_dict()["t.parameters"]
    loss_of(twin(*module_inputs(*batch(rng))).values()).backward()  # trains the copy only
    torch.testing.assert_close(ec.state_dict()["t.parameters"], before, rtol=0, atol=0)
    assert not torch.equal(twin.state_dict()["t.parameters"], before)


def test_adadelta_follows_a_torch_lr_scheduler():
    ours, ref = _params(3), _params(3)
    opt = me.torch.Adadelta(ours, lr=1.0, rho=0.9, eps=1e-6)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    variables = [me.Variable(p.detach().clone(), backend="torch") for p in ref]
    mopt = me.optimizers.Adadelta(learning_rate=1.0, rho=0.9, epsilon=1e-6)
    for step in range(5):
        grads = _grads(step, ours)
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        mopt.learning_rate = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        mopt.apply_gradients([(g.clone(), v) for g, v in zip(grads, variables)])
    assert opt.param_groups[0]["lr"] == 0.25
    for p, v in zip(ours, variables):
        np.testing.assert_array_equal(p.detach().numpy(), v.numpy())


# -- nested configs (TF's feature_config nests, dict-of-features configs) ----------------------
def _nest_config():
    import collections

    pair = collections.namedtuple("Pair", ["left", "right"])
    table = me.tpu.TableConfig(vocabulary_size=VOCAB, dim=DIM, name="t", combiner="mean")
    other = me.tpu.TableConfig(vocabulary_size=VOCAB + 3, dim=DIM, name="o", combiner="sum",
                               optimizer=me.tpu.SGD(learning_rate=0.5))
    return pair, {"user": me.tpu.FeatureConfig(table, output_shape=(BATCH,)),
                  "towers": pair(me.tpu.FeatureConfig(other), (me.tpu.FeatureConfig(table, max_sequence_length=SEQ),))}


def _nest_inputs(pair, rng):
    values, offsets, weights, seq = batch(rng)
    dense = rng.integers(0, VOCAB + 3, size=BATCH)
    torch_in = {"user": (torch.from_numpy(values), torch.from_numpy(offsets)),
                "towers": pair(torch.from_numpy(dense), (torch.from_numpy(seq),))}
    torch_w = {"user": torch.from_numpy(weights), "towers": pair(None, (None,))}
    tf_in = {"user": me.RaggedIds(offsets, values), "towers": pair(dense, (seq[..., None],))}
    tf_w = {"user": me.RaggedIds(offsets, weights), "towers": pair(None, (None,))}
    return torch_in, torch_w, tf_in, tf_w


def _nest_loss(out):
    return ((out["user"] - 0.3) ** 2).sum() + (out["towers"].left ** 2).sum() + out["towers"].right[0].sum()


def test_nested_feature_config_in_and_out_like_tf_eager_and_compiled():
    """A TF feature_config nest: forward takes and returns it (namedtuples included, dict in
    the config's key order), eager and under torch.compile(fullgraph=True) with no graph
    break, training bit-identical to me.tpu.TPUEmbedding(backend="torch")."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    pair, nest = _nest_config()
    opt = me.tpu.Adagrad(learning_rate=0.1)
    eager = me.torch.EmbeddingCollection(nest, optimizer=opt, batch_size=BATCH, seed=3)
    compiled = me.torch.EmbeddingCollection(nest, optimizer=opt, batch_size=BATCH, seed=3)
    tf = me.tpu.TPUEmbedding(nest, opt, backend="torch", seed=3)
    assert eager.feature_names == ["towers/left", "towers/right/0", "user"]
    counter = CompileCounter()
    step = torch.compile(lambda x, w: _nest_loss(compiled(x, w)), backend=counter, fullgraph=True)
    rng = np.random.default_rng(20)
    explained = torch._dynamo.explain(lambda x, w: _nest_loss(compiled.eval()(x, w)))(*_nest_inputs(pair, rng)[:2])
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled.train()
    for k in range(4):
        x, w, tx, tw = _nest_inputs(pair, rng)
        out = eager(x, w)
        assert list(out) == ["user", "towers"] and type(out["towers"]) is pair
        assert isinstance(out["towers"].right, tuple) and out["towers"].right[0].shape == (BATCH, SEQ, DIM)
        tf.enqueue(tx, tw)
        want = tf.dequeue()
        for got, ref in ((out["user"], want["user"]), (out["towers"].left, want["towers"].left),
                         (out["towers"].right[0], want["towers"].right[0])):
            torch.testing.assert_close(got, ref, rtol=0, atol=0)
        grads = {k: v for k, v in want.items()}
        acts = [want["user"].requires_grad_(), want["towers"].left.requires_grad_(),
                want["towers"].right[0].requires_grad_()]
        _nest_loss(want).backward()
        tf.apply_gradients({"user": acts[0].grad, "towers": pair(acts[1].grad, (acts[2].grad,))})
        _nest_loss(out).backward()
        step(x, w).backward()
        del grads
        if k == 1:  # warm: the second batch's new id count made the shapes dynamic
            warm = counter.frame_count
        for name in ("t", "o"):
            for k, v in tf.engine.retrieve_parameters(name).items():
                np.testing.assert_array_equal(eager.engine.retrieve_parameters(name)[k], v, err_msg=k)
                np.testing.assert_array_equal(compiled.engine.retrieve_parameters(name)[k], v, err_msg=k)
    assert counter.frame_count == warm


def test_nested_config_errors_name_the_path_and_the_fix():
    pair, nest = _nest_config()
    opt = me.tpu.SGD(learning_rate=0.1)
    with pytest.raises(me.ConfigError, match=r"\['towers/left', 'towers/right/0'\].*batch_size="):
        me.torch.EmbeddingCollection(nest, optimizer=opt)
    with pytest.raises(me.ConfigError, match="optimizer"):
        me.torch.EmbeddingCollection(nest, batch_size=BATCH)
    with pytest.raises(me.ConfigError, match="`batch_size`.*EmbeddingConfig"):
        me.torch.EmbeddingCollection(config(), batch_size=BATCH)
    with pytest.raises(me.ConfigError, match="EmbeddingConfig or a nest"):
        me.torch.EmbeddingCollection("t")
    with pytest.raises(me.ConfigError, match="initializer"):
        me.torch.EmbeddingCollection(nest, optimizer=opt, batch_size=BATCH, initializers={"t": "zeros"})
    ec = me.torch.EmbeddingCollection(nest, optimizer=opt, batch_size=BATCH)
    before = ec.state_dict()
    x, w, _, _ = _nest_inputs(pair, np.random.default_rng(21))
    with pytest.raises(me.InputError, match="path 'towers'.*2 entries"):
        ec({"user": x["user"], "towers": (x["towers"].left,)})
    with pytest.raises(me.InputError, match="path 'towers': expected a Pair.*Received: a dict"):
        ec({"user": x["user"], "towers": {"left": x["towers"].left}})
    with pytest.raises(me.InputError, match="Missing: \\['user'\\]"):
        ec({"towers": x["towers"]})
    bad = {"user": x["user"], "towers": pair(torch.full((BATCH,), VOCAB + 3), x["towers"].right)}
    with pytest.raises(me.InputError, match="towers/left"):
        ec(bad, w)
    for k, v in ec.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_dict_config_outputs_keyed_by_its_keys_in_the_order_given():
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", VOCAB, DIM, optimizer=me.embedding.SGD(learning_rate=0.1), combiner="sum")],
        features={"z_seq": me.FeatureConfig("t", (BATCH, SEQ)), "a_bag": me.FeatureConfig("t", (BATCH,), name="bag")})
    ec = me.torch.EmbeddingCollection(cfg).eval()
    emb = me.TPUEmbedding(cfg, backend="torch")
    values, offsets, _, seq = batch(np.random.default_rng(22))
    out = ec({"a_bag": (torch.from_numpy(values), torch.from_numpy(offsets)), "z_seq": torch.from_numpy(seq)})
    assert list(out) == ["z_seq", "a_bag"]
    emb.enqueue({"a_bag": me.RaggedIds(offsets, values), "z_seq": seq}, training=False)
    want = emb.dequeue()
    for k in out:
        torch.testing.assert_close(out[k], want[k], rtol=0, atol=0)
    with pytest.raises(me.InputError, match="Missing: \\['z_seq'\\]"):
        ec({"a_bag": out["a_bag"]})


# -- .to(device) / .cpu() / dtype conversions ------------------------------------------------
def test_to_device_moves_tables_and_refuses_what_cannot_be_done():
    rng = np.random.default_rng(23)
    ec = me.torch.EmbeddingCollection(config("adagrad"), num_shards=2)
    twin = me.torch.EmbeddingCollection(config("adagrad"), num_shards=2)
    loss_of(ec(*module_inputs(*batch(rng))).values()).backward()
    before = ec.state_dict()
    model = torch.nn.ModuleDict({"emb": ec, "lin": torch.nn.Linear(2, 1)})
    assert model.to("cpu") is model and ec.cpu() is ec and ec.float() is ec
    assert model.to(torch.device("cpu"), torch.float32) is model
    refused = {
        "dtype": (lambda: model.to(torch.float64), "keep their dtype \\(torch.float32\\).*dense part only"),
        "double": (lambda: model.double(), "keep their dtype"),
        "half": (lambda: ec.half(), "keep their dtype"),
        "meta": (lambda: ec.to("meta"), "meta device: its tables are data"),
    }
    if not torch.cuda.is_available():
        refused["cuda"] = (lambda: ec.cuda(), "cannot apply this conversion.*CUDA")
    for what, (call, match) in refused.items():
        with pytest.raises(me.ConfigError, match=match):
            call()
        after = ec.state_dict()
        for k in before:
            torch.testing.assert_close(after[k], before[k], rtol=0, atol=0, msg=what)
        assert ec.anchor.device.type == "cpu" and ec.engine.backend.device.type == "cpu"
    # the move itself (only the CPU here): a fresh backend, every table and slot moved, the
    # module training on exactly as before; refused while a backward is pending
    out = twin(*module_inputs(*batch(np.random.default_rng(23))))
    with pytest.raises(me.StateError, match="backward.*pending"):
        twin._move_tables(torch.device("cpu"))
    loss_of(out.values()).backward()
    old_backend = twin.engine.backend
    twin._move_tables(torch.device("cpu"))
    assert twin.engine.backend is not old_backend and twin.anchor.requires_grad
    for k, v in twin.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    for _ in range(2):
        b = batch(rng)
        loss_of(ec(*module_inputs(*b)).values()).backward()
        loss_of(twin(*module_inputs(*b)).values()).backward()
    assert_same_tables(twin, ec.engine)


def test_sparse_coo_compiles_as_sparse_ids_of_its_tensors():
    """A COO tensor cannot enter a compiled region (dynamo refuses to wrap it), but its
    indices and values, taken outside, compile with no graph break as me.SparseIds and train
    exactly as the eager COO input does."""
    torch._dynamo.reset()
    rng = np.random.default_rng(24)
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", VOCAB, DIM, optimizer=me.embedding.Adagrad(learning_rate=0.1), combiner="sqrtn")],
        features=[me.FeatureConfig("t", (BATCH,), name="bag")])
    eager, compiled = me.torch.EmbeddingCollection(cfg), me.torch.EmbeddingCollection(cfg)

    def coo_batch():
        values, offsets, weights, _ = batch(rng)
        rows = np.repeat(np.arange(BATCH), np.diff(offsets))
        idx = torch.from_numpy(np.stack([rows, np.arange(values.shape[0]) - offsets[rows]]))
        size = (BATCH, max(int(np.diff(offsets).max()), 1))
        return torch.sparse_coo_tensor(idx, torch.from_numpy(values), size), torch.from_numpy(weights)

    def step(indices, values, weights):
        out = compiled({"bag": me.SparseIds(indices, values, (BATCH, 5))},
                       {"bag": me.SparseIds(indices, weights, (BATCH, 5))})
        return ((out["bag"] - 0.3) ** 2).sum(), out["bag"]

    x, w = coo_batch()
    explained = torch._dynamo.explain(step)(x._indices().t(), x._values(), w)
    assert explained.graph_break_count == 0, explained.break_reasons
    fn = torch.compile(step, fullgraph=True)
    for _ in range(3):
        x, w = coo_batch()
        x = torch.sparse_coo_tensor(x._indices(), x._values(), (BATCH, 5))
        act = eager({"bag": x}, {"bag": torch.sparse_coo_tensor(x._indices(), w, (BATCH, 5))})["bag"]
        le = ((act - 0.3) ** 2).sum()
        lc, got = fn(x._indices().t(), x._values(), w)
        torch.testing.assert_close(got, act, rtol=0, atol=0)  # the loss: inductor sums in its own order
        torch.testing.assert_close(lc, le)
        le.backward()
        lc.backward()
        assert_same_tables(compiled, eager.engine)
    with pytest.raises(Exception, match="sparse"):  # torch's own limit, documented in the class
        torch.compile(lambda coo: eager({"bag": coo})["bag"].sum(), fullgraph=True)(x)
