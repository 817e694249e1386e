"""me.interop dynamic tables <-> torchrec 1.8's MCHManagedCollisionModule (extra [interop]).

Real torchrec modules built from our configs and back: what docs/interop.md says maps is checked
on the modules themselves (policy, sizes, the remap of every key, the looked-up values), what it
says is refused raises a ConfigError naming the policy, and the state carries both ways.
"""

from __future__ import annotations

import numpy as np
import pytest

REASON = "torchrec==1.8.0 and fbgemm-gpu-cpu==1.8.0 (extra [interop], `make test-interop`) are not installed"
torch = pytest.importorskip("torch", reason=REASON)
pytest.importorskip("torchrec", reason=REASON)
pytest.importorskip("fbgemm_gpu", reason=REASON)

from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection  # noqa: E402
from torchrec.modules.mc_modules import (  # noqa: E402
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
    average_threshold_filter,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

import meshembed as me  # noqa: E402
from meshembed.errors import ConfigError, InputError  # noqa: E402
from meshembed.interop import (  # noqa: E402
    OccurrenceThreshold,
    export_torchrec_mc_state,
    from_torchrec_mc,
    import_torchrec_mc_state,
    to_torchrec,
    to_torchrec_mc,
)

E = me.embedding
CAP, D, B = 12, 4, 8
SHARED = ("unknown_ids", "decisions", "evicted_rows")


def config(eviction=None, admission=None, capacity=CAP):
    spec = E.DynamicVocabulary(admission=admission or E.Always(), eviction=eviction or E.LRU())
    return me.EmbeddingConfig(
        tables=[me.TableConfig("item", capacity, D, optimizer=E.SGD(0.1), combiner="sum", dynamic=spec),
                me.TableConfig("plain", 5, D, optimizer=E.SGD(0.1), combiner="sum")],
        features=[me.FeatureConfig("item", (B,), name="f"), me.FeatureConfig("plain", (B,), name="p")])


def mc_ebc(mcc):
    return ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(mcc.embedding_configs()), mcc)


def kjt(keys):
    keys = torch.as_tensor(np.asarray(keys, np.int64))
    return KeyedJaggedTensor(keys=["f"], values=keys, lengths=torch.ones(keys.shape[0], dtype=torch.int64))


def remap(mcc, keys):
    """MCH's row for each key (eval mode: a read, no profile)."""
    mcc.eval()
    return mcc(kjt(keys)).values().numpy()


def stream(seed, steps, vocab=40):
    rng = np.random.default_rng(seed)
    return [(rng.zipf(1.3, B) % vocab).astype(np.int64) * 7919 + 3 for _ in range(steps)]


def train(cfg, batches, backend="numpy"):
    emb = me.TPUEmbedding(cfg, backend=backend, num_shards=2, seed=3)
    g = np.linspace(-1, 1, B * D, dtype=np.float32).reshape(B, D)
    for keys in batches:
        emb.enqueue([keys, keys % 5])
        emb.dequeue()
        emb.apply_gradients([g, g])
    return emb


# ------------------------------------------------------------------ configs
@pytest.mark.parametrize("order,policy", [(E.LRU(), LRU_EvictionPolicy), (E.LFU(), LFU_EvictionPolicy)])
def test_to_torchrec_mc_builds_a_real_mch_module(order, policy):
    mcc, gaps = to_torchrec_mc(config(order), eviction_interval=3)
    assert isinstance(mcc, ManagedCollisionCollection)
    m = mcc._managed_collision_modules["item"]
    assert isinstance(m, MCHManagedCollisionModule) and type(m._eviction_policy) is policy
    assert m.output_size() == CAP + 1 and m._eviction_interval == 3 and m._eviction_policy._threshold_filtering_func is None
    assert [(t.name, t.num_embeddings, t.embedding_dim, t.feature_names) for t in mcc.embedding_configs()] == \
        [("item", CAP + 1, D, ["f"])]  # only the dynamic table is managed
    assert gaps.fields("item") == SHARED and "eviction_interval=3" in str(gaps)
    with pytest.raises(ConfigError, match="(?s)not exact.*unknown_ids"):
        to_torchrec_mc(config(order), strict=True)
    # to_torchrec's tables line up with the collection (same row count) and name the gap
    tables, tgaps = to_torchrec(config(order))
    assert tables.tables[0].num_embeddings == CAP + 1 and "dynamic" in tgaps.fields("item")
    mc_ebc(mcc)  # torchrec's own consistency checks pass


@pytest.mark.parametrize("spec,name", [
    (dict(eviction=(E.LRU(), E.TTL(5))), "TTL"),
    (dict(eviction=(E.LFU(), E.NormBelow(0.1))), "NormBelow"),
    (dict(admission=E.Probability(0.5)), "Probability"),
    (dict(eviction=E.TTL(5)), "TTL"),
])
def test_policies_without_a_torchrec_form_are_refused_by_name(spec, name):
    with pytest.raises(ConfigError, match=rf"Table 'item'.*{name}\("):
        to_torchrec_mc(config(**spec))


def test_ttl_refusal_says_torchrec_counts_wall_clock_hours():
    with pytest.raises(ConfigError, match="wall-clock hours"):
        to_torchrec_mc(config(eviction=(E.LRU(), E.TTL(5))))


def test_after_occurrences_maps_to_a_count_threshold_with_a_gap():
    mcc, gaps = to_torchrec_mc(config(admission=E.AfterOccurrences(3)))
    fn = mcc._managed_collision_modules["item"]._eviction_policy._threshold_filtering_func
    assert fn == OccurrenceThreshold(3) and "admission" in gaps.fields("item")
    mask, _ = fn(torch.tensor([1, 2, 3, 5]))
    assert mask.tolist() == [False, False, True, True]
    back, _ = from_torchrec_mc(mcc, torch.optim.SGD, {"lr": 0.1}, batch_size=B)
    assert back.tables[0].dynamic.admission == E.AfterOccurrences(3)


@pytest.mark.parametrize("order", [E.LRU(), E.LFU()])
def test_config_round_trip_keeps_capacity_and_policy(order):
    cfg = config(order)
    mcc, _ = to_torchrec_mc(cfg)
    back, gaps = from_torchrec_mc(mc_ebc(mcc), torch.optim.SGD, {"lr": 0.1}, batch_size=B)
    (t,) = back.tables
    assert (t.name, t.vocabulary_size, t.dimension, t.combiner) == ("item", CAP, D, "sum")
    assert t.dynamic == cfg.tables[0].dynamic and set(SHARED) <= set(gaps.fields("item"))


def direct_mcc(policy, zch=CAP + 1, **kw):
    m = MCHManagedCollisionModule(zch_size=zch, device=torch.device("cpu"), eviction_policy=policy,
                                  eviction_interval=1, **kw)
    return ManagedCollisionCollection({"item": m}, [EmbeddingBagConfig(num_embeddings=zch, embedding_dim=D,
                                                                       name="item", feature_names=["f"])])


def test_from_torchrec_mc_maps_lru_with_any_positive_decay_and_refuses_the_rest():
    cfg, _ = from_torchrec_mc(direct_mcc(LRU_EvictionPolicy(decay_exponent=2.5)), torch.optim.SGD, {"lr": 0.1},
                              batch_size=B)
    assert cfg.tables[0].dynamic.eviction == E.LRU() and cfg.tables[0].vocabulary_size == CAP
    with pytest.raises(ConfigError, match="DistanceLFU_EvictionPolicy"):
        from_torchrec_mc(direct_mcc(DistanceLFU_EvictionPolicy()), torch.optim.SGD, batch_size=B)
    with pytest.raises(ConfigError, match="average_threshold_filter"):
        from_torchrec_mc(direct_mcc(LFU_EvictionPolicy(threshold_filtering_func=average_threshold_filter)),
                         torch.optim.SGD, batch_size=B)
    with pytest.raises(ConfigError, match="decay_exponent"):
        from_torchrec_mc(direct_mcc(LRU_EvictionPolicy(decay_exponent=0.0)), torch.optim.SGD, batch_size=B)
    with pytest.raises(ConfigError, match="ManagedCollisionCollection"):
        from_torchrec_mc(EmbeddingBagCollection([]), torch.optim.SGD, batch_size=B)


# ------------------------------------------------------------------ state
@pytest.mark.parametrize("order", [E.LRU(), E.LFU()])
def test_exported_vocabulary_remaps_and_looks_up_as_meshembed(order):
    cfg = config(order)
    emb = train(cfg, stream(0, 12))
    st = emb.vocabulary("item")
    assert st.stats["evicted"] > 0 and st.size == CAP  # the table was under pressure
    module = mc_ebc(to_torchrec_mc(cfg).result)
    export_torchrec_mc_state(emb, module)
    probe = np.unique(np.concatenate(stream(1, 6) + [np.array([-5, 2**62], np.int64)]))
    rows = st.rows_of(probe)
    assert (rows >= 0).any() and (rows < 0).any()
    got = remap(module._managed_collision_collection, probe)
    np.testing.assert_array_equal(got, np.where(rows >= 0, rows, CAP))  # unknown keys -> the shared row
    m = module._managed_collision_collection._managed_collision_modules["item"]
    keys, res = st.resident()
    pos = np.searchsorted(m._mch_sorted_raw_ids.numpy(), keys)
    meta = m._mch_counts if isinstance(order, E.LFU) else m._mch_last_access_iter
    want = st.count[res] if isinstance(order, E.LFU) else st.last_seen[res] + 1
    np.testing.assert_array_equal(meta.numpy()[pos], want)
    assert int(m._current_iter_tensor) == emb.step
    # values: torchrec's pooled sums over the exported rows == meshembed's inference lookup
    module.eval()
    bags = [probe[i:i + B] for i in range(0, probe.size - B + 1, B)]
    for bag in bags:
        out, _ = module(kjt(bag))
        emb.enqueue([bag, bag % 5], training=False)
        ours = emb.dequeue()[0]
        np.testing.assert_allclose(out["f"].detach().numpy(), ours, rtol=0, atol=1e-6)  # float32 sums of 8 rows |x| < 1, any order


def test_torchrec_trained_vocabulary_imports_and_comes_back():
    mcc = direct_mcc(LFU_EvictionPolicy())
    module = mc_ebc(mcc)
    module.train()
    for keys in stream(2, 15):  # real MCH decisions, under pressure
        module(kjt(keys))
    m = mcc._managed_collision_modules["item"]
    before = {k: v.clone() for k, v in m.state_dict().items()}
    cfg, _ = from_torchrec_mc(module, torch.optim.SGD, {"lr": 0.1}, batch_size=B)
    emb = me.TPUEmbedding(cfg, backend="numpy", num_shards=2)
    emb.step = int(m._current_iter_tensor)
    import_torchrec_mc_state(emb, module)
    st = emb.vocabulary("item")
    probe = np.unique(np.concatenate(stream(2, 15)))
    mch_rows = remap(mcc, probe)
    np.testing.assert_array_equal(np.where(st.rows_of(probe) >= 0, st.rows_of(probe), CAP), mch_rows)
    assert st.size == CAP  # full: CAP ids + the shared slot
    w = module._embedding_module.embedding_bags["item"].weight.detach().numpy()
    np.testing.assert_array_equal(emb.retrieve_parameters("item")["parameters"], w[:CAP])
    # back into a fresh module: the same key -> row map and counts as the one trained
    fresh = mc_ebc(direct_mcc(LFU_EvictionPolicy()))
    export_torchrec_mc_state(emb, fresh)
    fm = fresh._managed_collision_collection._managed_collision_modules["item"]
    live = before["_mch_sorted_raw_ids"] != np.iinfo(np.int64).max
    for name in ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_mch_counts"):
        np.testing.assert_array_equal(fm.state_dict()[name][live], before[name][live], err_msg=name)
    assert int(fm._current_iter_tensor) == int(before["_current_iter_tensor"])
    np.testing.assert_array_equal(fresh._embedding_module.embedding_bags["item"].weight.detach().numpy()[:CAP],
                                  w[:CAP])


def test_without_pressure_mch_and_meshembed_keep_the_same_keys():
    """The one regime where the decisions agree: every new id finds a free slot."""
    cfg = config(E.LFU(), capacity=64)
    mcc = to_torchrec_mc(cfg).result
    emb = me.TPUEmbedding(cfg, backend="numpy", num_shards=1)
    m = mcc._managed_collision_modules["item"]
    for keys in stream(3, 8):
        mcc.train()
        mcc(kjt(keys))
        emb.enqueue([keys, keys % 5])
        emb.dequeue()
        emb.apply_gradients([np.zeros((B, D), np.float32)] * 2)
        ids = m._mch_sorted_raw_ids.numpy()
        live = ids != np.iinfo(np.int64).max
        ours, rows = emb.vocabulary("item").resident()
        np.testing.assert_array_equal(ids[live], ours)
        np.testing.assert_array_equal(m._mch_counts.numpy()[live], emb.vocabulary("item").count[rows])


def test_state_transfers_check_everything_first():
    cfg = config(E.LRU())
    emb = train(cfg, stream(0, 3))
    wrong = mc_ebc(to_torchrec_mc(config(E.LFU())).result)
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    with pytest.raises(InputError, match="LFU_EvictionPolicy.*LRU_EvictionPolicy"):
        export_torchrec_mc_state(emb, wrong)
    with pytest.raises(InputError, match="zch_size=13"):
        import_torchrec_mc_state(emb, mc_ebc(to_torchrec_mc(config(E.LRU(), capacity=20)).result))
    assert all(torch.equal(v, wrong.state_dict()[k]) for k, v in before.items())
    vocab = emb.vocabulary("item").to_arrays()
    bad = mc_ebc(to_torchrec_mc(cfg).result)
    with torch.no_grad():
        bad._embedding_module.embedding_bags["item"].weight[0, 0] = float("nan")
    with pytest.raises(InputError, match="finite"):
        import_torchrec_mc_state(emb, bad)
    after = emb.vocabulary("item").to_arrays()
    assert all(np.array_equal(vocab[k], after[k]) for k in vocab)


def test_benchmark_mch_row_counts_what_meshembed_counts():
    """benchmarks/dynamic_vocab.py's torchrec row: its hit count is meshembed's while both keep
    the same keys (no pressure), its memory covers every buffer, and torch's threads come back."""
    from benchmarks.dynamic_vocab import TorchrecMCH, zipf_keys

    rng = np.random.default_rng(0)
    mch = TorchrecMCH(4096)
    st = E.dynamic.new_state(E.DynamicVocabulary(eviction=E.LRU()), 4096)
    threads = torch.get_num_threads()
    for step in range(4):
        keys = zipf_keys(rng, 512, 2000, 1.1)
        mch.count_hits(keys)
        mch.assign(keys)
        _, st, _ = E.dynamic.assign(st, keys, step)
    assert torch.get_num_threads() == threads
    assert (mch.lookups, mch.hits) == (st.stats["lookups"], st.stats["hits"]) and mch.hits > 0
    assert mch.size == st.size
    assert mch.nbytes >= 3 * 8 * 4097  # sorted ids, rows, last access: int64 per slot


def test_an_unpooled_managed_collection_needs_max_sequence_length():
    from torchrec.modules.embedding_configs import EmbeddingConfig as TrecEmbeddingConfig

    m = MCHManagedCollisionModule(zch_size=CAP + 1, device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(),
                                  eviction_interval=1)
    mcc = ManagedCollisionCollection({"item": m}, [TrecEmbeddingConfig(num_embeddings=CAP + 1, embedding_dim=D,
                                                                       name="item", feature_names=["f"])])
    with pytest.raises(ConfigError, match="max_sequence_length"):
        from_torchrec_mc(mcc, torch.optim.SGD, batch_size=B)
    cfg, gaps = from_torchrec_mc(mcc, torch.optim.SGD, batch_size=B, max_sequence_length=3)
    assert cfg.features[0].input_shape == (B, 3) and cfg.tables[0].dynamic.eviction == E.LFU()
    assert "max_sequence_length" in gaps.fields("item")
