"""Where a psum's sum lands: in its operand's buffer when XLA can give it up (a donated
argument, an intermediate), in a fresh output when the operand is a parameter the caller
keeps (jbps/ops/kept_operands.py), never in the kept parameter itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jbps
from jbps.config import Config

# 3 MiB of float32: over the 2 MiB the handler backs with a huge page.
N = 3 << 18


def custom_call_line(compiled_text):
    [line] = [ln for ln in compiled_text.splitlines() if 'custom_call_target="jbps_psum"' in ln]
    return line


def test_a_kept_parameter_is_summed_into_a_fresh_output_and_left_as_it_was(session):
    x = jnp.arange(N, dtype=jnp.float32)
    expected = np.asarray(x).copy()
    f = jax.jit(lambda t: jbps.psum(t, name="kept"))
    compiled = f.lower(x).compile().as_text()
    # No aliasing, so XLA copies nothing into the output before the call: the engine writes it.
    assert "output_to_operand_aliasing" not in custom_call_line(compiled)
    assert " copy(" not in compiled
    for _ in range(3):
        y = f(x)
        np.testing.assert_array_equal(np.asarray(y), expected)  # one worker: the sum is x
        np.testing.assert_array_equal(np.asarray(x), expected)  # the kept input is untouched


def test_a_donated_parameter_is_summed_in_place(session):
    f = jax.jit(lambda t: jbps.psum(t, name="donated"), donate_argnums=0)
    x = jnp.arange(N, dtype=jnp.float32)
    assert "output_to_operand_aliasing" in custom_call_line(f.lower(x).compile().as_text())
    for _ in range(3):
        x = f(x)
    np.testing.assert_array_equal(np.asarray(x), np.arange(N, dtype=np.float32))


def test_an_intermediate_is_summed_in_place(session):
    f = jax.jit(lambda t: jbps.psum(t * 2, name="intermediate"))
    x = jnp.arange(N, dtype=jnp.float32)
    assert "output_to_operand_aliasing" in custom_call_line(f.lower(x).compile().as_text())
    np.testing.assert_array_equal(np.asarray(f(x)), 2 * np.arange(N, dtype=np.float32))


def test_kept_leaves_next_to_donated_and_computed_ones(session):
    # One call, three leaves: each lands where its own operand allows.
    f = jax.jit(lambda a, b: jbps.psum({"a": a, "b": b, "c": a + b}, name="mixed"), donate_argnums=1)
    a, b = jnp.ones(N, jnp.float32), jnp.full(N, 2.0, jnp.float32)
    out = f(a, b)
    assert float(out["a"][0]) == 1 and float(out["b"][-1]) == 2 and float(out["c"][7]) == 3
    assert float(a[5]) == 1


@pytest.mark.parametrize("raw,expected", [("1", True), ("0", False), ("off", False)])
def test_huge_pages_is_an_option(raw, expected):
    assert Config.resolve({}, {"JBPS_HUGE_PAGES": raw}).huge_pages is expected
    assert Config.resolve({"huge_pages": raw}, {}).huge_pages is expected
    assert Config.resolve({}, {}).huge_pages is True


def test_sums_are_the_same_without_huge_pages(server):
    with jbps.init(servers=[server], num_workers=1, worker_rank=0, huge_pages=False) as s:
        assert s.config.huge_pages is False
        x = jnp.arange(N, dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda t: jbps.psum(t, name="small pages"))(x)), np.asarray(x))
