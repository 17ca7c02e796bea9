"""fp8=DelayedScaling on the jax_ls2.nn layers and stacks: one meta per weight GEMM, the
bf16 layer's parameter tree, FP8 dot_generals for every weight GEMM in the lowered
program (forward E4M3, backward E5M2 gradients), amaxes reduced over the mesh, and
clear errors."""
import collections
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_ls2 import fp8
from jax_ls2 import nn as ls2
from jax_ls2.nn import _common
from jax_ls2.nn import linen as ls2_linen
from numerics import mesh8, shard

RECIPE = fp8.DelayedScaling(amax_history_len=4)
HIDDEN, FFN, HEADS = 32, 64, 4
# FP8 weight GEMMs (and metas) per layer: q|k|v, attention output, fc1, fc2; the decoder
# adds cross-attention's q, kv and output.
ENCODER_GEMMS, DECODER_GEMMS = 4, 7
# q, k and v run as three forward GEMMs (FP8: sharing one meta, one quantized input and
# weight, and one dgrad and wgrad; bf16: three of each).
QKV_EXTRA_GEMMS = 2
WRT = nnx.DiffState(0, nnx.Any(nnx.Param, fp8.FP8Meta))


def _inputs(batch=8, length=8, seed=0):
    k = jax.random.split(jax.random.key(seed), 2)
    # Magnitudes that differ per sequence, so each batch shard sees other amaxes.
    rows = jnp.arange(1, batch + 1, dtype=jnp.float32)[:, None, None]
    return jax.random.normal(k[0], (batch, length, HIDDEN)) * rows, jax.random.normal(k[1], (batch, length, HIDDEN))


def _param_shapes(module):
    return jax.tree.map(lambda a: (a.shape, a.dtype), nnx.state(module, nnx.Param))


@pytest.mark.parametrize("make, gemms", [
    (lambda **kw: ls2.TransformerEncoderLayer(HIDDEN, FFN, HEADS, rngs=nnx.Rngs(0), **kw), ENCODER_GEMMS),
    (lambda **kw: ls2.TransformerDecoderLayer(HIDDEN, FFN, HEADS, rngs=nnx.Rngs(0), **kw), DECODER_GEMMS),
    (lambda **kw: ls2.TransformerLayer(HIDDEN, FFN, HEADS, layer_type="decoder", rngs=nnx.Rngs(0), **kw),
     DECODER_GEMMS),
    (lambda **kw: ls2.TransformerEncoder(2, HIDDEN, FFN, HEADS, rngs=nnx.Rngs(0), **kw), 2 * ENCODER_GEMMS),
    (lambda **kw: ls2.TransformerDecoder(3, HIDDEN, FFN, HEADS, rngs=nnx.Rngs(0), **kw), 3 * DECODER_GEMMS),
])
def test_params_are_the_bf16_layers_and_one_meta_per_gemm(make, gemms):
    with_fp8, without = make(fp8=RECIPE), make()
    assert _param_shapes(with_fp8) == _param_shapes(without)
    for a, b in zip(jax.tree.leaves(nnx.state(with_fp8, nnx.Param)), jax.tree.leaves(nnx.state(without, nnx.Param))):
        np.testing.assert_array_equal(a, b)
    assert fp8.count_metas(with_fp8) == gemms and fp8.count_metas(without) == 0
    assert not any(isinstance(v, nnx.Param) for _, v in nnx.to_flat_state(nnx.state(with_fp8, fp8.FP8Meta)))


def _meta_updates(module, *args, **kw):
    loss = lambda m: jnp.sum(m(*args, deterministic=True, **kw).astype(jnp.float32) ** 2)
    return fp8.split_meta(nnx.grad(loss, argnums=WRT)(module))[1]


@pytest.mark.parametrize("batched_cross_kv, remat", [(True, False), (False, True)])
def test_every_gemm_records_its_own_amaxes_in_the_stacks(batched_cross_kv, remat):
    x, _ = _inputs(2, 8)
    memory, _ = _inputs(2, 5, seed=1)
    enc = ls2.TransformerEncoder(2, HIDDEN, FFN, HEADS, pre_layer_norm=False, fp8=RECIPE, remat=remat,
                                 rngs=nnx.Rngs(0))
    dec = ls2.TransformerDecoder(2, HIDDEN, FFN, HEADS, fp8=RECIPE, batched_cross_kv=batched_cross_kv,
                                 remat=remat, rngs=nnx.Rngs(1))
    for updates, gemms in ((_meta_updates(enc, x), 2 * ENCODER_GEMMS),
                           (_meta_updates(dec, x, memory), 2 * DECODER_GEMMS)):
        observed = [v.get_value().observed_amax() for _, v in nnx.to_flat_state(updates)]
        assert len(observed) == gemms
        for amax in observed:  # input, weight and output-gradient amaxes, each seen once
            assert np.all(np.asarray(amax) > 0), amax


_DOT = re.compile(r"stablehlo\.dot_general.*: \((tensor<[^>]*>), (tensor<[^>]*>)\)")
_UPCAST = re.compile(r"stablehlo\.convert .*: \(tensor<[^>]*f8E[^>]*>\) -> tensor<[^>]*(?:bf16|f16|f32)>")


def _dot_kinds(text):
    return collections.Counter((a.split("x")[-1].rstrip(">"), b.split("x")[-1].rstrip(">"))
                               for a, b in _DOT.findall(text))


def _lowered_train_step(decoder, recipe):
    cls = ls2.TransformerDecoderLayer if decoder else ls2.TransformerEncoderLayer
    layer = cls(HIDDEN, FFN, HEADS, fp8=recipe, dtype=jnp.bfloat16, deterministic=True, rngs=nnx.Rngs(0))
    graphdef, variables, rest = nnx.split(layer, nnx.Any(nnx.Param, fp8.FP8Meta), ...)
    x, _ = _inputs(2, 16)
    args = (x, _inputs(2, 16, seed=1)[0]) if decoder else (x,)

    def loss(variables, *args):
        return jnp.sum(nnx.merge(graphdef, variables, rest)(*args).astype(jnp.float32) ** 2)
    # Differentiated w.r.t. the inputs too, so that every GEMM has its dgrad.
    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(1 + len(args))))).lower(variables, *args).as_text()


@pytest.mark.parametrize("decoder", [False, True])
def test_lowered_train_step_has_fp8_dot_generals_for_every_weight_gemm(decoder):
    text = _lowered_train_step(decoder, RECIPE)
    kinds = _dot_kinds(text)
    gemms = DECODER_GEMMS if decoder else ENCODER_GEMMS
    e4, e5 = "f8E4M3FN", "f8E5M2"
    # forward e4m3 x e4m3; dgrad e5m2 (output gradient) x e4m3 (weight); wgrad e4m3 x e5m2.
    assert kinds[(e4, e4)] == gemms + QKV_EXTRA_GEMMS and kinds[(e5, e4)] == gemms and kinds[(e4, e5)] == gemms, kinds
    assert sum(kinds.values()) == 3 * gemms + QKV_EXTRA_GEMMS + sum(n for k, n in kinds.items()
                                                                    if "f8" not in k[0] + k[1])
    # The dot_generals left in bf16/f32 are attention's (scores, context, their gradients):
    # the bf16 layer's dot_generals less its 3 per weight GEMM (forward, dgrad, wgrad),
    # q, k and v counted separately there.
    bf16_kinds = _dot_kinds(_lowered_train_step(decoder, None))
    assert not any("f8" in k[0] + k[1] for k in bf16_kinds)
    assert sum(n for k, n in kinds.items() if "f8" not in k[0] + k[1]) == sum(bf16_kinds.values()) - 3 * (gemms + QKV_EXTRA_GEMMS)
    assert not _UPCAST.findall(text), _UPCAST.findall(text)[:3]


def test_lowered_train_step_in_e4m3_format_has_e4m3_gradients():
    kinds = _dot_kinds(_lowered_train_step(False, fp8.DelayedScaling(fp8_format="e4m3", amax_history_len=4)))
    assert kinds[("f8E4M3FN", "f8E4M3FN")] == 3 * ENCODER_GEMMS + QKV_EXTRA_GEMMS and \
        not any("f8E5M2" in k for k in kinds), kinds


_CUBLASLT_FP8 = "__cublas$lt$matmul$f8"
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+) \(")


def _f8(dtype):
    return dtype.startswith("f8")


def compiled_gemm_inventory(text):
    """What a compiled (optimised) HLO program does with FP8 data.

    Returns a SimpleNamespace of lists of strings, each naming the instruction, its
    computation (and the fusion that calls it) and the element types involved:
    ``cublaslt_f8`` (one ``"lhs x rhs"`` per ``__cublas$lt$matmul$f8`` call), ``f8_dots``
    (dots or convolutions with an FP8 operand anywhere else: a Triton GEMM fusion, a plain
    fusion, XLA's own emitter), ``f8_fusions`` (every fusion with an FP8 operand, with
    its kind and backend), ``upcasts`` (converts from FP8 to a wider type), and
    ``targets`` (a Counter of every custom-call target).
    """
    types, calls, computation_of, instrs = {}, {}, {}, []
    current = None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(1)
            for name, dtype in re.findall(r"([\w.\-]+): (\w+)\[", line):  # parameters
                types[name] = dtype
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, rtype, op, rest = m.groups()
        types[name] = rtype.split("[")[0].lstrip("(")
        computation_of[name] = current
        operands = re.findall(r"%([\w.\-]+)", rest.split("),")[0] if ")," in rest else rest.rstrip(")"))
        instrs.append((name, rtype, op, operands, rest, current))
        for callee in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", rest):
            calls[callee] = (name, rest)

    def where(comp):
        caller = calls.get(comp)
        if caller is None:
            return comp
        kind = re.search(r"kind=(k\w+)", caller[1])
        backend = re.search(r'"kind":"([^"]+)"', caller[1])
        return (f"{comp} in fusion %{caller[0]} ({kind.group(1) if kind else '?'}"
                f"{', ' + backend.group(1) if backend else ''})")

    inv = SimpleNamespace(cublaslt_f8=[], f8_dots=[], f8_fusions=[], upcasts=[], targets=collections.Counter())
    for name, rtype, op, operands, rest, comp in instrs:
        in_types = [types.get(o, "?") for o in operands]
        kinds = " x ".join(in_types[:2])
        if op == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', rest)
            target = target.group(1) if target else "?"
            inv.targets[target] += 1
            if target == _CUBLASLT_FP8:
                inv.cublaslt_f8.append(kinds)
        elif op in ("dot", "convolution") and any(_f8(t) for t in in_types):
            inv.f8_dots.append(f"%{name} {op} {kinds} -> {rtype} in {where(comp)}")
        elif op == "fusion" and any(_f8(t) for t in in_types):
            kind = re.search(r"kind=(k\w+)", rest)
            backend = re.search(r'"kind":"([^"]+)"', rest)
            inv.f8_fusions.append(f"%{name} ({kind.group(1) if kind else '?'}"
                                  f"{', ' + backend.group(1) if backend else ''}) of {', '.join(in_types)} -> {rtype}")
        elif op == "convert" and in_types and _f8(in_types[0]) and not _f8(types[name]):
            inv.upcasts.append(f"%{name} {in_types[0]} -> {rtype} in {where(comp)}")
    return inv


def _describe(inv):
    return (f"cuBLASLt FP8 GEMMs ({len(inv.cublaslt_f8)}): {dict(collections.Counter(inv.cublaslt_f8))}\n"
            f"FP8 dots not on cuBLASLt ({len(inv.f8_dots)}): {inv.f8_dots}\n"
            f"upcasts from FP8 ({len(inv.upcasts)}): {inv.upcasts[:8]}\n"
            f"fusions with FP8 operands ({len(inv.f8_fusions)}): {inv.f8_fusions}\n"
            f"custom-call targets: {dict(inv.targets)}")


def test_compiled_gemm_inventory_reads_fp8_gemms_wherever_they_run():
    """The GPU test's reader of compiled HLO, on a program compiled here (XLA's CPU
    backend upcasts the FP8 operands, E4M3 and E5M2, inside fusions; no cuBLASLt call)
    and on lines in the GPU compiler's form."""
    graphdef, variables, rest = nnx.split(ls2.TransformerEncoderLayer(HIDDEN, FFN, HEADS, fp8=RECIPE,
                                                                      dtype=jnp.bfloat16, deterministic=True,
                                                                      rngs=nnx.Rngs(0)),
                                          nnx.Any(nnx.Param, fp8.FP8Meta), ...)
    x, _ = _inputs(2, 16)

    def loss(variables, x):
        return jnp.sum(nnx.merge(graphdef, variables, rest)(x).astype(jnp.float32) ** 2)
    inv = compiled_gemm_inventory(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(variables, x).compile().as_text())
    upcast_from = {u.split()[1] for u in inv.upcasts}
    assert not inv.cublaslt_f8 and upcast_from == {"f8e4m3fn", "f8e5m2"}, _describe(inv)
    gpu_like = "\n".join([
        "%fused_dot (param_0.1: f8e4m3fn[64,32], param_1.1: f8e5m2[32,16]) -> bf16[64,16] {",
        "  ROOT %dot.1 = bf16[64,16]{1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}",
        "}",
        "ENTRY %main (a: f8e4m3fn[64,32], b: f8e4m3fn[16,32], c: f8e5m2[32,16], s: f32[]) -> bf16[64,16] {",
        '  %cc = (bf16[64,16]{1,0}, s8[1024]{0}) custom-call(%a, %b, %s, %s), custom_call_target="__cublas$lt$matmul$f8"',
        '  %gemm_fusion = bf16[64,16]{1,0} fusion(%a, %c), kind=kCustom, calls=%fused_dot, '
        'backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}',
        "  ROOT %up = bf16[64,32]{1,0} convert(%a)",
        "}"])
    inv = compiled_gemm_inventory(gpu_like)
    assert inv.cublaslt_f8 == ["f8e4m3fn x f8e4m3fn"], _describe(inv)
    assert inv.f8_dots == ["%dot.1 dot f8e4m3fn x f8e5m2 -> bf16[64,16]{1,0} in fused_dot in fusion %gemm_fusion "
                           "(kCustom, __triton_gemm)"], _describe(inv)
    assert inv.f8_fusions == ["%gemm_fusion (kCustom, __triton_gemm) of f8e4m3fn, f8e5m2 -> bf16[64,16]{1,0}"]
    assert inv.upcasts == ["%up f8e4m3fn -> bf16[64,32]{1,0} in main"] and inv.targets[_CUBLASLT_FP8] == 1


@pytest.mark.gpu
def test_gpu_compiled_train_step_runs_every_weight_gemm_as_an_fp8_gemm():
    """At a size FP8 is meant for (hidden 1024, FFN 4096, 2048 tokens, bfloat16), every
    weight GEMM of the layer, forward (E4M3 x E4M3), dgrad and wgrad (E5M2 gradient
    with E4M3), is an FP8 tensor-core GEMM on its FP8 operands: a cuBLASLt FP8 call, or
    the Triton FP8 GEMM fusion that XLA's autotuner picks where it measures it faster;
    no FP8 dot runs anywhere else and no FP8 operand is upcast. A failure prints the
    program's whole FP8 inventory."""
    hidden, ffn, heads = 1024, 4096, 16
    layer = ls2.TransformerEncoderLayer(hidden, ffn, heads, fp8=RECIPE, dtype=jnp.bfloat16, deterministic=True,
                                        rngs=nnx.Rngs(0))
    graphdef, variables, rest = nnx.split(layer, nnx.Any(nnx.Param, fp8.FP8Meta), ...)
    x = jax.random.normal(jax.random.key(0), (2, 1024, hidden), jnp.bfloat16)

    def loss(variables, x):
        return jnp.sum(nnx.merge(graphdef, variables, rest)(x).astype(jnp.float32) ** 2)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    inv = compiled_gemm_inventory(step.lower(variables, x).compile().as_text())
    e4, e5 = "f8e4m3fn", "f8e5m2"
    triton = [d for d in inv.f8_dots if re.search(r"\(kCustom, __triton\w*gemm\w*\)$", d)]
    kinds = inv.cublaslt_f8 + [d.split(" dot ")[1].split(" -> ")[0] for d in triton]
    pairs = collections.Counter(" x ".join(sorted(k.split(" x "))) for k in kinds)
    assert len(triton) == len(inv.f8_dots), "FP8 dots outside FP8 GEMM kernels:\n" + _describe(inv)
    assert not inv.upcasts, "FP8 operands upcast:\n" + _describe(inv)
    assert pairs == {f"{e4} x {e4}": ENCODER_GEMMS + QKV_EXTRA_GEMMS, f"{e4} x {e5}": 2 * ENCODER_GEMMS}, \
        _describe(inv)
    value, (grads, dx) = step(variables, x)
    assert np.isfinite(float(value)) and bool(jnp.all(jnp.isfinite(dx)))
    for _, meta in nnx.to_flat_state(fp8.split_meta(grads)[1]):
        assert np.all(np.asarray(meta.get_value().observed_amax()) > 0)


def _step(graphdef, variables, rest, x, c):
    """The metas after one step that observed the layer on (x, c)."""
    def loss(variables):
        return jnp.sum(nnx.merge(graphdef, variables, rest)(x) * c)
    grads = jax.grad(loss)(variables)
    _, metas = fp8.split_meta(variables)
    return fp8.update_meta(metas, fp8.split_meta(grads)[1], RECIPE)


def _assert_identical_on_every_device(metas, expected):
    for a, b in zip(jax.tree.leaves(metas), jax.tree.leaves(expected)):
        shards = [np.asarray(s.data) for s in a.addressable_shards]
        assert len(shards) == 8
        for s in shards:
            np.testing.assert_array_equal(s, b)


def _layer(**kw):
    return ls2.TransformerEncoderLayer(HIDDEN, FFN, HEADS, fp8=RECIPE, deterministic=True, rngs=nnx.Rngs(0), **kw)


def test_batch_sharded_jit_gives_every_device_the_unsharded_scales():
    graphdef, variables, rest = nnx.split(_layer(), nnx.Any(nnx.Param, fp8.FP8Meta), ...)
    x, c = _inputs()
    expected = jax.jit(_step, static_argnums=0)(graphdef, variables, rest, x, c)
    mesh = mesh8()
    got = jax.jit(_step, static_argnums=0)(graphdef, shard(variables, mesh), shard(rest, mesh),
                                           shard(x, mesh, "data"), shard(c, mesh, "data"))
    _assert_identical_on_every_device(got, expected)


def test_shard_map_with_amax_axes_gives_every_device_the_unsharded_scales():
    graphdef, variables, rest = nnx.split(_layer(), nnx.Any(nnx.Param, fp8.FP8Meta), ...)
    sm_graphdef, sm_variables, sm_rest = nnx.split(_layer(fp8_amax_axes=("data",)), nnx.Any(nnx.Param, fp8.FP8Meta),
                                                   ...)
    x, c = _inputs()
    expected = jax.jit(_step, static_argnums=0)(graphdef, variables, rest, x, c)
    mesh = mesh8()
    per_device = lambda v, r, x, c: _step(sm_graphdef, v, r, x, c)
    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=P()))
    got = f(sm_variables, sm_rest, shard(x, mesh, "data"), shard(c, mesh, "data"))
    _assert_identical_on_every_device(got, expected)


def test_shard_map_without_amax_axes_is_refused():
    graphdef, variables, rest = nnx.split(_layer(), nnx.Any(nnx.Param, fp8.FP8Meta), ...)
    x, c = _inputs()
    mesh = mesh8()
    per_device = lambda v, r, x, c: _step(graphdef, v, r, x, c)
    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=P()))
    with pytest.raises(ValueError, match=r"fp8_dot: x and w vary over the mesh axes \('data',\)"):
        f(variables, rest, shard(x, mesh, "data"), shard(c, mesh, "data"))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"fp8": "hybrid"}, TypeError,
     r"TransformerEncoderLayer: fp8 must be None or a jax_ls2.fp8.DelayedScaling, got str"),
    ({"fp8": RECIPE, "hidden": 40, "heads": 4}, ValueError,
     r"TransformerEncoderLayer: fp8 needs hidden_size to be a multiple of 16 \(the K and N dims of its FP8 "
     r"GEMMs, as cuBLASLt takes them\), got 40"),
    ({"fp8": RECIPE, "ffn": 72}, ValueError, r"TransformerEncoderLayer: fp8 needs ffn_size to be a multiple of 16.*"
                                             r"got 72"),
    ({"fp8": RECIPE, "fp8_amax_axes": ("data", 0)}, TypeError,
     r"TransformerEncoderLayer: fp8_amax_axes must be a tuple of mesh axis names"),
])
def test_bad_fp8_options_are_refused(kwargs, error, match):
    kw = dict(kwargs)
    hidden, ffn, heads = kw.pop("hidden", HIDDEN), kw.pop("ffn", FFN), kw.pop("heads", HEADS)
    with pytest.raises(error, match=match):
        ls2.TransformerEncoderLayer(hidden, ffn, heads, rngs=nnx.Rngs(0), **kw)


def test_stack_and_attention_name_themselves_in_errors():
    with pytest.raises(ValueError, match=r"TransformerDecoder: fp8 needs hidden_size to be a multiple of 16"):
        ls2.TransformerDecoder(1, 40, 64, 4, fp8=RECIPE, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"MultiHeadAttention: fp8 needs hidden_size to be a multiple of 16"):
        ls2.MultiHeadAttention(24, 4, fp8=RECIPE, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"MultiHeadAttention: fp8 must be None or a jax_ls2.fp8.DelayedScaling"):
        ls2.MultiHeadAttention(32, 4, fp8=1, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("capability, refused", [("8.0", True), ("8.6", True), ("8.9", False), ("9.0", False)])
def test_gpus_without_fp8_are_refused(monkeypatch, capability, refused):
    fake = SimpleNamespace(platform="gpu", compute_capability=capability, device_kind="NVIDIA test GPU")
    monkeypatch.setattr(_common.jax, "devices", lambda *a: [fake])
    make = lambda: ls2.TransformerEncoderLayer(HIDDEN, FFN, HEADS, fp8=RECIPE, rngs=nnx.Rngs(0))
    if refused:
        with pytest.raises(ValueError, match=rf"TransformerEncoderLayer: fp8 needs a GPU with FP8 GEMMs \(CUDA "
                                             rf"compute capability 8.9 or newer.*got NVIDIA test GPU with compute "
                                             rf"capability {capability}"):
            make()
    else:
        make()


def test_linen_wrapper_keeps_the_params_collection():
    x, _ = _inputs(2, 8)
    with_fp8 = ls2_linen.TransformerEncoderLayer(HIDDEN, FFN, HEADS, fp8=RECIPE, deterministic=True)
    without = ls2_linen.TransformerEncoderLayer(HIDDEN, FFN, HEADS, deterministic=True)
    v8, v = with_fp8.init(jax.random.key(0), x), without.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, v8["params"]) == jax.tree.map(jnp.shape, v["params"])
    metas = {k: c for k, c in v8.items() if k != "params"}
    assert len(jax.tree.leaves(metas)) == 3 * ENCODER_GEMMS, jax.tree.map(jnp.shape, metas)
    assert list(metas) == ["FP8Meta"]
    grads = jax.grad(lambda v: jnp.sum(with_fp8.apply(v, x) ** 2))(v8)
    param_grads, stepped = fp8.apply_meta_updates(v8, grads, RECIPE)
    assert fp8.count_metas(param_grads) == 0 and jax.tree.structure(param_grads["params"]) == \
        jax.tree.structure(v8["params"])
    for meta in jax.tree.leaves(stepped["FP8Meta"], is_leaf=fp8.is_meta):
        assert np.all(np.asarray(meta.amax_history[:, 0]) > 0) and not np.all(np.asarray(meta.scale) == 1.0)
