"""jax_ls2.parallel.VocabParallelEmbed / vocab_parallel_embed on a (data 2, tensor 4) mesh of the
8 simulated CPU devices, against nnx.Embed on one device; and the tied vocabulary-parallel
head (attend -> vocab_parallel_cross_entropy) against nnx.Embed.attend -> ops.cross_entropy."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ls2 import ops, parallel

VOCAB, FEATURES, BATCH, SEQ, TENSOR = 4 * 13, 16, 4, 6, 4


@pytest.fixture(scope="module")
def setup():
    mesh = parallel.make_mesh(f"data=2,tensor={TENSOR}")
    layer = parallel.VocabParallelEmbed(VOCAB, FEATURES, rngs=nnx.Rngs(0))
    twin = nnx.Embed(VOCAB, FEATURES, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    specs = nnx.get_partition_spec(state)
    sharded = jax.device_put(state, jax.tree.map(lambda p: NamedSharding(mesh, p), specs))
    ki, kc, kh, kl = jax.random.split(jax.random.key(3), 4)
    ids = jax.random.randint(ki, (BATCH, SEQ), 0, VOCAB).at[0, 0].set(0).at[1, 1].set(VOCAB - 1)
    cot = jax.random.normal(kc, (BATCH, SEQ, FEATURES))
    hidden = jax.random.normal(kh, (BATCH, SEQ, FEATURES))
    labels = jax.random.randint(kl, (BATCH, SEQ), 0, VOCAB)
    return mesh, twin, graphdef, specs, sharded, ids, cot, hidden, labels


def _close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def _table_grad(embed, ids, cot):
    return jax.grad(lambda t: jnp.sum(jnp.take(t, ids, axis=0) * cot))(embed.embedding.get_value())


def test_table_is_made_like_nnx_embed_and_split_by_rows(setup):
    _, twin, _, specs, sharded, *_ = setup
    assert specs["embedding"].get_value() == P("tensor", None)
    table = sharded["embedding"].get_value()
    np.testing.assert_array_equal(np.asarray(table), np.asarray(twin.embedding.get_value()))
    assert table.addressable_shards[0].data.shape == (VOCAB // TENSOR, FEATURES)


def _lookup(graphdef, state, ids):
    return nnx.merge(graphdef, state)(ids)


def test_sharded_jit_lookup_and_gradient(setup):
    mesh, twin, graphdef, _, sharded, ids, cot, *_ = setup
    ids_s = jax.device_put(ids, NamedSharding(mesh, P("data")))
    lookup = jax.jit(functools.partial(_lookup, graphdef))
    _close(lookup(sharded, ids_s), twin(ids))
    grad = jax.jit(jax.grad(lambda st, i: jnp.sum(_lookup(graphdef, st, i) * cot)))(sharded, ids_s)
    _close(grad["embedding"].get_value(), _table_grad(twin, ids, cot))
    hlo = lookup.lower(sharded, ids_s).compile().as_text()
    assert " all-gather(" not in hlo and " all-to-all(" not in hlo
    reduces = [ln for ln in hlo.splitlines() if " all-reduce(" in ln]
    assert len(reduces) == 1 and f"f32[{BATCH // 2},{SEQ},{FEATURES}]" in reduces[0], reduces


def test_shard_map_lookup_and_gradient(setup):
    mesh, twin, graphdef, specs, sharded, ids, cot, *_ = setup
    lookup = jax.shard_map(functools.partial(_lookup, graphdef), mesh=mesh, in_specs=(specs, P("data")),
                           out_specs=P("data"))
    _close(jax.jit(lookup)(sharded, ids), twin(ids))
    grad = jax.jit(jax.grad(lambda st: jnp.sum(lookup(st, ids) * cot)))(sharded)
    _close(grad["embedding"].get_value(), _table_grad(twin, ids, cot))
    hlo = jax.jit(lookup).lower(sharded, ids).compile().as_text()
    assert " all-gather(" not in hlo and hlo.count(" all-reduce(") == 1


def test_tied_head_with_vocab_parallel_cross_entropy(setup):
    mesh, twin, graphdef, specs, sharded, _, _, hidden, labels = setup

    def split_loss(state, h, lb):
        logits = nnx.merge(graphdef, state).attend(h)  # (batch / data, seq, vocab / tensor)
        loss, _ = parallel.vocab_parallel_cross_entropy(logits, lb, reduction="sum")
        return jax.lax.psum(loss, "data")

    split = jax.shard_map(split_loss, mesh=mesh, in_specs=(specs, P("data"), P("data")), out_specs=P())
    step = jax.jit(jax.value_and_grad(split, argnums=(0, 1)))
    loss, (g_state, g_hidden) = step(sharded, hidden, labels)

    def whole_loss(table, h):
        return ops.cross_entropy(jnp.dot(h, table.T), labels, reduction="sum")[0]

    want, (g_table, want_hidden) = jax.value_and_grad(whole_loss, argnums=(0, 1))(twin.embedding.get_value(), hidden)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    _close((g_state["embedding"].get_value(), g_hidden), (g_table, want_hidden))
    hlo = step.lower(sharded, hidden, labels).compile().as_text()
    assert " all-gather(" not in hlo and f",{VOCAB}]" not in hlo


def test_traced_out_of_range_ids_are_clamped_like_ops_embedding(setup):
    mesh, twin, graphdef, specs, sharded, *_ = setup
    ids = jnp.array([[-3, VOCAB + 5, 7, VOCAB]] * 2)
    lookup = jax.shard_map(functools.partial(_lookup, graphdef), mesh=mesh, in_specs=(specs, P("data")),
                           out_specs=P("data"))
    table = twin.embedding.get_value()
    want = jax.jit(ops.embedding)(ids, table)  # traced ids: clamped
    _close(jax.jit(lookup)(sharded, ids), want)
    _close(jax.jit(functools.partial(_lookup, graphdef))(sharded, ids), want)


def test_bad_inputs(setup):
    mesh = setup[0]
    with pytest.raises(TypeError, match="vocab_parallel_embed: ids must have an integer dtype"):
        parallel.vocab_parallel_embed(jnp.ones((2,)), jnp.ones((4, 3)))
    with pytest.raises(ValueError, match=r"vocab_parallel_embed: ids must be in \[0, 4\) \(the table's rows\), got 4"):
        parallel.vocab_parallel_embed(jnp.array([1, 4]), jnp.ones((4, 3)))
    with pytest.raises(ValueError, match=r"vocab_parallel_embed: table must hold vocab \(8\) rows"):
        parallel.vocab_parallel_embed(jnp.ones((2,), jnp.int32), jnp.ones((4, 3)), vocab=8)
    odd = parallel.VocabParallelEmbed(10, 3, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(odd)
    lookup = jax.shard_map(functools.partial(_lookup, graphdef), mesh=mesh,
                           in_specs=(jax.tree.map(lambda _: P(), state), P()), out_specs=P())
    with pytest.raises(ValueError, match="VocabParallelEmbed: inside shard_map over 'tensor' .* make num_embeddings "
                                         "10 a multiple of the axis size"):
        jax.jit(lookup)(state, jnp.zeros((2,), jnp.int32))
