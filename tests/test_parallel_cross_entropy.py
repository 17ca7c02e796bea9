"""jax_ls2.parallel.vocab_parallel_cross_entropy inside shard_map on a (data 2, tensor 4) mesh
of the 8 simulated CPU devices, against ops.cross_entropy on the unsplit logits."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_ls2 import ops, parallel

BATCH, SEQ, VOCAB = 4, 5, 4 * 29  # 116 classes, 29 per tensor shard
IGNORE = -100


@pytest.fixture(scope="module")
def mesh():
    return parallel.make_mesh("data=2,tensor=4")


def _inputs(seed, dtype=jnp.float32, *, ignored=False):
    kl, kt, kw = jax.random.split(jax.random.key(seed), 3)
    logits = (3.0 * jax.random.normal(kl, (BATCH, SEQ, VOCAB))).astype(dtype)
    labels = jax.random.randint(kt, (BATCH, SEQ), 0, VOCAB)
    labels = labels.at[3, 4].set(VOCAB - 1).at[2, 0].set(0)  # the first and last class
    if ignored:
        labels = labels.at[0, 1].set(IGNORE)
    weights = jax.random.normal(kw, (BATCH, SEQ))
    return logits, labels, weights


def _split_loss(mesh, **kw):
    def per_token(logits, labels):
        return parallel.vocab_parallel_cross_entropy(logits, labels, "tensor", **kw)[0]
    return jax.shard_map(per_token, mesh=mesh, in_specs=(P("data", None, "tensor"), P("data")),
                         out_specs=P("data"))


def _weighted(loss_fn, logits, labels, weights):
    return jnp.sum(loss_fn(logits, labels) * weights)


CONFIGS = [dict(), dict(label_smoothing=0.1, z_loss=1e-3, ignore_index=IGNORE)]


@pytest.mark.parametrize("kw", CONFIGS, ids=["plain", "smoothing_zloss_ignore"])
def test_loss_and_gradient_equal_the_unsplit_op(mesh, kw):
    logits, labels, weights = _inputs(0, ignored="ignore_index" in kw)
    split = _split_loss(mesh, **kw)
    whole = lambda lg, lb: ops.cross_entropy(lg, lb, **kw)[0]
    np.testing.assert_allclose(jax.jit(split)(logits, labels), whole(logits, labels), rtol=1e-5, atol=1e-5)
    g_split = jax.jit(jax.grad(functools.partial(_weighted, split)))(logits, labels, weights)
    g_whole = jax.grad(functools.partial(_weighted, whole))(logits, labels, weights)
    np.testing.assert_allclose(g_split, g_whole, rtol=1e-5, atol=1e-6)


def test_hlo_never_gathers_the_logits(mesh):
    logits, labels, weights = _inputs(1)
    step = jax.jit(jax.value_and_grad(functools.partial(_weighted, _split_loss(mesh))))
    hlo = step.lower(logits, labels, weights).compile().as_text()
    assert " all-gather(" not in hlo and " all-gather-start(" not in hlo
    assert " all-to-all(" not in hlo
    # no array with the full vocabulary as its last dim exists on any device
    assert not re.search(rf"\[[\d,]*\b{VOCAB}\]", hlo)
    assert re.search(rf"f32\[{BATCH // 2},{SEQ},{VOCAB // 4}\]", hlo)
    # only per-token statistics are all-reduced
    for line in hlo.splitlines():
        if " all-reduce(" in line or " all-reduce-start(" in line:
            assert re.search(rf"\[{BATCH // 2},{SEQ}\]|\[\]", line.split("=")[1]), line


def test_reductions_and_count_over_local_tokens(mesh):
    logits, labels, _ = _inputs(2, ignored=True)

    def reduced(lg, lb):
        s, n = parallel.vocab_parallel_cross_entropy(lg, lb, ignore_index=IGNORE, reduction="sum")
        m, _ = parallel.vocab_parallel_cross_entropy(lg, lb, ignore_index=IGNORE, reduction="mean")
        return jax.lax.psum(s, "data"), jax.lax.psum(n, "data"), m[None]

    s, n, m = jax.jit(jax.shard_map(reduced, mesh=mesh, in_specs=(P("data", None, "tensor"), P("data")),
                                    out_specs=(P(), P(), P("data"))))(logits, labels)
    want_s, want_n = ops.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    np.testing.assert_allclose(s, want_s, rtol=1e-5)
    assert int(n) == int(want_n) == BATCH * SEQ - 1
    first_half = ops.cross_entropy(logits[: BATCH // 2], labels[: BATCH // 2], ignore_index=IGNORE,
                                   reduction="mean")[0]
    np.testing.assert_allclose(m[0], first_half, rtol=1e-5)


def test_bf16_gradient_keeps_the_logits_dtype(mesh):
    logits, labels, weights = _inputs(3, jnp.bfloat16)
    g = jax.jit(jax.grad(functools.partial(_weighted, _split_loss(mesh))))(logits, labels, weights)
    assert g.dtype == jnp.bfloat16
    want = jax.grad(functools.partial(_weighted, lambda lg, lb: ops.cross_entropy(lg, lb)[0]))(logits, labels,
                                                                                            weights)
    # both round the same fp32 formula to bf16: at most one bf16 ulp (2**-7) apart
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(want, np.float32), rtol=2**-7, atol=1e-7)


def test_out_of_range_label_gives_nan_like_the_op(mesh):
    logits, labels, _ = _inputs(4)
    labels = labels.at[1, 2].set(VOCAB)
    loss = np.asarray(jax.jit(_split_loss(mesh))(logits, labels))
    assert np.isnan(loss[1, 2]) and np.isfinite(np.delete(loss.reshape(-1), 1 * SEQ + 2)).all()


def test_bad_inputs(mesh):
    logits, labels, _ = _inputs(5)
    with pytest.raises(ValueError, match="vocab_parallel_cross_entropy: must run inside shard_map with 'tensor'"):
        parallel.vocab_parallel_cross_entropy(logits, labels)
    with pytest.raises(TypeError, match="vocab_parallel_cross_entropy: labels must have an integer dtype"):
        parallel.vocab_parallel_cross_entropy(logits, labels.astype(jnp.float32))
    with pytest.raises(ValueError, match="vocab_parallel_cross_entropy: label_smoothing must be"):
        jax.jit(_split_loss(mesh, label_smoothing=1.5))(logits, labels)
