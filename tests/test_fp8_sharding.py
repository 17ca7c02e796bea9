"""fp8_dot on 8 simulated CPU devices: amaxes max-reduced over the mesh, so every
replica computes the same scales, equal to the unsharded run's."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jax_ls2 import fp8
from numerics import mesh8, shard

RECIPE = fp8.DelayedScaling(amax_history_len=4)


def _inputs():
    k = jax.random.split(jax.random.key(3), 3)
    # Row and column magnitudes differ, so each shard's local amax differs from the global one.
    x = jax.random.normal(k[0], (16, 32)) * jnp.arange(1, 17, dtype=jnp.float32)[:, None]
    w = jax.random.normal(k[1], (32, 8)) * jnp.arange(1, 9, dtype=jnp.float32)[None, :] * 0.1
    c = jax.random.normal(k[2], (16, 8)) * jnp.arange(16, 0, -1, dtype=jnp.float32)[:, None]
    return x, w, fp8.DotMeta.create(RECIPE), c


def _step(x, w, meta, c, amax_axes=()):
    """One step: weight gradient and the meta after update_meta."""
    loss = lambda w, m: jnp.sum(fp8.fp8_dot(x, w, m, RECIPE, amax_axes=amax_axes) * c)
    gw, meta_update = jax.grad(loss, argnums=(0, 1))(w, meta)
    return gw, fp8.update_meta(meta, meta_update, RECIPE)


def _max_all_reduces(hlo: str) -> int:
    """Number of all-reduce instructions whose reduction computation is a maximum."""
    bodies = dict(re.findall(r"^%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, flags=re.S | re.M))
    names = re.findall(r"all-reduce(?:-start)?\([^\n]*to_apply=%?([\w.\-]+)", hlo)
    return sum(" maximum(" in bodies.get(name, "") for name in names)


def _assert_same_on_every_device(meta, expected):
    for name, a, b in zip(fp8.DotMeta._fields, meta, expected):
        shards = [np.asarray(s.data) for s in a.addressable_shards]
        assert len(shards) == 8, name
        for s in shards:
            np.testing.assert_array_equal(s, b, err_msg=name)


def test_shard_map_data_and_tensor_parallel_reduces_amax_over_both_axes():
    x, w, meta, c = _inputs()
    gw_ref, meta_ref = jax.jit(_step)(x, w, meta, c)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "tensor"))
    per_device = lambda x, w, m, c: _step(x, w, m, c, amax_axes=("data", "tensor"))
    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P(None, "tensor"), P(), P("data", "tensor")),
                              out_specs=(P(None, "tensor"), P())))
    args = (shard(x, mesh, "data"), shard(w, mesh, None, "tensor"), meta, shard(c, mesh, "data", "tensor"))
    gw, new_meta = f(*args)
    _assert_same_on_every_device(new_meta, meta_ref)
    np.testing.assert_allclose(gw, gw_ref, rtol=1e-6, atol=1e-6 * float(jnp.abs(gw_ref).max()))
    assert _max_all_reduces(f.lower(*args).compile().as_text()) >= 1


def test_shard_map_without_amax_axes_is_rejected():
    x, w, meta, c = _inputs()
    mesh = mesh8()
    f = jax.jit(jax.shard_map(_step, mesh=mesh, in_specs=(P("data"), P(), P(), P("data")), out_specs=(P(), P())))
    with pytest.raises(ValueError, match=r"fp8_dot: x and w vary over the mesh axes \('data',\).*amax_axes=\('data',\)"):
        f(shard(x, mesh, "data"), w, meta, shard(c, mesh, "data"))


def test_batch_sharded_jit_has_global_amaxes():
    x, w, meta, c = _inputs()
    gw_ref, meta_ref = jax.jit(_step)(x, w, meta, c)
    mesh = mesh8()
    f = jax.jit(_step)
    args = (shard(x, mesh, "data"), shard(w, mesh), shard(meta, mesh), shard(c, mesh, "data"))
    gw, new_meta = f(*args)
    _assert_same_on_every_device(new_meta, meta_ref)
    np.testing.assert_allclose(gw, gw_ref, rtol=1e-6, atol=1e-6 * float(jnp.abs(gw_ref).max()))
    assert _max_all_reduces(f.lower(*args).compile().as_text()) >= 1
