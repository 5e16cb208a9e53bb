"""`chunk_kda`'s dispatch and its checked mode for the gate lower bound (issue 12, item 6).

A float `gate_lower_bound` promises g >= g_min and sends the chunked backends down the dense
diagonal tiles; decays below the promise overflow there. `checked=True` verifies the promise
under `jax.experimental.checkify`.
"""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from pallas_kernels.kda import api, chunk_kda, pallas_tpu, reference, xla

import kda_testing as kt

SEED = 11


def _inputs(seed, g_lo, g_hi, *, segments=False):
  print(f"seed={seed}")
  inp = kt.make_inputs(seed, 1, 64, 2, 16, 16, dtype=jnp.float32, segments=segments)
  rng = np.random.default_rng(seed)
  inp["g"] = jnp.asarray(rng.uniform(g_lo, g_hi, inp["g"].shape), jnp.float32)
  return inp


def _run(inp, **kw):
  args = [inp[n] for n in ("q", "k", "v", "g", "beta")]
  f = lambda *a: chunk_kda(*a, backend="xla", chunk_size=16, gate_lower_bound=-5.0,
                           segment_ids=inp["segment_ids"], **kw)[0]
  return args, f


def test_checked_mode_reports_decays_below_the_bound():
  inp = _inputs(SEED, -8.0, -5.0)  # every decay violates the promised g >= -5
  args, f = _run(inp, checked=True)
  err, o = checkify.checkify(jax.jit(f))(*args)
  msg = err.get()
  assert msg is not None and "gate_lower_bound=-5.0" in msg, msg
  reported = float(re.search(r"min g = (-?[0-9.e+-]+)", msg).group(1))  # the offending value
  np.testing.assert_allclose(reported, float(jnp.min(inp["g"])), rtol=1e-5)
  with pytest.raises(Exception, match="below gate_lower_bound"):
    err.throw()
  # What the check guards against: unchecked, the same call returns non-finite outputs.
  _, unchecked = _run(inp)
  assert not np.all(np.isfinite(np.asarray(jax.jit(unchecked)(*args))))


def test_checked_mode_passes_decays_inside_the_bound_and_changes_nothing():
  inp = _inputs(SEED + 1, -5.0, -0.01)
  args, f = _run(inp, checked=True)
  err, o = checkify.checkify(jax.jit(f))(*args)
  assert err.get() is None
  _, unchecked = _run(inp)
  np.testing.assert_array_equal(np.asarray(o), np.asarray(jax.jit(unchecked)(*args)))
  assert np.all(np.isfinite(np.asarray(o)))


def test_checked_mode_ignores_padding_tokens():
  inp = _inputs(SEED + 2, -5.0, -0.01, segments=True)
  seg = np.asarray(inp["segment_ids"])
  assert (seg == 0).any()
  g = np.asarray(inp["g"]).copy()
  g[seg == 0] = -50.0  # padding is an identity step: its g is never used
  inp["g"] = jnp.asarray(g)
  args, f = _run(inp, checked=True)
  err, _ = checkify.checkify(f)(*args)  # eager too
  assert err.get() is None


def test_backends_declare_where_they_run():
  # The decisions read only `platform` (and a GPU's compute capability): stand-in devices, so
  # the test also runs where the CPU platform is not initialised (JAX_PLATFORMS=cuda).
  cpu = types.SimpleNamespace(platform="cpu", device_kind="cpu")
  hopper = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200",
                                 compute_capability="9.0")
  ampere = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100",
                                 compute_capability="8.0")
  assert api.resolve_backend("auto", hopper) == "pallas_gpu"
  assert api.resolve_backend("auto", ampere) == "xla"
  assert reference.supported_on(cpu) and xla.supported_on(cpu)
  assert not pallas_tpu.supported_on(cpu)
  assert api.resolve_backend("auto", cpu) == "xla"
  assert api.resolve_backend("reference", cpu) == "reference"
  with pytest.raises(ValueError, match="backend='fast'"):
    inp = _inputs(SEED, -1.0, -0.1)
    chunk_kda(*[inp[n] for n in ("q", "k", "v", "g", "beta")], backend="fast")


def test_wrong_rank_inputs_name_the_argument_and_its_layout():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, 8, 2, 16)), jnp.float32)
  g = -jnp.abs(q)
  beta = jnp.full((1, 8, 2), 0.5)
  for bad, name, dims in ((dict(q=q[0]), "q", r"\[B, T, H, K\]"),
                          (dict(v=q[0]), "v", r"\[B, T, H, V\]"),
                          (dict(beta=beta[0]), "beta", r"\[B, T, H\]")):
    args = dict(q=q, k=q, v=q, g=g, beta=beta) | bad
    with pytest.raises(ValueError, match=rf"^{name} has shape .*: expected {dims}"):
      chunk_kda(**args, backend="xla")


def test_checked_mode_reports_a_positive_decay():
  """g > 0 (a growing state) gave all-NaN outputs with checked=True silent: it tested only
  the lower bound."""
  inp = _inputs(SEED + 3, -2.0, -0.1)
  g = np.asarray(inp["g"]).copy()
  g[0, 5, 1, 3] = 0.7
  inp["g"] = jnp.asarray(g)
  args, f = _run(inp, checked=True)
  err, _ = checkify.checkify(jax.jit(f))(*args)
  msg = err.get()
  assert msg is not None and "g is positive (max g = 0.69999" in msg, msg


def test_cu_seqlens_give_the_segment_ids_of_one_packed_row():
  """fla's varlen form: documents [0, 3), [3, 3) (empty), [3, 7), then padding to 9. Each
  document computed through the ids equals that document alone from a zero state."""
  ids = np.asarray(api.segment_ids_from_cu_seqlens(np.array([0, 3, 3, 7]), 9))
  np.testing.assert_array_equal(ids, [[1, 1, 1, 3, 3, 3, 3, 0, 0]])
  assert api.segment_ids_from_cu_seqlens(jnp.array([0, 4], jnp.int32), 4).dtype == jnp.int32
  for bad in ([1, 4], [0, 5, 3], [0, 10]):
    with pytest.raises(ValueError, match="cu_seqlens"):
      api.segment_ids_from_cu_seqlens(np.array(bad), 9)
  inp = kt.make_inputs(SEED + 4, 1, 9, 2, 16, 16, dtype=jnp.float32, initial_state=False)
  args = [inp[n] for n in ("q", "k", "v", "g", "beta")]
  o, _ = chunk_kda(*args, segment_ids=jnp.asarray(ids), backend="xla", chunk_size=16)
  for lo, hi in ((0, 3), (3, 7)):
    alone, _ = reference.recurrent_kda(*[a[:, lo:hi] for a in args])
    np.testing.assert_allclose(np.asarray(o[:, lo:hi]), np.asarray(alone), atol=1e-5)
  assert not np.asarray(o[:, 7:]).any()  # padding outputs zero


def test_static_arguments_and_the_state_are_checked_by_name():
  inp = _inputs(SEED + 5, -1.0, -0.1)
  args = [inp[n] for n in ("q", "k", "v", "g", "beta")]
  B, T, H, K = inp["q"].shape
  V = inp["v"].shape[-1]
  with pytest.raises(ValueError, match="initial_state dtype int32: expected float32"):
    chunk_kda(*args, initial_state=jnp.zeros((B, H, K, V), jnp.int32), backend="xla")
  with pytest.raises(ValueError, match="initial_state is a list"):
    chunk_kda(*args, initial_state=[[0.0]], backend="xla")
  with pytest.raises(ValueError, match="gate_lower_bound must be a Python float"):
    jax.jit(lambda b: chunk_kda(*args, gate_lower_bound=b, backend="xla")[0])(-5.0)
  with pytest.raises(ValueError, match="scale must be a Python float for backend='pallas_tpu'"):
    jax.jit(lambda s: chunk_kda(*args, scale=s, backend="pallas_tpu", interpret=True)[0])(0.25)
  # the xla backend takes a traced scale (and differentiates through it)
  d = jax.grad(lambda s: chunk_kda(*args, scale=s, backend="xla")[0].sum())(0.25)
  assert np.isfinite(float(d))
