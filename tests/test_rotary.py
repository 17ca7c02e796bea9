"""rotary: frequencies (plain, linear, NTK, LLaMA 3) against formulas written here,
outputs against the rotate-half and complex-multiplication formulas, the backward as the
inverse rotation, grouped-query k, packed positions, transformations, sharding along
batch and sequence, bad inputs; on the GPU, the kernels against a float64 truth."""
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_ls2.ops import RotaryScaling, rotary, rotary_frequencies
from numerics import assert_close, assert_within_2x, compiled_text, f64, mesh8, shard


def plain_inv_freq(rd, theta, scaling=None):
    """The frequencies as the published recipes state them, case by case."""
    if scaling is not None and scaling.kind == "ntk":
        theta = theta * scaling.factor ** (rd / (rd - 2))
    inv = 1.0 / theta ** (np.arange(0, rd, 2, dtype=np.float64) / rd)
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "ntk":
        return inv
    old, lo, hi, f = (scaling.original_max_position, scaling.low_freq_factor, scaling.high_freq_factor,
                      scaling.factor)
    out = []
    for v in inv:
        wavelen = 2 * math.pi / v
        if wavelen < old / hi:
            out.append(v)
        elif wavelen > old / lo:
            out.append(v / f)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append((1 - smooth) * v / f + smooth * v)
    return np.array(out)


def plain_rotary(x, positions, inv_freq, interleaved, compute=jnp.float32):
    """Rotate-half (non-interleaved) or complex multiplication (interleaved)."""
    rd = 2 * inv_freq.shape[0]
    xr, xp = x[..., :rd].astype(compute), x[..., rd:]
    ang = positions.astype(compute)[:, :, None, None] * jnp.asarray(inv_freq, compute)
    if interleaved:
        z = jax.lax.complex(xr[..., 0::2], xr[..., 1::2]) * jnp.exp(1j * ang.astype(compute))
        rot = jnp.stack([z.real, z.imag], -1).reshape(xr.shape)
    else:
        cos, sin = jnp.cos(jnp.concatenate([ang, ang], -1)), jnp.sin(jnp.concatenate([ang, ang], -1))
        half = rd // 2
        rotated_half = jnp.concatenate([-xr[..., half:], xr[..., :half]], -1)
        rot = xr * cos + rotated_half * sin
    return jnp.concatenate([rot.astype(x.dtype), xp], -1)


def inputs(b, s, h, kvh, d, dtype=jnp.float32, seed=0, max_pos=4096):
    """q, k and positions from NumPy (no compiled program needed to make them)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, s, h, d), np.float32)).astype(dtype)
    k = jnp.asarray(rng.standard_normal((b, s, kvh, d), np.float32)).astype(dtype)
    return q, k, jnp.asarray(rng.integers(0, max_pos, (b, s), dtype=np.int32))


SCALINGS = [None, RotaryScaling("linear", 4.0), RotaryScaling("ntk", 8.0),
            RotaryScaling("llama3", 8.0, 1.0, 4.0, 8192), RotaryScaling("llama3", 32.0, 2.0, 8.0, 4096)]


def test_frequencies_match_the_recipes():
    for scaling in SCALINGS:
        for rd, theta in ((128, 500000.0), (64, 10000.0), (6, 10.0)):
            np.testing.assert_allclose(rotary_frequencies(rd, theta=theta, scaling=scaling),
                                       plain_inv_freq(rd, theta, scaling), rtol=1e-6, err_msg=str(scaling))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dims", [(4, 2, 16, 12), (3, 3, 10, 6)], ids=str)
def test_values_and_gradients_match_plain_formulas(dims, interleaved):
    """Forward against rotate-half / complex multiplication with LLaMA 3 scaling, pass-
    through dims untouched; gradients against autodiff of the plain formulas."""
    h, kvh, d, rd = dims
    q, k, pos = inputs(2, 5, h, kvh, d, seed=d)
    wq, wk, _ = inputs(2, 5, h, kvh, d, seed=d + 1)
    scaling = RotaryScaling("llama3", 8.0, 1.0, 4.0, 64)
    inv = rotary_frequencies(rd, theta=500.0, scaling=scaling)
    ours = lambda q, k: rotary(q, k, pos, theta=500.0, rotary_dim=rd, interleaved=interleaved, scaling=scaling)
    plain = lambda q, k: tuple(plain_rotary(t, pos, inv, interleaved) for t in (q, k))
    loss = lambda f: (lambda q, k: jnp.sum(f(q, k)[0] * wq) + jnp.sum(jnp.sin(f(q, k)[1]) * wk))

    @jax.jit
    def both(q, k):
        return ours(q, k), plain(q, k), jax.grad(loss(ours), (0, 1))(q, k), jax.grad(loss(plain), (0, 1))(q, k)

    (qo, ko), (qp, kp), g_ours, g_plain = both(q, k)
    assert_close(qo, qp, 2e-5)
    assert_close(ko, kp, 2e-5)
    np.testing.assert_array_equal(qo[..., rd:], q[..., rd:])
    for a, c in zip(g_ours, g_plain):
        assert_close(a, c, 1e-4)


def test_backward_rotates_back_and_packed_positions():
    """The pullback of the output is the input (the inverse rotation); positions
    restarting inside a row give each packed sequence its own rotation."""
    q, k, _ = inputs(1, 8, 2, 1, 8, seed=6)
    pos = jnp.asarray([[0, 1, 2, 0, 1, 2, 3, 4]], jnp.int32)

    @jax.jit
    def run(q, k):
        out, vjp = jax.vjp(lambda q, k: rotary(q, k, pos, interleaved=True), q, k)
        alone = rotary(q[:, 3:], k[:, 3:], jnp.arange(5, dtype=jnp.int32)[None], interleaved=True)
        return out, vjp(out), alone

    (qo, ko), (qb, kb), (qa, ka) = run(q, k)
    assert_close(qb, q, 1e-5)
    assert_close(kb, k, 1e-5)
    assert_close(qo[:, 3:], qa, 1e-7)
    assert_close(ko[:, 3:], ka, 1e-7)
    assert_close(qo[:, 0], q[:, 0], 0)  # position 0 is the identity
    assert_close(qo[:, 3], q[:, 3], 0)


def test_dtypes_and_wide_positions():
    q, k, pos = inputs(1, 4, 2, 2, 8, jnp.bfloat16, seed=7)
    qo, ko = rotary(q, k, pos)
    assert qo.dtype == ko.dtype == jnp.bfloat16
    # Unsigned positions beyond int32 are clamped to its range, not wrapped.
    big = jnp.full((1, 4), 2**31 - 1, jnp.int32)
    np.testing.assert_array_equal(rotary(q, k, big.astype(jnp.uint32) + 5)[0], rotary(q, k, big)[0])


def test_transformations():
    q, k, pos = inputs(4, 6, 4, 2, 16, seed=7)
    inv = rotary_frequencies(16)
    cube = lambda ts: sum(jnp.sum(t ** 3) for t in ts)
    loss = lambda q, k, pos: cube(rotary(q, k, pos))
    plain = lambda q, k, pos: cube(tuple(plain_rotary(t, pos, inv, False) for t in (q, k)))

    def body(c, _):
        return jax.checkpoint(lambda qc, kc: rotary(qc, kc, pos))(*c), None

    def plain_body(c, _):
        return tuple(plain_rotary(t, pos, inv, False) for t in c), None

    @jax.jit
    def run(q, k, pos):
        per_ex = jax.vmap(jax.grad(lambda q, k, p: loss(q[None], k[None], p[None]), (0, 1)))(q, k, pos)
        scan = jax.grad(lambda q, k: cube(jax.lax.scan(body, (q, k), None, length=3)[0]), (0, 1))(q, k)
        plain_scan = jax.grad(lambda q, k: cube(jax.lax.scan(plain_body, (q, k), None, length=3)[0]), (0, 1))(q, k)
        return per_ex, jax.grad(plain, (0, 1))(q, k, pos), scan, plain_scan

    per_ex, want, scan, plain_scan = run(q, k, pos)
    for a, c in zip(per_ex, want):
        assert_close(a, c, 1e-4)
    for a, c in zip(scan, plain_scan):
        assert_close(a, c, 2e-4)


@pytest.mark.parametrize("spec", [("data",), (None, "data")], ids=["batch", "sequence"])
def test_sharded_jit_has_no_all_gather(spec):
    mesh = mesh8()
    q, k, pos = inputs(8, 16, 4, 2, 16, seed=8)
    inv = rotary_frequencies(16)
    f = jax.jit(jax.grad(lambda q, k, p: sum(jnp.sum(t ** 3) for t in rotary(q, k, p)), (0, 1)))
    args = (shard(q, mesh, *spec), shard(k, mesh, *spec), shard(pos, mesh, *spec))
    out = f(*args)
    ref = jax.jit(jax.grad(lambda q, k: sum(jnp.sum(plain_rotary(t, pos, inv, False) ** 3) for t in (q, k)),
                           (0, 1)))(q, k)
    for a, c in zip(out, ref):
        assert_close(a, c, 1e-4)
    assert tuple(out[0].sharding.spec)[:len(spec)] == spec
    assert "all-gather" not in compiled_text(f, *args)


def test_shard_map_over_sequence():
    mesh = mesh8()
    q, k, pos = inputs(2, 16, 4, 1, 8, seed=9)
    spec = P(None, "data")
    sm = jax.jit(jax.shard_map(lambda q, k, p: rotary(q, k, p), mesh=mesh, in_specs=(spec,) * 3,
                               out_specs=(spec, spec)))
    for a, c in zip(sm(q, k, pos), jax.jit(lambda q, k, p: rotary(q, k, p))(q, k, pos)):
        assert_close(a, c, 1e-6)


def test_bad_inputs():
    q, k, pos = inputs(2, 3, 4, 2, 8)
    with pytest.raises(ValueError, match="rotary: q must have rank 4"):
        rotary(q[0], k, pos)
    with pytest.raises(ValueError, match=r"rotary: k must have shape \(2, 3, kv_heads, 8\)"):
        rotary(q, k[:, :2], pos)
    with pytest.raises(ValueError, match=r"rotary: k's kv_heads \(3\) must divide q's heads \(4\)"):
        rotary(q, jnp.zeros((2, 3, 3, 8)), pos)
    with pytest.raises(TypeError, match="rotary: k must have dtype float32"):
        rotary(q, jnp.zeros(k.shape, jnp.bfloat16), pos)
    with pytest.raises(TypeError, match="rotary: positions must have an integer dtype"):
        rotary(q, k, jnp.zeros(pos.shape, jnp.float32))
    with pytest.raises(ValueError, match=r"rotary: positions must have shape \(2, 3\)"):
        rotary(q, k, pos[:, :2])
    for bad in (0, 3, 10, 4.0):
        with pytest.raises(ValueError, match="rotary: rotary_dim must be an even Python int from 2 to head_dim"):
            rotary(q, k, pos, rotary_dim=bad)
    with pytest.raises(ValueError, match="rotary: theta must be a positive"):
        rotary(q, k, pos, theta=-1.0)
    with pytest.raises(TypeError, match="rotary: scaling must be a RotaryScaling"):
        rotary(q, k, pos, scaling={"factor": 8.0})
    with pytest.raises(ValueError, match="rotary: scaling.kind must be one of"):
        rotary(q, k, pos, scaling=RotaryScaling("yarn", 8.0))
    with pytest.raises(ValueError, match="rotary: scaling needs 0 < low_freq_factor < high_freq_factor"):
        rotary(q, k, pos, scaling=RotaryScaling("llama3", 8.0, 4.0, 1.0))
    with pytest.raises(TypeError, match="rotary: interleaved must be a Python bool"):
        rotary(q, k, pos, interleaved=1)


# ---------------------------------------------------------------- GPU
GPU_CASES = [(2, 1024, 32, 8, 128, 128), (1, 2048, 32, 32, 128, 128), (3, 77, 12, 4, 64, 64),
             (2, 129, 8, 2, 80, 40), (1, 33, 6, 3, 24, 10), (2, 65, 4, 4, 256, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
def test_gpu_against_float64_truth(dtype, case, interleaved):
    b, s, h, kvh, d, rd = case
    q, k, pos = inputs(b, s, h, kvh, d, dtype, seed=d, max_pos=131072)
    scaling = RotaryScaling("llama3", 8.0)
    inv = rotary_frequencies(rd, theta=500000.0, scaling=scaling)
    wq = jax.random.normal(jax.random.key(1), q.shape).astype(dtype)
    wk = jax.random.normal(jax.random.key(2), k.shape).astype(dtype)
    ours = lambda q, k: rotary(q, k, pos, theta=500000.0, rotary_dim=rd, interleaved=interleaved, scaling=scaling)
    xla = lambda q, k, compute=jnp.float32: tuple(plain_rotary(t, pos, inv, interleaved, compute) for t in (q, k))

    def loss(f):
        return lambda q, k: sum(jnp.sum(t.astype(jnp.float32) * w.astype(jnp.float32))
                                for t, w in zip(f(q, k), (wq, wk)))

    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        a64 = [jax.device_put(jnp.asarray(f64(a)), cpu) for a in (q, k, wq, wk)]
        # The angle is position * inv_freq in float32 in both; the truth takes that angle
        # exactly and everything after it in float64.
        pos_ang = jax.device_put(pos, cpu)
        ang = f64(pos_ang.astype(jnp.float32)[:, :, None, None] * jnp.asarray(inv, jnp.float32))
        truth = [plain_rotary_from_angles(t, ang, interleaved) for t in a64[:2]]
        truth_grads = [plain_rotary_from_angles(w, -ang, interleaved) for w in a64[2:]]
    for name, o, r, t in zip(["q", "k"], jax.jit(ours)(q, k), jax.jit(xla)(q, k), truth):
        assert_within_2x(name, o, r, t)
    gk = jax.jit(jax.grad(loss(ours), (0, 1)))(q, k)
    gx = jax.jit(jax.grad(loss(xla), (0, 1)))(q, k)
    for name, o, r, t in zip(["dq", "dk"], gk, gx, truth_grads):
        assert_within_2x(name, o, r, t)


def plain_rotary_from_angles(x, ang, interleaved):
    """float64 rotation of x (numpy) by the angles ang (batch, seq, 1, half)."""
    x = f64(x)
    half = ang.shape[-1]
    rd = 2 * half
    xr = x[..., :rd]
    x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., :half], xr[..., half:])
    c, s = np.cos(ang), np.sin(ang)
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    rot = np.stack([o1, o2], -1).reshape(xr.shape) if interleaved else np.concatenate([o1, o2], -1)
    return np.concatenate([rot, x[..., rd:]], -1)


@pytest.mark.sanitize
@pytest.mark.gpu
def test_gpu_every_output_element_written_and_kernels_called():
    assert os.environ.get("JAX_LS2_POISON_OUTPUTS") == "1"
    q, k, pos = inputs(3, 37, 6, 2, 72, jnp.bfloat16, seed=11)
    f = lambda q, k: rotary(q, k, pos, rotary_dim=36)
    grad = jax.grad(lambda q, k: sum(jnp.sum(t.astype(jnp.float32) ** 2) for t in f(q, k)), (0, 1))
    for arr in list(jax.jit(f)(q, k)) + list(jax.jit(grad)(q, k)):
        assert bool(jnp.all(jnp.isfinite(arr)))
    text = compiled_text(grad, q, k)
    assert "jax_ls2_rotary_fwd" in text and "jax_ls2_rotary_bwd" in text
