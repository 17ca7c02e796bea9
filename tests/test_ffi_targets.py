"""Each FFI target is named once in Python, and every op reaches its targets when
lowered for CUDA (checked here without a GPU or the built extension: the targets are
declared registered, and lowering only writes their names into the program)."""
import ast
import collections
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

import jax_ls2.ops as ops
from jax_ls2 import _ffi
from jax_ls2._dispatch import forget_choices

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jax_ls2"
TARGET = re.compile(r"jax_ls2_[a-z0-9_]+")


def _target_literals():
    """(target, file:line) for every string literal of the package that is a target name."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and TARGET.fullmatch(node.value):
                found.append((node.value, f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"))
    return found


def test_each_target_name_is_written_once():
    places = collections.defaultdict(list)
    for name, where in _target_literals():
        places[name].append(where)
    assert len(places) >= 19, sorted(places)  # the ops' 17 targets and the optimizer's 2
    repeated = {name: where for name, where in places.items() if len(where) > 1}
    assert not repeated, f"FFI target names written more than once: {repeated}"


KEY = jax.random.key(0)
IDS = jnp.arange(24, dtype=jnp.int32).reshape(4, 6) % 5

# op -> (loss of (x, gamma), the targets its value and gradient must call)
CASES = {
    "layer_norm": (lambda x, g: ops.layer_norm(x, g, g).sum(), {"layer_norm_fwd", "layer_norm_bwd"}),
    "layer_norm residual": (lambda x, g: sum(t.sum() for t in ops.layer_norm(x, g, g, residual=x * 2)),
                            {"add_layer_norm_fwd", "add_layer_norm_bwd"}),
    "layer_norm return_input": (lambda x, g: sum(t.sum() for t in ops.layer_norm(x, g, g, return_input=True)),
                                {"layer_norm_fwd", "add_layer_norm_bwd"}),
    "layer_norm copies": (lambda x, g: sum((t * i).sum() for i, t in enumerate(ops.layer_norm(x, g, g, copies=3))),
                          {"layer_norm_fwd", "layer_norm_bwd_multi"}),
    "bias_dropout_residual": (lambda x, g: ops.bias_dropout_residual(x, g, x, rate=0.1, key=KEY).sum(),
                              {"bias_dropout_residual_fwd", "bias_dropout_residual_bwd"}),
    "bias_act_dropout": (lambda x, g: ops.bias_act_dropout(x, g, activation="gelu", rate=0.1, key=KEY).sum(),
                         {"bias_act_dropout_fwd", "bias_act_dropout_bwd"}),
    "softmax_dropout": (lambda x, g: ops.softmax_dropout(x, bias=x[:1], causal=True, rate=0.1, key=KEY).sum(),
                        {"softmax_dropout_fwd", "softmax_dropout_bwd"}),
    "embedding": (lambda x, g: ops.embedding(IDS, x[0], pos_table=x[1], grad_mode="sorted").sum(),
                  {"embedding_fwd", "embedding_bwd"}),
    "cross_entropy": (lambda x, g: ops.cross_entropy(x, IDS, ignore_index=-100)[0].sum(),
                      {"cross_entropy_fwd", "cross_entropy_bwd"}),
    "cross_entropy mean": (lambda x, g: ops.cross_entropy(x, IDS, reduction="mean")[0],
                           {"cross_entropy_fwd_grad", "cross_entropy_scale"}),
    "linear_cross_entropy": (lambda x, g: ops.linear_cross_entropy(x, x[0, :5], IDS, chunk_size=8)[0],
                             {"cross_entropy_fwd_grad"}),
    "rms_norm": (lambda x, g: ops.rms_norm(x, g, unit_offset=True).sum(), {"rms_norm_fwd", "rms_norm_bwd"}),
    "rms_norm residual": (lambda x, g: sum(t.sum() for t in ops.rms_norm(x, g, residual=x * 2)),
                          {"add_rms_norm_fwd", "rms_norm_bwd"}),
    "rms_norm copies": (lambda x, g: sum((t * i).sum() for i, t in enumerate(ops.rms_norm(x, g, copies=3,
                                                                                          return_input=True))),
                        {"rms_norm_fwd", "rms_norm_bwd"}),
    "rotary": (lambda x, g: sum((t * g).sum() for t in ops.rotary(x[..., None, :], x[..., None, :] * 2, IDS,
                                                                  interleaved=True)),
               {"rotary_fwd", "rotary_bwd"}),
    "gated_act_dropout": (lambda x, g: ops.gated_act_dropout(x, rate=0.1, key=KEY).sum(),
                          {"gated_act_dropout_fwd", "gated_act_dropout_bwd"}),
}


@pytest.fixture
def declared_targets(monkeypatch):
    names = frozenset(name for name, _ in _target_literals())
    monkeypatch.setattr(_ffi, "_load", lambda: (names, None))
    forget_choices()
    yield names
    forget_choices()


@pytest.mark.parametrize("case", sorted(CASES))
def test_lowering_for_cuda_calls_the_targets(case, declared_targets):
    loss, targets = CASES[case]
    x = jax.random.normal(jax.random.key(1), (4, 6, 32))
    g = jnp.ones((32,))
    text = jax.jit(jax.value_and_grad(loss, (0, 1))).trace(x, g).lower(lowering_platforms=("cuda",)).as_text()
    called = set(re.findall(r"custom_call @jax_ls2_([a-z0-9_]+)", text))
    assert called == targets
