"""me.torch.EmbeddingCollection as PyTorch users expect it (issues 35 and 31).

Partial DataLoader batches, learnable per-id weights (against nn.EmbeddingBag), list / dict
learning rates and meshembed errors under torch.compile, the parameters / buffers story and
the EmbeddingBagCollection name, atomic load_state_dict, threads, fused_optimizer=False with a
NaN in a later batch, and meshembed errors (never raw ones) for odd calls.
"""

from __future__ import annotations

import copy
import io
import pickle
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import meshembed as me  # noqa: E402

VOCAB, DIM, BATCH, SEQ = 50, 4, 6, 3


def config(optimizer=None, combiner="mean", batch=BATCH, tables=1):
    opt = optimizer or me.embedding.Adagrad(learning_rate=0.1)
    tabs = [me.TableConfig("t", VOCAB, DIM, optimizer=opt, combiner=combiner)]
    feats = [me.FeatureConfig("t", (batch,), name="bag"), me.FeatureConfig("t", (batch, SEQ), name="seq")]
    if tables == 2:
        tabs.append(me.TableConfig("u", VOCAB + 7, DIM + 1, optimizer=me.embedding.SGD(learning_rate=0.5),
                                   combiner="sum"))
        feats.append(me.FeatureConfig("u", (batch,), name="other"))
    return me.EmbeddingConfig(tables=tabs, features=feats)


def ragged(rng, samples, max_len=5):
    lengths = rng.integers(0, max_len, size=samples)
    values = rng.integers(0, VOCAB, size=int(lengths.sum()))
    return values, np.concatenate([[0], np.cumsum(lengths)])


def loss_of(acts):
    return sum(((a - 0.3) ** 2).sum() for a in acts)


def tables_of(ec_or_engine):
    engine = getattr(ec_or_engine, "engine", ec_or_engine)
    return {t: engine.retrieve_parameters(t) for t in engine.table_names}


def assert_tables_equal(a, b):
    for t, arrays in tables_of(a).items():
        other = tables_of(b)[t]
        for k in arrays:
            np.testing.assert_array_equal(arrays[k], other[k], err_msg=f"{t}.{k}")


# -- #35.6: the last, partial batch of a DataLoader trains -----------------------------------
class _Samples(torch.utils.data.Dataset):
    def __init__(self, n):
        rng = np.random.default_rng(30)
        self.items = []
        for _ in range(n):
            k = int(rng.integers(0, 5))
            self.items.append((torch.from_numpy(rng.integers(0, VOCAB, k)), torch.from_numpy(rng.integers(0, VOCAB, SEQ))))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _collate(items):
    """Variable-length bags as me.RaggedIds of tensors (samples + 1 row splits), the sequence
    feature dense [samples, SEQ]."""
    bags = [b for b, _ in items]
    splits = torch.tensor([0] + np.cumsum([len(b) for b in bags]).tolist(), dtype=torch.int64)
    values = torch.cat(bags) if bags else torch.zeros(0, dtype=torch.int64)
    return {"bag": me.RaggedIds(splits, values), "seq": torch.stack([s for _, s in items])}


def _engine_step(emb, batch):
    emb.enqueue({"bag": batch["bag"], "seq": batch["seq"].numpy()} if emb.layout.keys else
                [me.RaggedIds(batch["bag"].row_splits.numpy(), batch["bag"].values.numpy()), batch["seq"].numpy()])
    acts = [a.requires_grad_() for a in emb.dequeue()]
    loss_of(acts).backward()
    emb.apply_gradients([a.grad for a in acts])
    return acts


@pytest.mark.parametrize("compiled", [False, True])
def test_dataloader_partial_last_batch_trains_like_an_engine_of_that_batch_size(compiled):
    torch._dynamo.reset()
    loader = torch.utils.data.DataLoader(_Samples(17), batch_size=BATCH, shuffle=False, drop_last=False,
                                         collate_fn=_collate)
    ec = me.torch.EmbeddingCollection(config(), seed=5)
    forward = torch.compile(ec, fullgraph=True) if compiled else ec
    full = me.TPUEmbedding(config(), backend="torch", seed=5)
    sizes = []
    for batch in loader:
        b = batch["seq"].shape[0]
        sizes.append(b)
        out = forward({"bag": batch["bag"], "seq": batch["seq"]})
        assert out["bag"].shape == (b, DIM) and out["seq"].shape == (b, SEQ, DIM)
        if b == BATCH:
            ref = _engine_step(full, batch)
        else:  # the same tables in an engine configured for b samples
            small = me.TPUEmbedding(config(batch=b), backend="torch")
            small.load_tables(tables_of(full))
            ref = _engine_step(small, batch)
            full = small
        torch.testing.assert_close(out["bag"], ref[0].detach(), rtol=0, atol=0)
        torch.testing.assert_close(out["seq"], ref[1].detach(), rtol=0, atol=0)
        loss_of(out.values()).backward()
        assert_tables_equal(ec, full)
    assert sizes == [6, 6, 5] and ec.engine.step == 3 and ec._batches == {}


def test_every_smaller_batch_form_equals_ragged_ids():
    """A batch of 4 (capacity 6) as row splits, a jagged tensor, COO (tensor and SparseIds)
    and dense ids: the same activations and the same update."""
    rng = np.random.default_rng(31)
    b = 4
    values, offsets = ragged(rng, b)
    seq = rng.integers(0, VOCAB, (b, SEQ))
    weights = rng.uniform(0.5, 2, values.shape[0]).astype(np.float32)
    v, o, w = torch.from_numpy(values), torch.from_numpy(offsets), torch.from_numpy(weights)
    rows = np.repeat(np.arange(b), np.diff(offsets))
    idx = torch.from_numpy(np.stack([rows, np.arange(values.shape[0]) - offsets[rows]]))
    forms = {
        "RaggedIds": (me.RaggedIds(o, v), me.RaggedIds(o, w)),
        "jagged": (torch.nested.nested_tensor_from_jagged(v, o), torch.nested.nested_tensor_from_jagged(w, o)),
        "coo": (torch.sparse_coo_tensor(idx, v, (b, 5)), torch.sparse_coo_tensor(idx, w, (b, 5))),
        "SparseIds": (me.SparseIds(idx.t(), v, (b, 5)), me.SparseIds(idx.t(), w, (b, 5))),
    }
    small = me.TPUEmbedding(config(batch=b), backend="torch", seed=1)
    small.enqueue([me.RaggedIds(offsets, values), seq], [me.RaggedIds(offsets, weights), None])
    want = [a.requires_grad_() for a in small.dequeue()]
    loss_of(want).backward()
    small.apply_gradients([a.grad for a in want])
    for name, (x, wx) in forms.items():
        ec = me.torch.EmbeddingCollection(config(), seed=1)
        out = ec({"bag": x, "seq": torch.from_numpy(seq)}, {"bag": wx})
        torch.testing.assert_close(out["bag"], want[0].detach(), rtol=0, atol=0, msg=name)
        torch.testing.assert_close(out["seq"], want[1].detach(), rtol=0, atol=0, msg=name)
        loss_of(out.values()).backward()
        assert_tables_equal(ec, small)
    # dense ids [b] of a pooled feature and [b, SEQ, 1]
    ec = me.torch.EmbeddingCollection(config(combiner="sum")).eval()
    ids = torch.from_numpy(rng.integers(0, VOCAB, b))
    got = ec({"bag": ids, "seq": torch.from_numpy(seq)[..., None]})
    table = torch.from_numpy(tables_of(ec)["t"]["parameters"])
    torch.testing.assert_close(got["bag"], table[ids], rtol=0, atol=0)
    torch.testing.assert_close(got["seq"], table[torch.from_numpy(seq)], rtol=0, atol=0)


def test_offsets_of_a_smaller_batch_are_never_read_as_lengths():
    rng = np.random.default_rng(32)
    ec = me.torch.EmbeddingCollection(config())
    before = tables_of(ec)
    seq = torch.from_numpy(rng.integers(0, VOCAB, (BATCH, SEQ)))
    values, offsets = ragged(rng, BATCH - 1, max_len=4)
    offsets[1:] += 1  # no sample is empty at the front: not valid lengths as well
    values = np.concatenate([[3], values])
    v, o = torch.from_numpy(values), torch.from_numpy(offsets)
    assert o.shape[0] == BATCH  # B-1 samples' offsets have as many entries as B lengths
    with pytest.raises(me.InputError, match=r"'bag'.*batch size\).*offsets of 5 samples.*me.RaggedIds"):
        ec({"bag": (v, o), "seq": seq})
    v2, o2 = ragged(rng, BATCH - 3)
    with pytest.raises(me.InputError, match=r"'bag'.*7 offsets or 6 lengths for the batch size 6.*Received: 4 entries"):
        ec({"bag": (torch.from_numpy(v2), torch.from_numpy(o2)), "seq": seq})
    with pytest.raises(me.InputError, match="'seq'.*7 samples, more than the batch size 6"):
        ec({"bag": me.RaggedIds(o, v), "seq": torch.zeros(BATCH + 1, SEQ, dtype=torch.int64)})
    with pytest.raises(me.InputError, match="'bag'.*8 samples, more than the batch size 6"):
        ec({"bag": me.RaggedIds(torch.arange(9), torch.arange(8)), "seq": seq})
    assert_tables_equal(ec, me.TPUEmbedding(config(), backend="torch"))  # nothing trained
    del before
    # the same offsets as row splits: read as the 5 samples they are
    out = ec({"bag": me.RaggedIds(o, v), "seq": seq[:5]})
    assert out["bag"].shape == (5, DIM)


# -- #35.7: per-sample weights that require grad ----------------------------------------------
def test_weight_gradients_equal_nn_embedding_bag_sum():
    rng = np.random.default_rng(40)
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", VOCAB, DIM, optimizer=me.embedding.SGD(learning_rate=0.1), combiner="sum")],
        features=[me.FeatureConfig("t", (BATCH,), name="bag")])
    ec = me.torch.EmbeddingCollection(cfg, seed=3)
    plain = me.torch.EmbeddingCollection(cfg, seed=3)
    bag = torch.nn.EmbeddingBag(VOCAB, DIM, mode="sum")
    for step in range(3):
        with torch.no_grad():
            bag.weight.copy_(torch.from_numpy(tables_of(ec)["t"]["parameters"]))
        values, offsets = ragged(rng, BATCH)
        v, o = torch.from_numpy(values), torch.from_numpy(offsets)
        w = torch.from_numpy(rng.uniform(0.5, 2, values.shape[0]).astype(np.float32)).requires_grad_()
        w_ref = w.detach().clone().requires_grad_()
        out = ec({"bag": (v, o)}, {"bag": w})["bag"]
        ref = bag(v, o[:-1], per_sample_weights=w_ref)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        target = torch.linspace(-1, 1, BATCH * DIM).reshape(BATCH, DIM)
        ((out - target) ** 2).sum().backward()
        ((ref - target) ** 2).sum().backward()
        torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6)
        # the table's update is the one without learnable weights
        ((plain({"bag": (v, o)}, {"bag": w.detach()})["bag"] - target) ** 2).sum().backward()
        assert_tables_equal(ec, plain)


def _reference_act(table, values, offsets, w, combiner, seq_len=None):
    """The weighted combiner in torch ops (autograd gives ∂/∂w)."""
    acts = []
    for s in range(offsets.shape[0] - 1):
        lo, hi = int(offsets[s]), int(offsets[s + 1])
        if seq_len is not None:
            rows = [table[values[k]] * w[k] for k in range(lo, min(hi, lo + seq_len))]
            rows += [torch.zeros(table.shape[1])] * (seq_len - len(rows))
            acts.append(torch.stack(rows))
            continue
        ws = w[lo:hi]
        total = (table[values[lo:hi]] * ws[:, None]).sum(0)
        norm = {"sum": torch.ones(()), "mean": ws.sum(), "sqrtn": (ws ** 2).sum().sqrt()}[combiner]
        acts.append(total / norm if hi > lo else total)
    return torch.stack(acts)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_weight_gradients_of_every_combiner_and_of_a_sequence_feature(combiner):
    """Pooled: ∂(Σ w r / N)/∂w for each combiner; sequence (positions past SEQ dropped):
    ∂(w r)/∂w, zero for the dropped ids; eager and compiled alike, eval() too."""
    torch._dynamo.reset()
    rng = np.random.default_rng(41)
    for compiled in (False, True):
        ec = me.torch.EmbeddingCollection(config(combiner=combiner), seed=2)
        fn = torch.compile(ec, fullgraph=True) if compiled else ec
        for mode in ("train", "eval"):
            ec.train(mode == "train")
            table = torch.from_numpy(tables_of(ec)["t"]["parameters"])
            values, offsets = ragged(rng, BATCH, max_len=6)
            svalues, soffsets = ragged(rng, BATCH, max_len=6)
            w = torch.from_numpy(rng.uniform(0.5, 2, values.shape[0]).astype(np.float32)).requires_grad_()
            sw = torch.from_numpy(rng.uniform(0.5, 2, svalues.shape[0]).astype(np.float32)).requires_grad_()
            out = fn({"bag": me.RaggedIds(torch.from_numpy(offsets), torch.from_numpy(values)),
                      "seq": me.RaggedIds(torch.from_numpy(soffsets), torch.from_numpy(svalues))},
                     {"bag": w, "seq": sw})
            wr, swr = w.detach().clone().requires_grad_(), sw.detach().clone().requires_grad_()
            ref = [_reference_act(table, values, offsets, wr, combiner),
                   _reference_act(table, svalues, soffsets, swr, "sum", seq_len=SEQ)]
            torch.testing.assert_close(out["bag"], ref[0], rtol=1e-5, atol=1e-6)
            if combiner == "sum":
                torch.testing.assert_close(out["seq"], ref[1], rtol=1e-5, atol=1e-6)
            loss_of(out.values()).backward()
            loss_of([ref[0], out["seq"].detach() * 0 + ref[1] if combiner == "sum" else ref[1]]).backward()
            torch.testing.assert_close(w.grad, wr.grad, rtol=1e-4, atol=1e-5)
            if combiner == "sum":  # a sequence slot holds one id: mean/sqrtn cancel its weight
                torch.testing.assert_close(sw.grad, swr.grad, rtol=1e-4, atol=1e-5)
            dropped = (np.arange(svalues.shape[0]) - np.repeat(soffsets[:-1], np.diff(soffsets))) >= SEQ
            assert dropped.any() and torch.all(sw.grad[torch.from_numpy(dropped)] == 0)
            assert ec._batches == {}
        assert ec.engine.step == 1  # the eval() forward trained nothing


# -- #35.8 / #31.2: learning rates as lists and dicts, errors under torch.compile ------------
def _dynamic_cfg():
    return config(me.embedding.Adagrad(learning_rate=me.embedding.DynamicLearningRate(0)))


def _inputs(rng, b=BATCH):
    values, offsets = ragged(rng, b)
    return {"bag": me.RaggedIds(torch.from_numpy(offsets), torch.from_numpy(values)),
            "seq": torch.from_numpy(rng.integers(0, VOCAB, (b, SEQ)))}


def _engine_apply(emb, feats, lr):
    emb.enqueue([me.RaggedIds(feats["bag"].row_splits.numpy(), feats["bag"].values.numpy()), feats["seq"].numpy()])
    acts = [a.requires_grad_() for a in emb.dequeue()]
    loss_of(acts).backward()
    emb.apply_gradients([a.grad for a in acts], learning_rates=[lr])


def test_list_and_dict_learning_rates_compile_once_and_read_by_tag():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    rng = np.random.default_rng(50)
    ec = me.torch.EmbeddingCollection(_dynamic_cfg())
    emb = me.TPUEmbedding(_dynamic_cfg(), backend="torch")
    counter = CompileCounter()
    step = torch.compile(lambda f, lrs: loss_of(ec(f, learning_rates=lrs).values()), backend=counter, fullgraph=True)
    frames = []
    for k in range(10):  # a list of floats, then a {tag: value} dict, a new value every step
        lr = 0.1 / (k + 1)
        feats = _inputs(rng)
        step(feats, [lr] if k < 5 else {0: lr}).backward()
        _engine_apply(emb, feats, lr)
        assert_tables_equal(ec, emb)
        frames.append(counter.frame_count)
    # warm after the second call (which also makes the id counts dynamic); the dict's new
    # structure compiles once; no value recompiles
    assert frames[1] <= 2 and frames[1:5] == [frames[1]] * 4, frames
    assert frames[6] <= frames[1] + 1 and frames[6:] == [frames[6]] * 4, frames
    # eager: a dict is read by tag, never its keys as rates
    for lrs in ({0: 0.05}, [0.05], torch.tensor([0.05])):
        feats = _inputs(rng)
        loss_of(ec(feats, learning_rates=lrs).values()).backward()
        _engine_apply(emb, feats, 0.05)
        assert_tables_equal(ec, emb)
    ec.set_learning_rates({0: 0.02})
    feats = _inputs(rng)
    loss_of(ec(feats).values()).backward()
    _engine_apply(emb, feats, 0.02)
    assert_tables_equal(ec, emb)
    before = tables_of(ec)
    for bad, match in (({5: 0.1}, "dynamic tags \\[0\\] as keys.*\\[5\\]"), ({"0": 0.1}, "as keys"),
                       ("0.1", "expected a sequence"), ([float("nan")], "finite"), ([1e39], "finite"),
                       (["a"], "real number"), ({0: 0.1, 1: 0.2}, "as keys")):
        with pytest.raises(me.InputError, match=match):
            ec(_inputs(rng), learning_rates=bad)
        with pytest.raises(me.InputError, match=match):
            ec.set_learning_rates(bad)
    for t, arrays in tables_of(ec).items():
        for k, v in arrays.items():
            np.testing.assert_array_equal(v, before[t][k])
    assert ec._batches == {}


def test_feature_key_errors_under_compile_are_meshembed_errors():
    torch._dynamo.reset()
    rng = np.random.default_rng(51)
    ec = me.torch.EmbeddingCollection(config())
    step = torch.compile(lambda f: loss_of(ec(f).values()), fullgraph=True)
    good = _inputs(rng)
    step(good).backward()
    with pytest.raises(me.InputError, match="Missing: \\['seq'\\]"):
        step({"bag": good["bag"]})
    with pytest.raises(me.InputError, match="unknown: \\['typo'\\]"):
        step(dict(_inputs(rng), typo=good["seq"]))
    with pytest.raises(me.InputError, match="'seq'.*7 samples, more than the batch size 6"):
        step({"bag": good["bag"], "seq": torch.zeros(BATCH + 1, SEQ, dtype=torch.int64)})
    with pytest.raises(me.InputError, match="Received: 4 entries"):
        step({"bag": (torch.arange(3), torch.tensor([0, 1, 2, 3])), "seq": good["seq"]})
    step(_inputs(rng)).backward()  # still usable
    assert ec.engine.step == 2 and ec._batches == {}


# -- #35.9: parameters / buffers, EmbeddingBagCollection -------------------------------------
def test_parameters_buffers_and_state_dict_story():
    ec = me.torch.EmbeddingCollection(config())
    model = torch.nn.ModuleDict({"emb": ec, "lin": torch.nn.Linear(DIM, 1)})
    assert list(ec.parameters()) == [] and list(ec.named_buffers()) == []
    assert [n for n, _ in model.named_parameters()] == ["lin.weight", "lin.bias"]
    assert sorted(ec.state_dict()) == ["t.accumulators", "t.parameters"]
    assert "parameters()" in me.torch.EmbeddingCollection.__doc__ and "named_buffers()" in me.torch.EmbeddingCollection.__doc__


def test_embedding_bag_collection_is_the_pooled_module():
    assert "EmbeddingBagCollection" in me.torch.__all__
    pooled = me.EmbeddingConfig(
        tables=[me.TableConfig("t", VOCAB, DIM, optimizer=me.embedding.SGD(learning_rate=0.1), combiner="sum")],
        features=[me.FeatureConfig("t", (BATCH,), name="a"), me.FeatureConfig("t", (BATCH,), name="b")])
    ebc = me.torch.EmbeddingBagCollection(pooled, seed=1)
    ec = me.torch.EmbeddingCollection(pooled, seed=1)
    assert isinstance(ebc, me.torch.EmbeddingCollection)
    rng = np.random.default_rng(60)
    feats = {"a": torch.from_numpy(rng.integers(0, VOCAB, BATCH)), "b": _inputs(rng)["bag"]}
    loss_of(ebc(feats).values()).backward()
    loss_of(ec(feats).values()).backward()
    assert_tables_equal(ebc, ec)
    assert type(copy.deepcopy(ebc)) is me.torch.EmbeddingBagCollection
    with pytest.raises(me.ConfigError, match="\\['seq'\\] are sequence features.*me.torch.EmbeddingCollection"):
        me.torch.EmbeddingBagCollection(config())


# -- #31.4: atomic load_state_dict -----------------------------------------------------------
def test_load_state_dict_writes_nothing_unless_everything_is_valid():
    ec = me.torch.EmbeddingCollection(config(tables=2), seed=1)
    before = ec.state_dict()
    new = {k: v + 1 for k, v in me.torch.EmbeddingCollection(config(tables=2), seed=9).state_dict().items()}
    bad_second = [
        ({"u.parameters": torch.zeros(VOCAB, DIM)}, "u.parameters.*expected a tensor of shape \\(57, 5\\)"),
        ({"u.parameters": torch.full((VOCAB + 7, DIM + 1), float("nan"))}, "NaN or Inf"),
        ({"u.parameters": "x"}, "'u.parameters'.*Received: str"),
        ({"u.parameters": None}, "'u.parameters'.*Received: NoneType"),
        ({"u.parameters": [[1.0]]}, "'u.parameters'.*Received: list"),
        ({"u.parameters": torch.zeros(VOCAB + 7, DIM + 1, dtype=torch.complex64)}, "real"),
        ({"u.parameters": torch.zeros(VOCAB + 7, DIM + 1, device="meta")}, "'u.parameters'.*meta"),
        ({"u.parameters": torch.zeros(VOCAB + 7, DIM + 1).to_sparse()}, "'u.parameters'.*sparse"),
    ]
    for change, match in bad_second:
        with pytest.raises(me.InputError, match=match):
            ec.load_state_dict(dict(new, **change))
        for k, v in ec.state_dict().items():
            torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    # strict: a missing or an unexpected key loads nothing
    for sd in ({k: v for k, v in new.items() if k != "u.parameters"}, dict(new, **{"t.velocity": new["t.parameters"]}),
               dict(new, **{"zz.parameters": new["t.parameters"]})):
        with pytest.raises(RuntimeError, match="Missing key|Unexpected key"):
            ec.load_state_dict(sd)
        for k, v in ec.state_dict().items():
            torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    ec.load_state_dict(new)
    for k, v in ec.state_dict().items():
        torch.testing.assert_close(v, new[k], rtol=0, atol=0)
    ec.load_state_dict({k: v.double() for k, v in before.items()})
    for k, v in ec.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


# -- #31.5: threads ----------------------------------------------------------------------------
def test_concurrent_forward_backward_in_threads_loses_no_update():
    """SGD (lr 0.5, sum combiner, tables of zeros, loss = sum of activations): every row ends
    at exactly -0.5 × its number of lookups, whatever the interleaving of the threads."""
    cfg = me.EmbeddingConfig(
        tables=[me.TableConfig("t", VOCAB, DIM, optimizer=me.embedding.SGD(learning_rate=0.5), combiner="sum")],
        features=[me.FeatureConfig("t", (BATCH,), name="bag"), me.FeatureConfig("t", (BATCH, SEQ), name="seq")])
    ec = me.torch.EmbeddingCollection(cfg, initializers={"t": "zeros"})
    counts = np.zeros(VOCAB)
    errors = []
    steps_each, threads = 25, 3
    data = []
    for i in range(threads):
        rng = np.random.default_rng(70 + i)
        mine = []
        for _ in range(steps_each):
            values, offsets = ragged(rng, BATCH)
            seq = rng.integers(0, VOCAB, (BATCH, SEQ))
            mine.append((values, offsets, seq))
            np.add.at(counts, values, 1)
            np.add.at(counts, seq.reshape(-1), 1)
        data.append(mine)
    barrier = threading.Barrier(threads)

    def work(mine):
        try:
            barrier.wait()
            for values, offsets, seq in mine:
                out = ec({"bag": (torch.from_numpy(values), torch.from_numpy(offsets)), "seq": torch.from_numpy(seq)})
                sum(a.sum() for a in out.values()).backward()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(mine,)) for mine in data]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in pool), errors
    assert ec.engine.step == threads * steps_each and ec._batches == {}
    want = np.repeat((-0.5 * counts)[:, None], DIM, axis=1).astype(np.float32)
    np.testing.assert_array_equal(ec.state_dict()["t.parameters"].numpy(), want)


# -- #31.7: fused_optimizer=False with a NaN in a later batch ----------------------------------
def test_unfused_nan_in_a_later_batch_applies_nothing_and_can_be_discarded():
    rng = np.random.default_rng(80)
    ec = me.torch.EmbeddingCollection(config(), fused_optimizer=False, seed=4)
    emb = me.TPUEmbedding(config(), backend="torch", seed=4)
    before = tables_of(ec)
    good = _inputs(rng)
    loss_of(ec(good).values()).backward()
    out = ec(_inputs(rng))
    (loss_of(out.values()) + out["seq"].sum() * float("nan")).backward()
    with pytest.raises(me.InputError, match="batch 2 of the 2 kept.*NaN or Inf.*Nothing was applied.*discard_gradients"):
        ec.apply_gradients()
    for t, arrays in tables_of(ec).items():
        for k, v in arrays.items():
            np.testing.assert_array_equal(v, before[t][k], err_msg=k)
    assert ec.discard_gradients() == 2 and ec.discard_gradients() == 0
    ec.apply_gradients()  # nothing kept: nothing to do
    for feats in (good, _inputs(rng)):  # usable: the next steps train as the engine does
        loss_of(ec(feats).values()).backward()
        ec.apply_gradients()
        _engine_step(emb, feats)
        assert_tables_equal(ec, emb)
    assert me.torch.EmbeddingCollection(config()).discard_gradients() == 0


# -- #31.12: meshembed errors, never raw ones ---------------------------------------------------
def test_odd_calls_raise_meshembed_errors_naming_the_fix(tmp_path):
    ec = me.torch.EmbeddingCollection(config())
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), ec)
    for call in (lambda: torch.save(ec, io.BytesIO()), lambda: torch.save(model, tmp_path / "m.pt"),
                 lambda: pickle.dumps(ec)):
        with pytest.raises(me.StateError, match="cannot be pickled.*state_dict\\(\\).*ec.save"):
            call()
    assert copy.copy(ec).engine is ec.engine
    with pytest.raises(me.ConfigError, match="`device`.*meta device.*'cpu' or 'cuda'"):
        me.torch.EmbeddingCollection(config(), device="meta")
    with pytest.raises(me.ConfigError, match="meta device"):
        ec.to("meta")
    with pytest.raises(me.ConfigError, match="meta device"):
        ec.to_empty(device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(me.ConfigError, match="cannot apply this conversion"):
            ec.to("cuda")
    opt = me.embedding.Adagrad(learning_rate=me.embedding.DynamicLearningRate(0))
    dyn = me.torch.EmbeddingCollection(config(opt))
    for bad in ("0.1", None, 0.1, [[0.1]], [None], [torch.tensor([0.1, 0.2])], torch.tensor(0.1), {1: 0.1}):
        with pytest.raises(me.InputError, match="learning_rates"):
            dyn.set_learning_rates(bad)
    assert ec.engine.backend.device.type == "cpu"


def test_sparse_ids_with_torch_per_id_weights():
    rng = np.random.default_rng(90)
    values, offsets = ragged(rng, BATCH)
    weights = rng.uniform(0.5, 2, values.shape[0]).astype(np.float32)
    rows = np.repeat(np.arange(BATCH), np.diff(offsets))
    idx = torch.from_numpy(np.stack([rows, np.arange(values.shape[0]) - offsets[rows]], axis=1))
    sp = me.SparseIds(idx, torch.from_numpy(values), (BATCH, 5))
    seq = torch.from_numpy(rng.integers(0, VOCAB, (BATCH, SEQ)))
    ec = me.torch.EmbeddingCollection(config()).eval()
    want = ec({"bag": me.RaggedIds(offsets, values), "seq": seq}, {"bag": me.RaggedIds(offsets, weights)})["bag"]
    for w in (torch.from_numpy(weights), me.SparseIds(idx, torch.from_numpy(weights), (BATCH, 5)), weights,
              list(weights.tolist())):
        got = ec({"bag": sp, "seq": seq}, {"bag": w})["bag"]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(me.InputError, match="weights.*'bag'.*one weight per id"):
        ec({"bag": sp, "seq": seq}, {"bag": torch.ones(values.shape[0] + 1)})
    for bad in (["a"] * values.shape[0], ["a", "b"], (["a", "b"], offsets)):
        with pytest.raises(me.InputError, match="weights.*'bag'"):
            ec({"bag": sp, "seq": seq}, {"bag": bad})
    with pytest.raises(me.InputError, match="ids for feature 'bag'"):
        ec({"bag": ("abc", torch.from_numpy(offsets)), "seq": seq})


@pytest.mark.parametrize("value", ["no", "False", 0, None])
def test_fused_optimizer_must_be_a_bool(value):
    """A string is truthy: ``fused_optimizer="no"`` would fuse. Refused, naming the argument."""
    cfg = me.EmbeddingConfig(tables=[me.TableConfig("t", 10, 2, optimizer=me.embedding.SGD(0.1))],
                             features=[me.FeatureConfig("t", (4,), name="a")])
    with pytest.raises(me.ConfigError, match="fused_optimizer"):
        me.torch.EmbeddingCollection(cfg, fused_optimizer=value)


def test_a_cached_compiled_graph_is_never_reused_for_a_module_of_other_shapes():
    """Inductor's on-disk graph cache keys a graph by its ops' constant arguments; the module's
    handle is the same number for different modules in different processes (CI: a graph of a
    3-wide table ran for a 1-wide one). Here the second module takes the first one's handle."""
    from meshembed_torch.frontend import module as M

    def one_table(dim):
        t = me.TableConfig("t", VOCAB, dim, optimizer=me.embedding.SGD(learning_rate=0.1), combiner="sum")
        return me.EmbeddingConfig(tables=[t], features=[me.FeatureConfig("t", (4,), name="f")])

    ids = {"f": torch.tensor([1, 2, 3, 4])}
    first = me.torch.EmbeddingCollection(one_table(3))
    assert torch.compile(first, fullgraph=True, dynamic=False)(ids)["f"].shape == (4, 3)
    torch._dynamo.reset()
    second = me.torch.EmbeddingCollection(one_table(1))
    own = second._handle
    second._handle, M._MODULES[first._handle] = first._handle, second
    try:
        out = torch.compile(second, fullgraph=True, dynamic=False)(ids)["f"]
    finally:
        second._handle, M._MODULES[first._handle], M._MODULES[own] = own, first, second
    np.testing.assert_array_equal(out.detach().numpy(), second.engine.retrieve_parameters("t")["parameters"][[1, 2, 3, 4]])
