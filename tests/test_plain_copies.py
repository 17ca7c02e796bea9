"""The plain twins (flax_models/plain) carry copies of what they share with jax_ls2, so
that they import no jax_ls2 code: the copies must agree with the originals."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_models.plain import constants as plain_constants
from flax_models.plain import kv_cache as plain_cache
from jax_ls2.nn import kv_cache
from jax_ls2.nn.config import EPSILON
from jax_ls2.nn.decoder import INIT_STDDEV
from jax_ls2.ops.rms_norm import RMS_EPSILON

BATCH, MAX_LEN, KV_HEADS, HEAD_DIM = 2, 6, 2, 4


def test_constants_equal_jax_ls2s():
    assert (plain_constants.EPSILON, plain_constants.RMS_EPSILON, plain_constants.INIT_STDDEV) == \
        (EPSILON, RMS_EPSILON, INIT_STDDEV)


def _decode(cache_module, variable, steps):
    """Writes each (start, t) of ``steps`` into a fresh cache; returns every call's
    (keys, values, visible, nan_past_end of a probe) and the final cache contents."""
    keys, values, index = cache_module.new_cache(BATCH, MAX_LEN, KV_HEADS, HEAD_DIM, jnp.bfloat16, "Layer",
                                                 variable=variable)
    assert index[...].dtype == jnp.int32 and index[...].shape == ()
    out = []
    for i, (start, t) in enumerate(steps):
        k, v = (jax.random.normal(jax.random.key(10 * i + j), (BATCH, t, KV_HEADS, HEAD_DIM)) for j in (0, 1))
        start = jnp.int32(start)
        k_all, v_all = cache_module.write(keys, values, start, k, v, "Layer")
        probe = jax.random.normal(jax.random.key(100 + i), (BATCH, t, 3))
        out.append((k_all, v_all, cache_module.visible(start, t, MAX_LEN),
                    cache_module.nan_past_end(probe, start, MAX_LEN)))
    return out, (keys[...], values[...])


def test_kv_cache_copy_gives_jax_ls2s_results():
    # A prefill, a chunk, one token, and a chunk running past the end (dropped, then NaN).
    steps = [(0, 3), (3, 2), (5, 1), (4, 3)]
    ours, ours_final = _decode(kv_cache, kv_cache.KVCache, steps)
    plain, plain_final = _decode(plain_cache, nnx.Cache, steps)
    assert np.isnan(np.asarray(ours[-1][3])).all() and not np.isnan(np.asarray(ours[0][3])).any()
    for a, b in zip(jax.tree.leaves((ours, ours_final)), jax.tree.leaves((plain, plain_final))):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("module", [kv_cache, plain_cache], ids=["jax_ls2", "plain"])
def test_kv_cache_refusals_read_alike(module):
    with pytest.raises(ValueError, match=r"Layer.init_cache: max_len must be a positive int, got 0"):
        module.new_cache(BATCH, 0, KV_HEADS, HEAD_DIM, jnp.float32, "Layer")
    keys, values, _ = module.new_cache(BATCH, 2, KV_HEADS, HEAD_DIM, jnp.float32, "Layer")
    k = jnp.ones((BATCH, 3, KV_HEADS, HEAD_DIM))
    with pytest.raises(ValueError, match=r"Layer: a decode call of 3 tokens does not fit the cache's max_len \(2\)"):
        module.write(keys, values, jnp.int32(0), k, k, "Layer")
