"""FP8 micro-batch accumulation, one jitted call per micro-batch: weight caching
(`fp8.cache_weights`, cast once per optimizer step) gives bit-identical training with
optax.MultiSteps and fp8.accumulate_flat, and its reuse program casts no weight; fused
float32 weight-gradient accumulation (`fp8.accumulate_grads`) equals the unfused sums
and adds each weight-gradient GEMM's float32 result straight into its accumulator."""
import re
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax_ls2 import fp8, optim
from jax_ls2.fp8.recipe import WEIGHT
from numerics import cuda_lowering_text

RECIPE = fp8.DelayedScaling(amax_history_len=4)
MICRO = 4
# Tokens (BATCH * SEQ = 10) differ from every weight dim, so weight-shaped arrays are
# told apart from activations in the HLO.
BATCH, SEQ, D, Q, F = 2, 5, 16, 48, 32
WEIGHTS = ("w_in", "w_out", "w1", "w2")
WRT = nnx.DiffState(0, nnx.Any(nnx.Param, fp8.FP8Meta))


class Tiny(nnx.Module):
    """One GEMM of each FP8 op: ``LayerNorm(x) @ w_in`` (layernorm_fp8_dot), ``@ w_out``
    (fp8_dot) and an MLP (fp8_mlp, w1 and w2), residuals around the last two."""

    def __init__(self, recipe=RECIPE, param_dtype=jnp.float32, seed=0):
        # NumPy draws: no small programs compiled to initialise.
        rng = np.random.default_rng(seed)
        self.gamma = nnx.Param(jnp.asarray(1.0 + 0.1 * rng.standard_normal(D), param_dtype))
        self.beta = nnx.Param(jnp.asarray(0.1 * rng.standard_normal(D), param_dtype))
        self.b1 = nnx.Param(jnp.asarray(0.1 * rng.standard_normal(F), param_dtype))
        for name, shape in zip(WEIGHTS, ((D, Q), (Q, D), (D, F), (F, D))):
            setattr(self, name, nnx.Param(jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), param_dtype)))
            setattr(self, f"{name}_fp8", fp8.FP8DotMeta(recipe))
        self.recipe = recipe

    def __call__(self, x):
        r = self.recipe
        h = fp8.layernorm_fp8_dot(x, self.gamma[...], self.beta[...], self.w_in[...], self.w_in_fp8, r, dtype=x.dtype)
        x = x + fp8.fp8_dot(jax.nn.gelu(h), self.w_out[...], self.w_out_fp8, r, dtype=x.dtype)
        return x + fp8.fp8_mlp(x, self.w1[...], self.b1[...], self.w2[...], self.w1_fp8, self.w2_fp8, r, dtype=x.dtype)


def _loss(model, x, c):
    return jnp.sum((model(x) * c).astype(jnp.float32))


def _micro_batches(n, dtype=jnp.float32):
    rng = np.random.default_rng(7)
    # Other magnitudes per micro-batch, so that the merged amaxes come from several.
    scales = [1.0, 4.0, 2.0, 0.5, 3.0, 0.7, 1.5, 2.5][:n]
    xs = [jnp.asarray(rng.standard_normal((BATCH, SEQ, D)) * s, dtype) for s in scales]
    cs = [jnp.asarray(rng.standard_normal((BATCH, SEQ, D)), dtype) for _ in scales]
    return xs, cs


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _trained(model):
    return nnx.state(model, nnx.Any(nnx.Param, fp8.FP8Meta))


# ------------------------------------------------------------------ weight caching
def test_multisteps_with_cached_weights_is_bit_identical_and_refills_each_step():
    xs, cs = _micro_batches(2 * MICRO)

    def train(first_flags):
        model = Tiny()
        if first_flags[0] is not None:
            # Caches filled once up front, so that the first fill program is the steady
            # one (one compile fewer; the step's own fill overwrites them).
            with fp8.cache_weights(model, True):
                nnx.jit(Tiny.__call__)(model, xs[0])
        tx = optax.MultiSteps(optax.sgd(1e-2), every_k_schedule=MICRO)
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit(static_argnames="first")
        def micro_step(model, opt, pending, x, c, first):
            if first is None:
                loss, grads = nnx.value_and_grad(_loss, argnums=WRT)(model, x, c)
            else:
                with fp8.cache_weights(model, first):
                    loss, grads = nnx.value_and_grad(_loss, argnums=WRT)(model, x, c)
            opt_state = nnx.as_pure(opt.opt_state)
            param_grads, pending = fp8.accumulate_meta_updates(pending, grads, reset=opt_state.mini_step == 0)
            opt.update(model, param_grads)
            fp8.apply_meta_updates(model, pending, RECIPE, when=tx.has_updated(nnx.as_pure(opt.opt_state)))
            return loss, pending

        pending, losses, caches = fp8.meta_updates_like(model), [], []
        for i, flag in enumerate(first_flags):
            loss, pending = micro_step(model, opt, pending, xs[i], cs[i], first=flag)
            losses.append(loss)
            if flag is not None:
                caches.append(np.asarray(model.w2_fp8.weight_cache.get_value().wq.astype(jnp.float32)))
        return np.asarray(losses), _trained(model), caches

    plain_losses, plain_state, _ = train([None] * (2 * MICRO))
    losses, state, caches = train([i % MICRO == 0 for i in range(2 * MICRO)])
    np.testing.assert_array_equal(losses, plain_losses)
    _assert_trees_equal(state, plain_state)
    # Reuse steps keep the copies; the second optimizer step's fill recasts the updated weights.
    for i in range(1, MICRO):
        np.testing.assert_array_equal(caches[i], caches[0])
    assert not np.array_equal(caches[MICRO], caches[0])


@lru_cache(maxsize=None)
def _accumulate_programs():
    """The fp8.accumulate_flat micro-step compiled for each ``is_first_microbatch`` (None:
    no caching, True: fill, False: reuse), and the (graphdef, state) each takes: a
    model never cached for None, the same model with filled caches for True and False
    (so that both take one state structure; the fill overwrites the copies)."""
    xs, cs = _micro_batches(1)
    cached = Tiny()
    with fp8.cache_weights(cached, True):
        nnx.jit(Tiny.__call__)(cached, xs[0])
    models = {None: nnx.split(Tiny()), True: nnx.split(cached), False: nnx.split(cached)}

    def program(first):
        graphdef, state = models[first]

        def micro_step(state, acc, x, c):
            model = nnx.merge(graphdef, state)
            if first is not None:
                fp8.cache_weights(model, first)
            grads = nnx.grad(_loss, argnums=WRT)(model, x, c)
            return nnx.state(model), fp8.accumulate_flat(acc, grads, 1.0 / MICRO)

        acc = jax.jit(fp8.init_flat_accumulator)(_trained(nnx.merge(graphdef, state)))
        return jax.jit(micro_step).lower(state, acc, xs[0], cs[0]).compile()

    return {first: program(first) for first in models}, models


def test_optim_accumulate_with_cached_weights_is_bit_identical_and_records_weight_amaxes():
    compiled, models = _accumulate_programs()
    xs, cs = _micro_batches(MICRO)
    tx = optim.adamw(1e-2)
    apply = jax.jit(lambda acc, opt_state, variables: fp8.apply_updates(tx, acc, opt_state, variables, fp8=RECIPE))
    results = {}
    for flags in ([None] * MICRO, [i == 0 for i in range(MICRO)]):
        graphdef, state = models[flags[0]]
        variables = _trained(nnx.merge(graphdef, state))
        acc = jax.jit(fp8.init_flat_accumulator)(variables)
        for i, flag in enumerate(flags):
            state, acc = compiled[flag](state, acc, xs[i], cs[i])
        opt_state = jax.jit(tx.init)(nnx.state(nnx.merge(graphdef, state), nnx.Param))
        results[flags[0]] = acc, apply(acc, opt_state, variables)
    _assert_trees_equal(results[True], results[None])
    # The merged meta updates hold each weight's amax, though three of the four
    # micro-batches read it from the cache.
    model = nnx.merge(*models[True])
    merged = results[True][0].meta
    for name in WEIGHTS:
        history = np.asarray(merged[f"{name}_fp8"]["meta"].get_value().amax_history)
        np.testing.assert_array_equal(history[WEIGHT, 0], np.max(np.abs(np.asarray(getattr(model, name)[...]))))


def _weight_casts(hlo: str) -> list:
    """Shapes of the converts to FP8 in a compiled HLO text whose shape is that of a
    weight of `Tiny` or of its transpose."""
    shapes = {(D, Q), (Q, D), (D, F), (F, D)}
    found = re.findall(r"= f8e4m3fn\[(\d+),(\d+)\]\{[^}]*\} convert\(", hlo)
    return sorted((int(a), int(b)) for a, b in found if (int(a), int(b)) in shapes)


def test_reuse_program_casts_no_weight_and_fill_program_casts_each_once():
    compiled, _ = _accumulate_programs()
    weight_shapes = [(D, Q), (Q, D), (D, F), (F, D)]
    assert _weight_casts(compiled[True].as_text()) == sorted(weight_shapes)
    assert _weight_casts(compiled[None].as_text()) == sorted(weight_shapes)
    assert _weight_casts(compiled[False].as_text()) == []


def test_misused_caches_raise():
    x = _micro_batches(1)[0][0]
    model = Tiny()
    fp8.cache_weights(model, False)
    with pytest.raises(ValueError, match=r"layernorm_fp8_dot: the FP8 weight cache is to be reused but was never "
                                         r"filled"):
        model(x)
    with fp8.cache_weights(model, True) as caching:
        assert len(caching.metas) == len(WEIGHTS)
        nnx.jit(Tiny.__call__)(model, x)
    assert model.w_out_fp8.weight_cache_mode == "reuse"  # as before the `with`
    assert model.w_out_fp8.weight_cache.get_value().wq.shape == (Q, D)
    other = fp8.DelayedScaling(amax_history_len=4, margin=1)
    h = jnp.ones((BATCH, SEQ, Q))
    with pytest.raises(ValueError, match=r"fp8_dot: the FP8 weight cache was filled for recipe "
                                         r"DelayedScaling\(margin=0.*this call uses DelayedScaling\(margin=1"):
        fp8.fp8_dot(h, model.w_out[...], model.w_out_fp8, other)
    with pytest.raises(ValueError, match=r"fp8_dot: the FP8 weight cache holds float8_e4m3fn copies of a weight "
                                         r"of shape \(48, 16\), this call's w has shape \(48, 32\)"):
        fp8.fp8_dot(h, jnp.ones((Q, F)), model.w_out_fp8, RECIPE)
    # Off: the caches are emptied, and reusing them afterwards is refused again.
    fp8.cache_weights(model, None)
    assert model.w_out_fp8.weight_cache.get_value() is None
    fp8.cache_weights(model, False)
    with pytest.raises(ValueError, match=r"was never filled"):
        model(x)
    with pytest.raises(TypeError, match=r"cache_weights: is_first_microbatch must be a Python bool or None.*"
                                        r"got ArrayImpl"):
        fp8.cache_weights(model, jnp.asarray(True))
    with pytest.raises(TypeError, match=r"cache_weights: is_first_microbatch must be a Python bool or None.*got int"):
        fp8.cache_weights(model, 1)
    with pytest.raises(ValueError, match=r"cache_weights: model holds no FP8DotMeta"):
        fp8.cache_weights(nnx.Dropout(0.1), True)
    with pytest.raises(TypeError, match=r"cache_weights: model must be an NNX module, got dict"):
        fp8.cache_weights({}, True)


# ------------------------------------------------------------------ fused wgrad accumulation
def _split(model):
    graphdef, variables, rest = nnx.split(model, nnx.Any(nnx.Param, fp8.FP8Meta), ...)
    return (lambda v, x, c: _loss(nnx.merge(graphdef, v, rest), x, c)), variables


def test_fused_wgrad_accumulation_equals_the_flat_buffer_accumulation():
    compiled, models = _accumulate_programs()  # the flat-buffer micro-step, uncached
    graphdef, state = models[None]
    xs, cs = _micro_batches(MICRO)
    loss, variables = _split(nnx.merge(graphdef, state))
    fused = jax.jit(fp8.accumulate_grads(loss))
    acc, flat = jax.jit(fp8.init_grad_accumulator)(variables), jax.jit(fp8.init_flat_accumulator)(variables)
    for x, c in zip(xs, cs):
        _, acc = fused(acc, variables, x, c)
        _, flat = compiled[None](state, flat, x, c)
    flat_grads, flat_meta = fp8.split_meta(fp8.unflatten_flat_grads(flat, variables))
    _assert_trees_equal(acc.meta, flat_meta)
    assert jax.tree.structure(acc.grads) == jax.tree.structure(flat_grads)
    for a, b in zip(jax.tree.leaves(acc.grads), jax.tree.leaves(flat_grads)):
        # The flat buffer holds the mean (1 / MICRO, a power of two: exact scaling).
        np.testing.assert_allclose(np.asarray(a) / MICRO, b, rtol=1e-6, atol=1e-7)


def test_fused_wgrad_accumulation_with_bf16_weights_keeps_the_forward_and_sums_in_fp32():
    # bf16 weights (their gradients' dtype is the point), float32 activations.
    x, c = (t[0] for t in _micro_batches(1))
    loss, variables = _split(Tiny(param_dtype=jnp.bfloat16))
    acc = jax.jit(fp8.init_grad_accumulator)(variables)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(acc.grads))
    value, acc = jax.jit(fp8.accumulate_grads(loss))(acc, variables, x, c)
    bf16_value, bf16_grads = jax.jit(jax.value_and_grad(loss))(variables, x, c)
    # The forward reads the bf16 weights' numbers: the loss is the bf16 model's.
    np.testing.assert_array_equal(value, bf16_value)
    bf16_grads, bf16_meta = fp8.split_meta(bf16_grads)
    _assert_trees_equal(acc.meta, bf16_meta)
    for a, b in zip(jax.tree.leaves(acc.grads), jax.tree.leaves(bf16_grads)):
        # float32 sums; the bf16 model's gradients are the same GEMMs rounded to bf16.
        assert a.dtype == jnp.float32 and b.dtype == jnp.bfloat16
        a, b = np.asarray(a), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=2.0 ** -7, atol=2.0 ** -7 * np.max(np.abs(a)))


def _wgrad_chains(text: str) -> dict:
    """For each FP8 dot_general of a lowered program whose result has a weight's shape
    (a weight-gradient GEMM): (result type, the ops that carry it to the end of its
    chain of single uses)."""
    weight_shapes = {f"{a}x{b}" for a, b in ((D, Q), (Q, D), (D, F), (F, D))}
    chains = {}
    for name, a, b, out in re.findall(r"(%\S+) = stablehlo\.dot_general .*: \((tensor<[^>]*>), "
                                      r"(tensor<[^>]*>)\) -> (tensor<[^>]*>)", text):
        shape = out[len("tensor<"):].rsplit("x", 1)[0]
        if "f8E" not in a + b or shape not in weight_shapes:
            continue
        ops, value = [], name
        while True:
            uses = re.findall(rf"(%\S+) = (stablehlo\.\w+) ([^\n]*){re.escape(value)}\b([^\n]*)", text)
            if len(uses) != 1:
                break
            value, op, before, after = uses[0]
            ops.append((op, before, after))
        chains[name] = (out, ops)
    return chains


def test_cuda_lowering_adds_each_wgrad_gemm_straight_into_its_accumulator():
    x, c = (t[0] for t in _micro_batches(1, jnp.bfloat16))
    loss, variables = _split(Tiny(param_dtype=jnp.bfloat16))
    acc = fp8.init_grad_accumulator(variables)
    for fuse in (True, False):
        text = cuda_lowering_text(fp8.accumulate_grads(loss, fuse_wgrad_accumulation=fuse), acc, variables, x, c)
        chains = _wgrad_chains(text)
        assert len(chains) == len(WEIGHTS), text
        for out, ops in chains.values():
            kinds = [op for op, _, _ in ops]
            if fuse:
                # float32 result, scaled by a broadcast scalar (folded into the cuBLASLt
                # call), added to an accumulator argument of the program: nothing between.
                assert out.endswith("xf32>"), out
                assert kinds == ["stablehlo.multiply", "stablehlo.add"], ops
                assert re.fullmatch(r"%arg\d+, ", ops[1][1]), ops
            else:
                # A bf16 weight's gradient is written in bf16 and converted before its add.
                assert out.endswith("xbf16>") and "stablehlo.convert" in kinds, (out, ops)


def _accumulator_writers(hlo, shapes):
    """Each instruction of the compiled program's entry computation (parameters aside) that yields an f32
    array of one of ``shapes``, as (kind, text): "cublaslt_beta1" (a cuBLASLt FP8 call
    whose C operand is added, beta = 1), "triton_f8_add" (a Triton GEMM fusion whose
    own computation takes FP8 operands into its dot and adds to it: the accumulate in the
    GEMM's epilogue), or "other" (a pass of its own)."""
    bodies, current, entry = {}, None, None
    for line in hlo.splitlines():
        header = re.match(r"^(ENTRY\s+)?%([\w.\-]+) \(", line)
        if header:
            current = header.group(2)
            entry = current if header.group(1) else entry
            bodies[current] = [line]  # the parameters' types are on this line
        elif current is not None and line.strip() and line.strip() != "}":
            bodies[current].append(line)
    found = []
    for line in bodies.get(entry, []):
        m = re.match(r"^\s*(?:ROOT\s+)?%[\w.\-]+ = \(?f32\[(\d+),(\d+)\]", line)
        if not m or (int(m.group(1)), int(m.group(2))) not in shapes or " parameter(" in line:
            continue
        callee = re.search(r"calls=%([\w.\-]+)", line)
        body = "\n".join(bodies.get(callee.group(1), [])) if callee else ""
        if '__cublas$lt$matmul$f8' in line:
            kind = "cublaslt_beta1" if '"beta":1' in line else "other"
        elif "__triton" in line and re.search(r"dot\(", body) and re.search(r"f8e\w+\[", body) and " add(" in body:
            kind = "triton_f8_add"
        else:
            kind = "other"
        found.append((kind, line.strip()[:300] + ("\n    " + body[:1500] if callee else "")))
    return found


def test_accumulator_writers_tell_epilogue_adds_from_separate_passes():
    hlo = "\n".join([
        "%gemm_fusion.1_computation (p0: f8e4m3fn[10,16], p1: f8e5m2[10,48], p2: f32[16,48]) -> f32[16,48] {",
        "  %dot.1 = f32[16,48]{1,0} dot(%p0, %p1), lhs_contracting_dims={0}, rhs_contracting_dims={0}",
        "  ROOT %add.1 = f32[16,48]{1,0} add(%dot.1, %p2)",
        "}",
        "%loop_add_fusion (p0: f32[32,16], p1: f32[32,16]) -> f32[32,16] {",
        "  ROOT %add.2 = f32[32,16]{1,0} add(%p0, %p1)",
        "}",
        "ENTRY %main (a: f8e4m3fn[10,16], g: f8e5m2[10,48], acc: f32[16,48], acc2: f32[48,16]) -> f32[16,48] {",
        '  %t = f32[16,48]{1,0} fusion(%a, %g, %acc), kind=kCustom, calls=%gemm_fusion.1_computation, '
        'backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}',
        '  %c = (f32[48,16]{1,0}, s8[1024]{0}) custom-call(%g, %a, %acc2), '
        'custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"beta":1}}',
        '  %c0 = (f32[48,16]{1,0}, s8[1024]{0}) custom-call(%g, %a), '
        'custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"beta":0}}',
        "  %acc3 = f32[32,16]{1,0} parameter(4)",
        "  ROOT %s = f32[32,16]{1,0} fusion(%x, %y), kind=kLoop, calls=%loop_add_fusion",
        "}"])
    kinds = [kind for kind, _ in _accumulator_writers(hlo, {(16, 48), (48, 16), (32, 16)})]
    assert kinds == ["triton_f8_add", "cublaslt_beta1", "other", "other"]


@pytest.mark.gpu
def test_gpu_fused_wgrad_gemms_accumulate_in_the_gemm_kernel():
    """On CUDA: each FP8 weight-gradient GEMM adds into the f32 accumulator inside the
    GEMM kernel itself (a cuBLASLt FP8 call with the accumulator as C and beta = 1, or the
    Triton FP8 GEMM fusion XLA's autotuner may pick, with the add in its epilogue): no
    separate pass reads and writes the accumulator. The fused sums match the unfused."""
    xs, cs = _micro_batches(MICRO, jnp.bfloat16)
    loss, variables = _split(Tiny(param_dtype=jnp.bfloat16))
    step = jax.jit(fp8.accumulate_grads(loss))
    acc = fp8.init_grad_accumulator(variables)
    hlo = step.lower(acc, variables, xs[0], cs[0]).compile().as_text()
    writers = _accumulator_writers(hlo, {(D, Q), (Q, D), (D, F), (F, D)})
    assert len(writers) == len(WEIGHTS) and all(kind != "other" for kind, _ in writers), \
        "\n".join(f"{kind}: {text}" for kind, text in writers)
    unfused = jax.jit(fp8.accumulate_grads(loss, fuse_wgrad_accumulation=False))
    ref = acc
    for x, c in zip(xs, cs):
        _, acc = step(acc, variables, x, c)
        _, ref = unfused(ref, variables, x, c)
    for a, b in zip(jax.tree.leaves(acc.grads), jax.tree.leaves(ref.grads)):
        # The unfused sums hold bf16-rounded micro-batch gradients.
        np.testing.assert_allclose(a, b, rtol=2.0 ** -7, atol=2.0 ** -7 * float(jnp.max(jnp.abs(b))))
