"""optax's own tests with jax_ls2.optim.adam/adamw/sgd in optax's place.

optax ships its tests with the package (``optax/**/*_test.py``, absl TestCases). This
module imports the ones that build adam, adamw or sgd, keeps their test classes here
so pytest collects them, and runs every case with ``optax.adam/adamw/sgd`` (and the
same names in optax's alias module, which the tests call through) replaced by
jax_ls2's. Only the cases that build one of the three run (`SELECTED`); `EXCLUDED`
lists those of them that cannot pass, each with its reason.
"""
import importlib
import inspect
import re
import sys
import types
import unittest

import optax
import pytest
from optax._src import alias as optax_alias  # the module optax's tests call adam/sgd through

from jax_ls2 import optim

REPLACED = ("adam", "adamw", "sgd")
OURS = r"(adam|adamw|sgd|sgd_mom)"

# module -> regular expressions matched against "Class.method (parameters)" of each
# case: those that build adam, adamw or sgd (optax's parameterized names are numbered,
# so the parameters decide).
SELECTED = {
    "optax._src.alias_test": [rf"AliasTest\.test_\w+ \(.*opt_name='{OURS}'"],
    "optax._src.combine_test": [r"ComposeTest", r"ExtraArgsTest", r"PartitionTest", r"NamedChainTest"],
    "optax.transforms._masking_test": [r"MaskedTest"],
    "optax.transforms._conditionality_test": [r"ConditionalityTest", r"ConditionallyMaskTest",
                                              r"ConditionallyTransformTest"],
    "optax.transforms._accumulation_test": [r"AccumulationTest\.test_multi_steps"],
    "optax.transforms._freezing_test": [r"FreezeTest"],
    "optax.schedules._inject_test": [r"InjectHyperparamsTest"],
    "optax.tree_utils._state_utils_test": [r"StateUtilsTest"],
    "optax._src.sharding_test": [rf"ShardingTest\.test_\w+_{OURS} ", r"ShardingTest\.test_microbatch"],
}

# regular expression -> why those cases cannot pass with jax_ls2's transformations.
EXCLUDED = {
    r"AliasTest\.test_explicit_dtype\d+ \(.*opt_name='sgd_mom'\)":
        "reads optax.tree.get(state, 'trace'), None here: one FusedState type serves the three optimizers "
        "and holds sgd's momentum as mu",
    r"AliasTest\.test_explicit_dtype\d+ \(.*state_dtype='bfloat16', opt_name='adamw?'\)":
        "mu_dtype=bfloat16 alone raises at construction: the kernel stores mu and nu in one dtype "
        "(moment_dtype=jnp.bfloat16 makes both bfloat16)",
    r"AliasTest\.test_explicit_dtype\d+ \(.*state_dtype='complex64', opt_name='adamw?'\)":
        "mu_dtype=complex64 raises at construction (the kernel's moments are float32 or bfloat16); complex "
        "params get complex moments by default, through optax's per-leaf math",
    r"AliasTest\.test_explicit_dtype\d+ \(params_dtype='bfloat16', state_dtype=None, opt_name='adamw?'\)":
        "expects bfloat16 moments for bfloat16 params; the fused optimizer's moments default to float32 "
        "(moment_dtype=jnp.bfloat16 asks for bfloat16)",
    r"MaskedTest\.test_masked_state_structure":
        "reads inner_state[0].trace of a masked sgd as a params-shaped tree with MaskedNodes; the fused "
        "state is one FusedState (its [0] is count) of flat buffers",
    r"StateUtilsTest\.test_adam":
        "compares tree_map_params's result with optax's (ScaleByAdamState, EmptyState) holding params-shaped "
        "specs; the fused state is one FusedState whose flat (total,) buffers take transform_non_params "
        "(jax_ls2.optim.moments gives params-shaped views)",
    r"StateUtilsTest\.test_inject_hparams":
        "reads inner_state[0].mu as a params-shaped tree; the inner state is one FusedState (its [0] is "
        "count) with flat (total,) moments",
    r"StateUtilsTest\.test_map_non_params_to_none":
        "compares with optax's (ScaleByAdamState, ScaleByScheduleState) with mu={'a': 1}; the fused state "
        "is one FusedState whose flat moments are not params-shaped, so they map to None",
    r"FreezeTest\.test_bad_structure_raises":
        "builds no adam/adamw/sgd and fails with optax's own code too: jax 0.11 words the tree error "
        "differently from the message it expects",
}


def _import_optax_test(module_name):
    """optax's alias_test imports scikit-learn (not installed here) for its L-BFGS
    cases, none of which is selected; a stand-in lets the module import."""
    stand_in = types.ModuleType("sklearn")
    stand_in.datasets = stand_in.linear_model = None
    had = "sklearn" in sys.modules
    sys.modules.setdefault("sklearn", stand_in)
    try:
        return importlib.import_module(module_name)
    finally:
        if not had:
            del sys.modules["sklearn"]


def _case_id(cls, cls_name, method):
    return f"{cls_name}.{method} {getattr(getattr(cls, method), '__x_params_repr__', '')}"


def _selected(case_id, patterns):
    return any(re.match(p, case_id) for p in patterns) and not any(re.match(e, case_id) for e in EXCLUDED)


def _test_classes():
    """Subclasses of optax's TestCases holding only the selected test methods."""
    found = {}
    for module_name, patterns in SELECTED.items():
        module = _import_optax_test(module_name)
        for name, cls in vars(module).items():
            if not (inspect.isclass(cls) and issubclass(cls, unittest.TestCase) and cls.__module__ == module_name):
                continue
            names = unittest.TestLoader().getTestCaseNames(cls)
            keep = [m for m in names if _selected(_case_id(cls, name, m), patterns)]
            if keep:
                dropped = {m: None for m in names if m not in keep}
                found[f"{module_name.rsplit('.', 1)[-1]}__{name}"] = type(name, (cls,), dropped)
    return found


for _name, _cls in _test_classes().items():
    globals()[_name] = _cls


@pytest.fixture(autouse=True)
def jax_ls2_in_optax_place(monkeypatch):
    for name in REPLACED:
        monkeypatch.setattr(optax, name, getattr(optim, name))
        monkeypatch.setattr(optax_alias, name, getattr(optim, name))
