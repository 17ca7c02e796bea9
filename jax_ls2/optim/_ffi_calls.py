"""Dispatch of the fused optimizer: the CUDA FFI targets where the platform is CUDA
and the extension is built, the pure-JAX reference (``_reference.py``) elsewhere.

Each step is ONE custom call over the whole pytree, whatever its number of leaves;
inside it the handler launches ceil(L / 256) kernels per pass (see
``csrc/kernels/optimizer.h``). Every written buffer is aliased to its input
(params or grads, moments, master weights, the accumulator), so under ``jit`` with
donated arguments the update happens in place.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ls2._dispatch import result_type, select_impl
from jax_ls2.optim import _abi as A
from jax_ls2.optim import _reference
from jax_ls2.optim._layout import Layout, offsets_attr, workspace_size

UPDATE_TARGET = "jax_ls2_optim_update"
ACCUMULATE_TARGET = "jax_ls2_optim_accumulate"


def _dispatch(name: str, reference, cuda, args):
    return select_impl(name, reference, cuda)(*args)


def fused_update(grads: list, params: list, mu, nu, master, hp, seed, *, algo: int, flags: int,
                 layout: Layout, decay: tuple):
    """One fused optimizer step over every leaf (see ``_reference.fused_update`` for the
    arguments and results). Returns (outs, mu, nu, master, stats)."""
    L = len(params)
    n_g = len(grads)
    state_in = [x for x in (mu, nu, master) if x is not None]
    args = (*grads, *params, *state_in, hp, seed)
    norm_pass = bool(flags & (A.CHECK | A.CLIP))
    report = bool(flags & A.REPORT) and not norm_pass

    def split(flat_args):
        g = list(flat_args[:n_g])
        p = list(flat_args[n_g:n_g + L])
        rest = list(flat_args[n_g + L:])
        m = rest.pop(0) if mu is not None else None
        v = rest.pop(0) if nu is not None else None
        w = rest.pop(0) if master is not None else None
        return g, p, m, v, w, rest[0], rest[1]

    def reference(*flat_args):
        g, p, m, v, w, h, s = split(flat_args)
        outs, m, v, w, stats = _reference.fused_update(g, p, m, v, w, h, s, algo=algo, flags=flags,
                                                        layout=layout, decay=decay)
        return (*outs, *[x for x in (m, v, w) if x is not None], stats)

    def cuda(*flat_args):
        g, p, m, v, w, h, s = split(flat_args)
        apply = bool(flags & A.APPLY)
        if apply:
            out_types = [result_type(x) for x in p]
            aliases = {n_g + i: i for i in range(L)}
        else:
            out_types = [result_type(p[i], dtype=(g[0].dtype if flags & A.FLAT_GRADS else g[i].dtype))
                         for i in range(L)]
            aliases = {} if flags & A.FLAT_GRADS else {i: i for i in range(L)}
        state = [x for x in (m, v, w) if x is not None]
        for k, x in enumerate(state):
            aliases[n_g + L + k] = L + k
        res_types = out_types + [result_type(x) for x in state]
        if norm_pass:
            res_types += [result_type(h, shape=(2,)), result_type(h, shape=(workspace_size(L),))]
        elif report:
            res_types.append(result_type(h, shape=(1,), dtype=jnp.int32))
        call = jax.ffi.ffi_call(UPDATE_TARGET, res_types, input_output_aliases=aliases,
                                vmap_method="sequential")
        res = call(*flat_args, algo=np.int32(algo), flags=np.int32(flags),
                   offsets=offsets_attr(layout), decay=np.asarray(decay, dtype=np.int32))
        res = list(res)
        if norm_pass:
            stats = res[L + len(state)]
        elif report:
            stats = jnp.stack([jnp.float32(0), (res[L + len(state)][0] == 0).astype(jnp.float32)])
        else:
            stats = jnp.zeros((2,), jnp.float32)
        return (*res[:L + len(state)], stats)

    res = _dispatch(UPDATE_TARGET, reference, cuda, args)
    outs = list(res[:L])
    rest = list(res[L:])
    new_mu = rest.pop(0) if mu is not None else None
    new_nu = rest.pop(0) if nu is not None else None
    new_master = rest.pop(0) if master is not None else None
    return outs, new_mu, new_nu, new_master, rest[0]


def accumulate(acc: jax.Array, scale: jax.Array, grads: list, *, layout: Layout) -> jax.Array:
    """acc (total,) f32 += scale (1,) f32 * grads (L leaves), one custom call."""
    args = (acc, scale, *grads)

    def reference(a, s, *g):
        return _reference.accumulate(a, s, list(g), layout=layout)

    def cuda(a, s, *g):
        call = jax.ffi.ffi_call(ACCUMULATE_TARGET, result_type(a), input_output_aliases={0: 0},
                                vmap_method="sequential")
        return call(a, s, *g, offsets=offsets_attr(layout))

    return _dispatch(ACCUMULATE_TARGET, reference, cuda, args)
