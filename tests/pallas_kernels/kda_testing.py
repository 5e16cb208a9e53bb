"""Shared helpers for the KDA operator tests (every backend uses these).

Test contract: ARCHITECTURE.md §2.5 (fla's published tolerances, relative RMSE against the naive
reference on fresh random inputs). Source of the operator: Kimi Linear (arXiv 2510.26692).

Contents:
  rel_rmse(ref, out)            ||ref - out||_2 / ||ref||_2 in float64.
  make_inputs(...)              random q, k, v, g, beta (+ initial state, segment ids) with gate
                                modes "bounded", "saturated", "near_zero", "unbounded".
  random_segment_ids(...)       packed-document ids [B, T] int32 with random boundaries and
                                optional padding (id 0).
  reference_fp64(inputs, ...)   recurrent_kda in float64 (x64 enabled locally), with gradients.
  run_with_grads(fn, inputs)    (o, final_state, grads dict) of a random-cotangent loss.
  nan_like(x), poison(tree)     NaN-filled buffers, for output poisoning.
  assert_all_finite(tree)       every leaf finite.
  TOL_BF16, TOL_FP32            per-quantity tolerances.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

import jax
import jax.numpy as jnp

GATE_MODES = ("bounded", "saturated", "near_zero", "unbounded")

# ARCHITECTURE.md §2.5 for bf16 inputs; fp32 inputs are held much tighter.
TOL_BF16 = dict(o=5e-3, final_state=5e-3, q=8e-3, k=8e-3, v=8e-3, initial_state=8e-3,
                g=2e-2, beta=2e-2)
TOL_FP32 = dict(o=1e-5, final_state=1e-5, q=1e-5, k=1e-5, v=1e-5, initial_state=1e-5,
                g=1e-4, beta=1e-4)

# Two programs of the same fp32 math compiled differently (a remat policy against full remat):
# on the CPU they agree to 1e-6; XLA:GPU fuses and orders each program's reductions on its own,
# so there the same math differs by a few ulps times the reductions' length (1.3e-6 absolute
# on one of 5,120 gradient entries of the save_kda test, an H100, 2026-12-06).
SAME_MATH_TOL = (dict(rtol=1e-5, atol=1e-5) if jax.default_backend() == "gpu"
                 else dict(rtol=1e-6, atol=1e-6))
GRAD_ARGS = ("q", "k", "v", "g", "beta", "initial_state")


def rel_rmse(ref: Any, out: Any) -> float:
  """Relative RMSE ||ref - out||_2 / ||ref||_2, computed in float64 (0/0 -> 0, x/0 -> inf)."""
  ref = np.asarray(jnp.asarray(ref).astype(jnp.float32) if _is_bf16(ref) else ref, np.float64)
  out = np.asarray(jnp.asarray(out).astype(jnp.float32) if _is_bf16(out) else out, np.float64)
  assert ref.shape == out.shape, (ref.shape, out.shape)
  num = np.linalg.norm((ref - out).ravel())
  den = np.linalg.norm(ref.ravel())
  if den == 0.0:
    return 0.0 if num == 0.0 else float("inf")
  return float(num / den)


def _is_bf16(x) -> bool:
  return getattr(x, "dtype", None) == jnp.bfloat16


def random_segment_ids(rng: np.random.Generator, B: int, T: int, *, num_docs: int = 4,
                       padding: bool = True) -> np.ndarray:
  """Packed-document ids [B, T] int32: random boundaries, ids 1..num_docs in order.

  With `padding`, each row also gets a random run of id-0 padding at its end and, when T is large
  enough, a short padding run in the middle (padding between documents).
  """
  seg = np.zeros((B, T), np.int32)
  for b in range(B):
    n = int(rng.integers(1, num_docs + 1))
    cuts = np.sort(rng.choice(np.arange(1, T), size=min(n - 1, max(T - 1, 0)), replace=False)) \
        if T > 1 else np.zeros((0,), np.int64)
    starts = np.concatenate([[0], cuts]).astype(int)
    ends = np.concatenate([cuts, [T]]).astype(int)
    for i, (s, e) in enumerate(zip(starts, ends)):
      seg[b, s:e] = i + 1
    if padding and T >= 4:
      tail = int(rng.integers(0, max(T // 8, 1) + 1))
      if tail:
        seg[b, T - tail:] = 0
      if T >= 32 and len(cuts):
        c = int(cuts[0])
        w = int(rng.integers(1, 4))
        seg[b, max(c - w, 1):c] = 0
  return seg


def make_gate(rng: np.random.Generator, shape: tuple[int, ...], mode: str, *,
              gate_lower_bound: float = -5.0) -> np.ndarray:
  """Log-decay g (float32 numpy) for a gate mode.

  bounded:   gate_lower_bound * sigmoid(z), z ~ N(0, 2^2): spread over (gate_lower_bound, 0).
  saturated: exactly gate_lower_bound everywhere (g = -5 with the default: fastest decay allowed).
  near_zero: -U(0, 1e-3): almost no decay (long memory, largest states).
  unbounded: -exp(U(log 1e-3, log 1000)) per element: many tokens far below -6, down to -1000.
  """
  if mode == "bounded":
    z = rng.normal(size=shape) * 2.0
    return (gate_lower_bound / (1.0 + np.exp(-z))).astype(np.float32)
  if mode == "saturated":
    return np.full(shape, gate_lower_bound, np.float32)
  if mode == "near_zero":
    return (-rng.uniform(0.0, 1e-3, size=shape)).astype(np.float32)
  if mode == "unbounded":
    return (-np.exp(rng.uniform(np.log(1e-3), np.log(1000.0), size=shape))).astype(np.float32)
  raise ValueError(f"gate mode {mode!r}: expected one of {GATE_MODES}")


def make_inputs(seed: int, B: int, T: int, H: int, K: int, V: int, *,
                dtype: Any = jnp.bfloat16, gate: str = "bounded", gate_lower_bound: float = -5.0,
                initial_state: bool = False, segments: bool = False, num_docs: int = 4,
                padding: bool = True) -> dict[str, Any]:
  """Random KDA inputs in the operator layout (ARCHITECTURE.md §2.5).

  q, k are L2-normalised per head (as the layer produces them, §2.2); v ~ N(0, 1);
  beta = sigmoid(N(0, 1)); g from `make_gate`. q, k, v, g, beta are cast to `dtype`; the
  initial state [B, H, K, V] is fp32 ~ N(0, 0.5^2); segment_ids [B, T] int32.

  Returns a dict with keys q, k, v, g, beta, initial_state (array or None),
  segment_ids (array or None).
  """
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, T, H, K)).astype(np.float32)
  k = rng.normal(size=(B, T, H, K)).astype(np.float32)
  q /= np.linalg.norm(q, axis=-1, keepdims=True) + 1e-6
  k /= np.linalg.norm(k, axis=-1, keepdims=True) + 1e-6
  v = rng.normal(size=(B, T, H, V)).astype(np.float32)
  beta = (1.0 / (1.0 + np.exp(-rng.normal(size=(B, T, H))))).astype(np.float32)
  g = make_gate(rng, (B, T, H, K), gate, gate_lower_bound=gate_lower_bound)
  out = {name: jnp.asarray(x, dtype) for name, x in
         dict(q=q, k=k, v=v, g=g, beta=beta).items()}
  out["initial_state"] = (jnp.asarray(rng.normal(size=(B, H, K, V)) * 0.5, jnp.float32)
                          if initial_state else None)
  out["segment_ids"] = (jnp.asarray(random_segment_ids(rng, B, T, num_docs=num_docs,
                                                       padding=padding))
                        if segments else None)
  return out


def random_cotangents(seed: int, o_shape: tuple[int, ...], state_shape: tuple[int, ...]):
  """Fixed random cotangents (do, dS_T) in float32 for a vjp-style loss."""
  rng = np.random.default_rng(seed + 7919)
  return (rng.normal(size=o_shape).astype(np.float32),
          rng.normal(size=state_shape).astype(np.float32))


def run_with_grads(fn: Callable[..., tuple[jax.Array, jax.Array | None]],
                   inputs: dict[str, Any], *, seed: int = 0, state_grad: bool = True,
                   jit: bool = True, **kwargs
                   ) -> tuple[jax.Array, jax.Array | None, dict[str, jax.Array]]:
  """Run fn(q, k, v, g, beta, initial_state=, segment_ids=, output_final_state=True, **kwargs).

  The loss is sum(o * do) + sum(S_T * dS) with fixed random cotangents (dS term dropped when
  `state_grad` is False), all in float32 (float64 if the inputs are float64). Gradients are
  taken w.r.t. q, k, v, g, beta and initial_state (when given). With `jit` (default) the whole
  forward + backward is one jitted computation (much faster to compile than op-by-op).

  Returns (o, final_state, grads) with grads keyed by GRAD_ARGS present in the inputs.
  """
  B, T, H, K = inputs["q"].shape
  V = inputs["v"].shape[-1]
  do, dS = random_cotangents(seed, (B, T, H, V), (B, H, K, V))
  acc = jnp.float64 if inputs["q"].dtype == jnp.float64 else jnp.float32
  names = [n for n in GRAD_ARGS if inputs.get(n) is not None]
  seg = inputs.get("segment_ids")

  def loss(*args):
    d = dict(zip(names, args))
    o, S = fn(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d.get("initial_state"),
              segment_ids=seg, output_final_state=True, **kwargs)
    val = jnp.sum(o.astype(acc) * jnp.asarray(do, acc))
    if state_grad:
      val = val + jnp.sum(S.astype(acc) * jnp.asarray(dS, acc))
    return val, (o, S)

  grad_fn = jax.grad(loss, argnums=tuple(range(len(names))), has_aux=True)
  if jit:
    grad_fn = jax.jit(grad_fn)
  grads, (o, S) = grad_fn(*[inputs[n] for n in names])
  return o, S, dict(zip(names, grads))


def to_fp64(inputs: dict[str, Any]) -> dict[str, Any]:
  """Cast the float inputs to numpy float64 (exact for bf16/fp32 values)."""
  out = {}
  for n, x in inputs.items():
    if x is None or n == "segment_ids":
      out[n] = None if x is None else np.asarray(x)
    else:
      out[n] = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
  return out


def reference_fp64(inputs: dict[str, Any], *, seed: int = 0, grads: bool = True,
                   state_grad: bool = True, scale: float | None = None):
  """recurrent_kda on the (rounded) inputs in float64, x64 enabled only inside.

  Returns numpy float64 (o, final_state, grads dict or None).
  """
  from pallas_kernels.kda.reference import recurrent_kda  # pylint: disable=g-import-not-at-top
  x = to_fp64(inputs)
  with jax.enable_x64(True):
    d = {n: (None if v is None else jnp.asarray(v)) for n, v in x.items()}
    if grads:
      o, S, gr = run_with_grads(recurrent_kda, d, seed=seed, state_grad=state_grad, scale=scale)
      gr = {n: np.asarray(v, np.float64) for n, v in gr.items()}
    else:
      o, S = recurrent_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], scale=scale,
                           initial_state=d["initial_state"], segment_ids=d["segment_ids"])
      gr = None
    return np.asarray(o, np.float64), np.asarray(S, np.float64), gr


def check_against_reference(ref: tuple, out: tuple, tol: dict[str, float], *,
                            label: str = "") -> dict[str, float]:
  """Compare (o, S, grads) triples; raise AssertionError listing every quantity over tolerance.

  Returns the dict of measured relative RMSEs (handy to print).
  """
  (o_r, S_r, g_r), (o, S, g) = ref, out
  errs = {"o": rel_rmse(o_r, o), "final_state": rel_rmse(S_r, S)}
  if g_r is not None and g is not None:
    for n in g_r:
      errs[n] = rel_rmse(g_r[n], g[n])
  bad = {n: e for n, e in errs.items() if not (e <= tol[n])}
  assert not bad, f"{label}: over tolerance {bad}; all {errs}"
  return errs


def nan_like(x: Any) -> jax.Array:
  """A NaN-filled array with x's shape and dtype (for output poisoning)."""
  return jnp.full(jnp.shape(x), jnp.nan, jnp.asarray(x).dtype)


def poison(tree: Any) -> Any:
  """NaN-filled copies of every float leaf of a pytree (ints and None kept)."""
  def f(x):
    if x is None or not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
      return x
    return nan_like(x)
  return jax.tree.map(f, tree)


def assert_all_finite(tree: Any, label: str = "") -> None:
  """Every float leaf of the pytree is finite (no NaN left from poisoning, no inf)."""
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    a = np.asarray(jnp.asarray(x).astype(jnp.float32) if _is_bf16(x) else x)
    if np.issubdtype(a.dtype, np.floating):
      assert np.all(np.isfinite(a)), (
          f"{label}{jax.tree_util.keystr(path)}: {np.sum(~np.isfinite(a))} non-finite of {a.size}")
