"""jax_ls2.parallel.make_mesh / parse_mesh_spec on the 8 simulated CPU devices (see conftest)."""
import re

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from jax_ls2 import parallel


def _ids(mesh):
    return np.vectorize(lambda d: d.id)(mesh.devices)


def test_mesh_has_all_axes_tensor_innermost_and_auto():
    mesh = parallel.make_mesh("data=2,tensor=4")
    assert mesh.axis_names == ("pipe", "data", "seq", "tensor") == parallel.AXES
    assert dict(mesh.shape) == {"pipe": 1, "data": 2, "seq": 1, "tensor": 4}
    assert mesh.axis_types == (AxisType.Auto,) * 4
    # consecutive device ids along the tensor axis, then data
    np.testing.assert_array_equal(_ids(mesh), np.arange(8).reshape(1, 2, 1, 4))


def test_mesh_orders_every_axis_by_id():
    mesh = parallel.make_mesh("pipe=2,data=1,seq=2,tensor=2")
    np.testing.assert_array_equal(_ids(mesh), np.arange(8).reshape(2, 1, 2, 2))


def test_mesh_sorts_devices_by_id_whatever_the_order_given():
    mesh = parallel.make_mesh("data=4,tensor=2", devices=jax.devices()[::-1])
    np.testing.assert_array_equal(_ids(mesh), np.arange(8).reshape(1, 4, 1, 2))


def test_aliases_dicts_spaces_and_case_give_the_same_sizes():
    want = {"pipe": 1, "data": 2, "seq": 2, "tensor": 2}
    assert parallel.parse_mesh_spec("data=2,tensor=2,seq=2") == want
    assert parallel.parse_mesh_spec(" DP = 2 , tp=2, sequence=2 ,") == want
    assert parallel.parse_mesh_spec({"dp": 2, "model": 2, "sp": np.int64(2)}) == want
    pipe2 = {**dict.fromkeys(parallel.AXES, 1), "pipe": 2}
    assert parallel.parse_mesh_spec("pipeline=2") == parallel.parse_mesh_spec("pp=2") == pipe2
    assert parallel.parse_mesh_spec(None) == parallel.parse_mesh_spec("") == dict.fromkeys(parallel.AXES, 1)
    assert list(parallel.parse_mesh_spec("tensor=2,pipe=2")) == list(parallel.AXES)


def test_mesh_on_a_subset_of_devices():
    mesh = parallel.make_mesh({"tensor": 2}, devices=jax.devices()[2:4])
    assert dict(mesh.shape)["tensor"] == 2 and mesh.devices.size == 2


@pytest.mark.parametrize("spec, words", [
    ("data=3", ["data=3 multiply to 3", "8 devices", "data=8 would fit"]),
    ("tensor=4", ["tensor=4 multiply to 4", "8 devices", "data=2 would fit"]),
    ("data=2,tensor=2,seq=4", ["multiply to 16", "8 devices", "data=1 would fit"]),
    ("tensor=3", ["multiply to 3", "8 devices", "sizes must multiply to 8"]),
    ("", ["(all axes 1)", "data=8 would fit"]),
])
def test_sizes_that_do_not_match_the_device_count(spec, words):
    with pytest.raises(ValueError, match="make_mesh") as info:
        parallel.make_mesh(spec)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("spec, error, words", [
    ("data=2,heads=4", ValueError, ["unknown axis 'heads'", "pipe, data, seq, tensor"]),
    ("data=0,tensor=8", ValueError, ["axis 'data'", "positive integer, got 0"]),
    ("tensor=-2", ValueError, ["axis 'tensor'", "positive integer, got -2"]),
    ("tensor=two", ValueError, ["axis 'tensor'", "'two'"]),
    ("tensor=2.5", ValueError, ["axis 'tensor'", "'2.5'"]),
    ("data,tensor=8", ValueError, ["axis=size", "'data'"]),
    ("=2", ValueError, ["axis=size"]),
    ("data=2,dp=4", ValueError, ["axis 'data' is given twice", "'data'", "'dp'"]),
    ({"tensor": 2.0}, TypeError, ["axis 'tensor'", "must be an int", "float"]),
    ({"tensor": True}, TypeError, ["axis 'tensor'", "bool"]),
    ({4: 2}, TypeError, ["axis names must be strings"]),
    (8, TypeError, ["spec must be a string", "int"]),
])
def test_bad_specs_name_what_to_change(spec, error, words):
    with pytest.raises(error, match="parse_mesh_spec") as info:
        parallel.make_mesh(spec)
    for word in words:
        assert word in str(info.value)


def test_empty_device_list():
    with pytest.raises(ValueError, match="make_mesh: devices is empty"):
        parallel.make_mesh("", devices=[])


def test_a_device_given_twice_is_named():
    d0, d1 = jax.devices()[:2]
    with pytest.raises(ValueError, match=rf"make_mesh: devices must be distinct, got {re.escape(repr(d0))} \(2 times\)$"):
        parallel.make_mesh("data=2", devices=[d0, d0])
    with pytest.raises(ValueError, match=rf"got {re.escape(repr(d1))} \(3 times\)$"):
        parallel.make_mesh("data=4", devices=[d1, d0, d1, d1])
