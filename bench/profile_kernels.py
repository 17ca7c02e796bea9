"""Runs each fused op once at a large shape (and its XLA reference) so that
`ncu` can report per-kernel device time and DRAM bytes:

  ncu --clock-control none --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
      python3 -m bench.profile_kernels
"""
import jax
import jax.numpy as jnp

import jax_ls2.ops as ops
from bench.bench_layer_norm import xla_layer_norm


def main():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    for shape in [(16384, 768), (8192, 4096)]:
        x = jax.random.normal(k1, shape, jnp.bfloat16)
        dy = jax.random.normal(k2, shape, jnp.bfloat16)
        g = jnp.ones(shape[-1], jnp.bfloat16)
        b = jnp.zeros(shape[-1], jnp.bfloat16)
        for name, f in [("ours", ops.layer_norm), ("xla", xla_layer_norm)]:
            fwd = jax.jit(f)
            bwd = jax.jit(lambda x, g, b, dy, f=f: jax.vjp(f, x, g, b)[1](dy))
            jax.block_until_ready(fwd(x, g, b))
            jax.block_until_ready(bwd(x, g, b, dy))
            print("profiled", name, shape, flush=True)
    names = [n for n in ("bias_dropout_residual", "softmax_dropout") if hasattr(ops, n)]
    print("ops present:", names)


if __name__ == "__main__":
    main()
