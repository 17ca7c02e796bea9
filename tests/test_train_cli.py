"""The training command's interface: usage errors, --help, log lines, held-out evaluation,
metrics file and plot, checkpoint integrity, and the optimizer choice without fallback."""
import pytest

import jax_ls2.optim
from flax_models import training


def test_make_optimizer_raises_instead_of_falling_back(monkeypatch):
    def adamw(**kw):
        raise TypeError(f"adamw: unexpected keyword {sorted(kw)[0]!r}")

    monkeypatch.setattr(jax_ls2.optim, "adamw", adamw)
    with pytest.raises(TypeError, match="adamw: unexpected keyword"):
        training.make_optimizer(1e-3, 10, 2, fused=True)
    tx, name = training.make_optimizer(1e-3, 10, 2, fused=False)
    assert name == "optax.adamw"
