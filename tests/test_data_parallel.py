"""jbps.value_and_grad: a plain jax.jit over a mesh trains as the same program
does in one process on the whole batch (tests/workers/data_parallel_train.py:
1-D data mesh, 2-D data x model with the partitioner's model parallelism,
explicit sharding under jax.set_mesh; and random models on random meshes of
these kinds), pushing each worker's gradients once,
not once per device; and its refusals, each naming what is at fault."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jbps
from conftest import case_reports, check_case, worker_outputs, worker_script
from test_launch import PYTHON, base_env, jbps_run, run

SCRIPT = worker_script("data_parallel_train.py")
_spec = importlib.util.spec_from_file_location("data_parallel_cases", SCRIPT)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
CASES = _module.CASES


@pytest.fixture(scope="module")
def alone():
    env = base_env(XLA_FLAGS="--xla_force_host_platform_device_count=4", JBPS_TIMEOUT_S="60")
    proc, out, err = run([PYTHON, SCRIPT], env, timeout=300)
    return [(case_reports(out), proc.returncode, err)]


@pytest.fixture(scope="module")
def two_workers():
    env = base_env(JBPS_TIMEOUT_S="60")
    proc, out, err = jbps_run(["-n", "2", "--servers", "2", "--local-devices", "4", PYTHON, SCRIPT], env, timeout=300)
    return [(case_reports(lines), proc.returncode, err) for lines in worker_outputs(out, 2)]


@pytest.mark.parametrize("case", CASES)
def test_one_worker_trains_as_one_process_on_the_whole_batch(alone, case):
    check_case(alone, case)


@pytest.mark.parametrize("case", CASES)
def test_two_workers_train_as_one_process_on_the_whole_batch(two_workers, case):
    check_case(two_workers, case)


def loss(params, x):
    return jnp.mean((x @ params["w"]) ** 2)


PARAMS = {"w": np.ones((3, 2), np.float32)}


def mesh_of(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def test_in_process_gradient_equals_jax_on_the_whole_batch(session):
    mesh = mesh_of((4,), ("data",))
    x = np.random.default_rng(3).standard_normal((8, 3)).astype(np.float32)
    value, grads = jax.jit(jbps.value_and_grad(loss, mesh=mesh))(
        PARAMS, jax.device_put(x, NamedSharding(mesh, P("data")))
    )
    want_value, want = jax.value_and_grad(loss)(PARAMS, x)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads["w"]), np.asarray(want["w"]), rtol=1e-5)


def test_a_mesh_without_the_data_axis_is_refused_naming_it(session):
    mesh = mesh_of((4,), ("batch",))
    with pytest.raises(ValueError, match=r"no axis 'data' \(its axes: \('batch',\)\)"):
        jax.jit(jbps.value_and_grad(loss, mesh=mesh))(PARAMS, np.ones((8, 3), np.float32))


def test_a_batch_the_data_axis_does_not_divide_is_refused_naming_the_leaf(session):
    mesh = mesh_of((4,), ("data",))
    with pytest.raises(ValueError, match=r"argument 1 has shape \(6, 3\).*4 devices of axis 'data'"):
        jax.jit(jbps.value_and_grad(loss, mesh=mesh))(PARAMS, np.ones((6, 3), np.float32))


def test_no_mesh_is_refused_saying_how_to_give_one(session):
    with pytest.raises(ValueError, match="no mesh: pass mesh="):
        jax.jit(jbps.value_and_grad(loss))(PARAMS, np.ones((8, 3), np.float32))


def test_bad_argnums_are_refused(session):
    with pytest.raises(ValueError, match="argnums"):
        jbps.value_and_grad(loss, argnums=-1)


@pytest.mark.skipif(not hasattr(jax, "set_mesh"), reason="explicit sharding needs jax.set_mesh")
def test_a_parameter_split_over_the_data_axis_is_refused_naming_it(session):
    types = jax.sharding.AxisType
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",), axis_types=(types.Explicit,))
    with jax.set_mesh(mesh):
        params = {"w": jax.device_put(np.ones((4, 2), np.float32), P("data"))}
        with pytest.raises(ValueError, match=r"parameter argument 0\['w'\] is sharded over the data axis 'data'"):
            jax.jit(jbps.value_and_grad(loss))(params, np.ones((8, 4), np.float32))
