"""KV-cache decoding (flax_models.decode) of the tiny LLaMA and GPT, with jax_ls2 layers
and the plain-Flax twin, against the full forward pass on the CPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_models as fm
from flax_models import decode
from jax_ls2.fp8 import DelayedScaling
from jax_ls2.nn import KVCache

PROMPT, STEPS, BATCH = 4, 4, 2
# A prompt prefilled in two chunks, then single tokens.
CHUNKS, SINGLE = (5, 3), 2


@nnx.jit
def _full(model, ids):
    return model(ids)


def _cfg(family):
    return fm.get_config(family, "tiny", num_layers=1)  # one layer: each cached path, less to compile


def _model(family, impl):
    return fm.build(_cfg(family), impl=impl, seed=3, train=False)


def _ids(family, length, seed=0):
    vocab = _cfg(family).vocab_size
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (BATCH, length)), jnp.int32)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("family, impl", [("llama", "ls2"), ("llama", "plain"), ("gpt", "ls2"), ("gpt", "plain")])
def test_cached_logits_equal_the_full_forward_at_each_position(family, impl):
    """A prompt prefilled in two chunks (5 then 3 tokens: the second attends the cached
    five), then one token per call, gives the full forward's logits at every position;
    so does the prompt in one 8-token call."""
    model = _model(family, impl)
    prompt = sum(CHUNKS)
    ids = _ids(family, prompt + SINGLE)
    full = _full(model, ids)
    decoder = decode.init_cache(model, BATCH, ids.shape[1])
    got = [decode.decode(decoder, ids[:, :CHUNKS[0]]), decode.decode(decoder, ids[:, CHUNKS[0]:prompt])]
    got += [decode.decode(decoder, ids[:, i:i + 1]) for i in range(prompt, ids.shape[1])]
    got = jnp.concatenate(got, axis=1)
    assert got.shape == full.shape
    for i in range(ids.shape[1]):  # fp32 both ways; observed ~1e-7
        assert _rel(got[:, i], full[:, i]) < 1e-5, f"position {i}"
    one = decode.decode(decode.init_cache(model, BATCH, ids.shape[1]), ids[:, :prompt])
    for i in range(prompt):
        assert _rel(one[:, i], full[:, i]) < 1e-5, f"one prefill, position {i}"


@pytest.mark.parametrize("family, impl", [("llama", "ls2"), ("llama", "plain"), ("gpt", "ls2")])
def test_a_call_past_the_cache_end_is_nan_and_keeps_the_cache(family, impl):
    """Too many tokens for the cache raise before anything runs; a call that starts
    inside the cache but runs past its end returns NaN (its keys do not all fit) and
    leaves the slots written before it as they were (a clamped write would move them)."""
    model = _model(family, impl)
    ids = _ids(family, 5, seed=3)
    decoder = decode.init_cache(model, BATCH, 4)
    owner = "DecoderLayer" if family == "llama" else "GPTDecoding"
    with pytest.raises(ValueError, match=rf"{owner}: a decode call of 5 tokens does not fit the cache's max_len \(4\)"):
        decode.decode(decoder, ids)
    assert np.isfinite(np.asarray(decode.decode(decoder, ids[:, :3]))).all()
    before = [np.asarray(a) for a in jax.tree.leaves(nnx.state(decoder, nnx.Cache)) if a.ndim == 4]
    assert np.isnan(np.asarray(decode.decode(decoder, ids[:, 3:]))).all()
    after = [np.asarray(a) for a in jax.tree.leaves(nnx.state(decoder, nnx.Cache)) if a.ndim == 4]
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(a[:, :3], b[:, :3])


@pytest.mark.parametrize("impl", ["ls2", "plain"])
def test_gpt_decoding_follows_its_layers_settings(impl):
    """A GPT whose stack is post-LN with ReLU and no final LayerNorm decodes (prefill,
    then one token) to the logits of its own full forward."""
    cfg = _cfg("gpt")
    model = _model("gpt", impl)
    model.decoder = fm.layer_library(impl).TransformerEncoder(
        cfg.num_layers, final_layer_norm=False, **cfg.layer_options(pre_layer_norm=False, activation="relu"),
        rngs=nnx.Rngs(7))
    model.eval()
    ids = _ids("gpt", 6, seed=5)
    full = _full(model, ids)
    decoder = decode.init_cache(model, BATCH, 6)
    got = jnp.concatenate([decode.decode(decoder, ids[:, :5]), decode.decode(decoder, ids[:, 5:])], axis=1)
    for i in range(6):  # fp32 both ways
        assert _rel(got[:, i], full[:, i]) < 1e-5, f"position {i}"


def test_gpt_decoding_raises_for_what_it_does_not_cover():
    for overrides, what in ((dict(fp8=DelayedScaling()), r"cfg.fp8 is not supported"),
                            (dict(tensor_axis="tensor"), r"cfg.tensor_axis / cfg.sequence_parallel are not supported")):
        model = fm.build(_cfg("gpt").replace(**overrides), impl="ls2", train=False)
        with pytest.raises(ValueError, match=f"GPTDecoding: {what}"):
            decode.for_decoding(model)


@pytest.mark.parametrize("family, impl", [("llama", "ls2"), ("gpt", "plain")])
def test_greedy_decode_is_the_iterated_argmax_of_the_full_forward(family, impl):
    """The full forward over prompt + generated tokens is causal, so its logits at
    position p are those of the prefix up to p: greedy token i must be their argmax at
    the position before it."""
    model = _model(family, impl)
    prompt = _ids(family, PROMPT, seed=1)
    tokens = decode.generate(model, prompt, STEPS)
    assert tokens.shape == (BATCH, STEPS) and tokens.dtype == jnp.int32
    logits = _full(model, jnp.concatenate([prompt, tokens], axis=1))
    want = jnp.argmax(logits[:, PROMPT - 1:PROMPT + STEPS - 1], axis=-1)
    np.testing.assert_array_equal(tokens, want)


def test_temperature_sampling():
    model = _model("llama", "ls2")
    prompt = _ids("llama", PROMPT, seed=2)
    key = jax.random.key(5)
    a = decode.generate(model, prompt, STEPS, temperature=1.0, key=key)
    b = decode.generate(model, prompt, STEPS, temperature=1.0, key=key)
    np.testing.assert_array_equal(a, b)  # same key, same tokens
    c = decode.generate(model, prompt, STEPS, temperature=1.0, key=jax.random.key(6))
    assert not np.array_equal(a, c)
    # sample() draws from softmax(logits / temperature)
    logits = jnp.log(jnp.asarray([[0.1, 0.2, 0.3, 0.4]]))
    draws = jax.vmap(lambda k: decode.sample(logits, k, 0.5))(jax.random.split(jax.random.key(0), 4000))[:, 0]
    freq = np.bincount(np.asarray(draws), minlength=4) / 4000
    want = np.array([0.1, 0.2, 0.3, 0.4]) ** 2 / np.sum(np.array([0.1, 0.2, 0.3, 0.4]) ** 2)
    np.testing.assert_allclose(freq, want, atol=0.03)  # 4000 draws: standard error <= 0.008
    np.testing.assert_array_equal(decode.sample(logits, None, 0.0), [3])


def test_cache_is_state_apart_from_the_params():
    model = _model("llama", "ls2")
    params = nnx.state(model, nnx.Param)
    decode.init_cache(model, BATCH, 8)
    caches = nnx.state(model, KVCache)
    leaves = jax.tree.leaves(caches)
    layers = _cfg("llama").num_layers
    assert len(leaves) == 3 * layers  # keys, values, index per layer
    assert {tuple(x.shape) for x in leaves} == {(BATCH, 8, 2, 16), ()}
    assert jax.tree.structure(nnx.state(model, nnx.Param)) == jax.tree.structure(params)


def test_decode_errors():
    model = _model("llama", "ls2")
    with pytest.raises(ValueError, match="DecoderLayer: decode=True needs a cache; call init_cache"):
        model(_ids("llama", 3), decode=True)
    with pytest.raises(ValueError, match="DecoderLayer.init_cache: max_len must be a positive int, got 0"):
        decode.init_cache(model, BATCH, 0)
    with pytest.raises(ValueError, match=r"GPTDecoding.init_cache: max_len must be at most the model's max_len \(128"):
        decode.init_cache(_model("gpt", "plain"), 1, 129)
    with pytest.raises(ValueError, match="generate: temperature > 0 samples and needs key"):
        decode.generate(model, _ids("llama", 3), 2, temperature=0.7)
    with pytest.raises(ValueError, match=r"generate: max_len must hold the prompt and the new tokens \(3 \+ 4\), got 6"):
        decode.generate(model, _ids("llama", 3), 4, max_len=6)
    with pytest.raises(ValueError, match="generate: steps must be a positive int, got 0"):
        decode.generate(model, _ids("llama", 3), 0)
    with pytest.raises(TypeError, match="for_decoding: model must be a flax_models Llama or GPT, got Bert"):
        decode.for_decoding(_model("bert", "plain"))


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(temperature="0.7", key=jax.random.key(0)), TypeError, "generate: temperature must be a Python or NumPy real"),
    (dict(temperature=None), TypeError, "generate: temperature must be a Python or NumPy real number, got NoneType"),
    (dict(temperature=0.7, key=jax.random.split(jax.random.key(0), 2)), ValueError,
     r"generate: key must be one JAX PRNG key \(shape \(\)\), got a batch of keys of shape \(2,\)"),
    (dict(temperature=0.7, key=3), TypeError, "generate: key must be one JAX PRNG key .*got int 3"),
    (dict(temperature=0.7, key=jnp.zeros((2, 2), jnp.uint32)), ValueError, r"generate: key must be one JAX PRNG key"),
])
def test_generate_refuses_bad_temperature_and_key(kwargs, err, match):
    model = _model("llama", "ls2")
    with pytest.raises(err, match=match):
        decode.generate(model, _ids("llama", 3), 2, **kwargs)


def test_generate_refuses_an_empty_prompt():
    model = _model("llama", "ls2")
    with pytest.raises(ValueError, match=r"generate: prompt must hold at least one row and one token, got shape \(2, 0\)"):
        decode.generate(model, jnp.zeros((2, 0), jnp.int32), 2)
    # a legacy uint32[2] key still works
    out = decode.generate(model, _ids("llama", 3), 2, temperature=0.5, key=jax.random.PRNGKey(1))
    assert out.shape == (BATCH, 2)


def _cached_logits(model, ids, prompt):
    decoder = decode.init_cache(model, ids.shape[0], ids.shape[1])
    out = [decode.decode(decoder, ids[:, :prompt])]
    out += [decode.decode(decoder, ids[:, i:i + 1]) for i in range(prompt, ids.shape[1])]
    return jnp.concatenate(out, axis=1)


@pytest.mark.gpu
def test_gpu_cached_decode_against_float64_truth():
    """bf16 decoding through the kernels (flash attention over the cache with its padding
    mask, rotary at the cache position): the cached logits of jax_ls2 within 2x the
    error of the plain twin's cached logits, against the twin's float64 full forward."""
    from numerics import assert_within_2x
    cfg = fm.get_config("llama", "tiny", hidden_size=256, num_heads=4, num_kv_heads=2, ffn_size=512)
    ours = fm.build(cfg, impl="ls2", dtype=jnp.bfloat16, seed=3, train=False)
    twin = fm.build(cfg, impl="plain", dtype=jnp.bfloat16, seed=4, train=False)
    params = nnx.state(ours, nnx.Param)
    nnx.update(twin, params)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40)), jnp.int32)
    got, xla = _cached_logits(ours, ids, 16), _cached_logits(twin, ids, 16)
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True), jax.default_device(cpu):
        truth_model = fm.build(cfg, impl="plain", dtype=jnp.float64, param_dtype=jnp.float64, train=False)
        nnx.update(truth_model, jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), params))
        truth = np.asarray(truth_model(jax.device_put(ids, cpu)))
    assert_within_2x("cached logits", got, xla, truth)
