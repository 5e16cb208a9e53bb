"""`chunk_kda`: input validation and backend dispatch (ARCHITECTURE.md §2.5).

Source: Kimi Linear (arXiv 2510.26692). Each backend is its own file and declares where it runs
with `supported_on(device)`: reference.py and xla.py everywhere, pallas_tpu.py on TPU,
pallas_gpu.py on Hopper GPUs (both in interpret mode on CPU for tests). "auto" takes the first
backend of AUTO_ORDER that supports the default device. Adding a backend is one file and one
entry in BACKENDS.
"""

from __future__ import annotations

import importlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from pallas_kernels.kda.tiles import CHUNK_SIZES

# backend name -> (module, entry point)
BACKENDS = {
    "reference": ("pallas_kernels.kda.reference", "recurrent_kda"),
    "xla": ("pallas_kernels.kda.xla", "chunk_kda_xla"),
    "pallas_tpu": ("pallas_kernels.kda.pallas_tpu", "chunk_kda_pallas_tpu"),
    "pallas_gpu": ("pallas_kernels.kda.pallas_gpu", "chunk_kda_pallas_gpu"),
}
# "auto": the first that supports the default device
AUTO_ORDER = ("pallas_tpu", "pallas_gpu", "xla")


def backend_module(name: str):
  """The module of backend `name` (imported on first use)."""
  return importlib.import_module(BACKENDS[name][0])


def resolve_backend(backend: str, device=None) -> str:
  """"auto" -> the first backend of AUTO_ORDER whose `supported_on(device)` holds (default
  device: jax.devices()[0]); any other name is returned as given."""
  if backend != "auto":
    return backend
  device = jax.devices()[0] if device is None else device
  for name in AUTO_ORDER:
    if backend_module(name).supported_on(device):
      return name
  raise AssertionError("the xla backend runs everywhere")


def _check(q, k, v, g, beta, initial_state, segment_ids, chunk_size, backend,
           gate_lower_bound=None):
  for name, x, rank, dims in (("q", q, 4, "[B, T, H, K]"), ("v", v, 4, "[B, T, H, V]"),
                              ("beta", beta, 3, "[B, T, H]")):
    if getattr(x, "ndim", None) != rank:
      raise ValueError(f"{name} has shape {getattr(x, 'shape', None)}: expected {dims} (a "
                       "single sequence is B = 1)")
  B, T, H, K = q.shape
  V = v.shape[-1]
  if backend != "auto" and backend not in BACKENDS:
    raise ValueError(f"backend={backend!r}: expected 'auto' or one of {tuple(BACKENDS)}")
  if k.shape != q.shape or g.shape != q.shape:
    raise ValueError(f"q {q.shape}, k {k.shape}, g {g.shape} must all be [B, T, H, K]")
  if v.shape[:3] != (B, T, H):
    raise ValueError(f"v {v.shape} must be [B, T, H, V] with B, T, H = {(B, T, H)}")
  if beta.shape != (B, T, H):
    raise ValueError(f"beta {beta.shape} must be [B, T, H] = {(B, T, H)}")
  if K > 256:
    raise ValueError(f"K={K} > 256 is not supported (head key dim); split heads")
  for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float64):
      raise ValueError(f"{name} dtype {x.dtype}: expected float32, bfloat16 (or float64)")
  if initial_state is not None and not hasattr(initial_state, "shape"):
    raise ValueError(f"initial_state is a {type(initial_state).__name__}: expected an array "
                     f"[B, H, K, V] = {(B, H, K, V)} (fp32) or None")
  if initial_state is not None and initial_state.shape != (B, H, K, V):
    raise ValueError(f"initial_state {initial_state.shape} must be [B, H, K, V] = {(B, H, K, V)}")
  if initial_state is not None and not jnp.issubdtype(initial_state.dtype, jnp.floating):
    raise ValueError(f"initial_state dtype {initial_state.dtype}: expected float32 (the state "
                     "is fp32)")
  if segment_ids is not None and segment_ids.shape != (B, T):
    raise ValueError(f"segment_ids {segment_ids.shape} must be [B, T] = {(B, T)}")
  if chunk_size not in CHUNK_SIZES:
    raise ValueError(f"chunk_size={chunk_size}: expected 64 (default), 32 or 16")
  if gate_lower_bound is not None and not _static_number(gate_lower_bound):
    raise ValueError(f"gate_lower_bound must be a Python float or None (a static promise that "
                     f"picks the diagonal-tile method), got {type(gate_lower_bound).__name__}")
  if gate_lower_bound is not None and not (-5.0 <= gate_lower_bound < 0.0):
    raise ValueError(f"gate_lower_bound={gate_lower_bound} must be in [-5, 0) (the g_min of "
                     "kda_gate) or None (gate not known to be bounded)")
  if segment_ids is not None and not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise ValueError(f"segment_ids dtype {segment_ids.dtype}: expected an integer dtype")


def _static_number(x) -> bool:
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def segment_ids_from_cu_seqlens(cu_seqlens, length: int) -> jax.Array:
  """fla's variable-length form -> `segment_ids` [1, length] int32 for one packed row.

  cu_seqlens: [N + 1] integer cumulative document lengths, cu_seqlens[0] = 0, non-decreasing,
  cu_seqlens[-1] <= length (fla's `cu_seqlens` of its B = 1 varlen calls). Document i (tokens
  cu_seqlens[i] .. cu_seqlens[i+1] - 1) gets id i + 1; positions from cu_seqlens[-1] on are
  padding (id 0). Use it with q, k, v, g, beta of shape [1, length, H, ·]. Unlike fla, the
  operator keeps one state per row: `initial_state` flows into the first document only and
  `final_state` is the row's last state, not one per document.

  Raises:
    ValueError: cu_seqlens (when concrete) does not start at 0, decreases, or ends past length.
  """
  cu = jnp.asarray(cu_seqlens)
  if cu.ndim != 1 or cu.shape[0] < 2 or not jnp.issubdtype(cu.dtype, jnp.integer):
    raise ValueError(f"cu_seqlens {cu.shape} {cu.dtype}: expected an integer vector [N + 1]")
  if not isinstance(cu, jax.core.Tracer):
    c = np.asarray(cu)
    if c[0] != 0 or np.any(np.diff(c) < 0) or c[-1] > length:
      raise ValueError(f"cu_seqlens={c.tolist()} must start at 0, never decrease and end at "
                       f"or before length={length}")
  t = jnp.arange(length)
  ids = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32) + 1
  return jnp.where(t < cu[-1], ids, 0)[None, :]


def check_gate_bound(g: jax.Array, gate_lower_bound: float,
                     segment_ids: jax.Array | None = None) -> None:
  """`checkify.check` that every non-padding g is >= gate_lower_bound (the promise the dense
  diagonal tiles rely on). Must run under `jax.experimental.checkify.checkify`; the error names
  the smallest g found."""
  valid = g if segment_ids is None else jnp.where((segment_ids != 0)[..., None, None], g, 0)
  g_min = jnp.min(valid.astype(jnp.float32))
  g_max = jnp.max(valid.astype(jnp.float32))
  checkify.check(g_min >= gate_lower_bound,
                 f"chunk_kda: a log-decay g is below gate_lower_bound={gate_lower_bound} "
                 "(min g = {g_min}); the dense diagonal tiles would overflow to inf/NaN. Pass "
                 "the bound of the gate that made g, or gate_lower_bound=None.", g_min=g_min)
  checkify.check(g_max <= 0, "chunk_kda: a log-decay g is positive (max g = {g_max}); g is "
                 "log α with α in (0, 1] (kda_gate's output): a growing state overflows to "
                 "inf/NaN.", g_max=g_max)


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              segment_ids=None, chunk_size=64, backend="auto", interpret=False,
              gate_lower_bound: float | None = None, checked: bool = False):
  """Chunkwise-parallel KDA (Kimi Linear, arXiv 2510.26692; ARCHITECTURE.md §2.4).

  Args:
    q, k: [B, T, H, K] (K <= 256); v: [B, T, H, V]; g: [B, T, H, K] log-decay after the gate;
      beta: [B, T, H]. float32 or bfloat16; accumulation and state are fp32.
    scale: query scale (default K ** -0.5); a Python float for the Pallas backends.
    initial_state: [B, H, K, V] fp32 or None.
    output_final_state: return the final state [B, H, K, V] fp32 (else None).
    segment_ids: [B, T] int32 packed-document ids, 0 = padding (fla's `cu_seqlens`:
      `segment_ids_from_cu_seqlens`). The state resets where a non-zero id differs from the
      previous token's, padding included: a document after left padding starts from zero,
      not from initial_state; to continue a state past padding, zero g and beta there and
      pass no segment_ids (what the inference engine does).
    chunk_size: 64 (default), 32 or 16.
    backend: "auto" | "xla" | "reference" | "pallas_tpu" | "pallas_gpu".
    interpret: run Pallas kernels in interpret mode (CPU tests).
    gate_lower_bound: g_min of the gate that produced g, when known (the model passes
      `cfg.kda_gate_lower_bound`: -5.0 for the default lower-bounded gate, None for the
      unbounded softplus gate). A float promises g >= g_min and lets the chunked backends use
      dense matmuls on the 16-token diagonal tiles (ARCHITECTURE §2.4: exponents <= 15 |g_min|
      = 75 nats, inside fp32). None (default) is always safe: the diagonal tiles use the
      element-wise path, correct for any g <= 0 (down to -1000s).
      Without `checked` the promise is not verified: a g below the bound by more than ~0.9
      nats per token silently gives inf/NaN outputs (e.g. g in [-8, -5) with bound -5 gives
      all-NaN), by less it gives finite but unchecked values.
    checked: verify the promise (one min-reduction over g) with `jax.experimental.checkify`:
      call under `checkify.checkify(f)` (jitted or not), then `err.throw()` raises
      JaxRuntimeError naming the smallest g. Without the checkify wrapper, tracing a checked
      call fails ("Cannot abstractly evaluate a checkify.check which was not functionalized");
      an eager call (no tracing) raises that JaxRuntimeError at once.
      For tests and debug runs; no effect when gate_lower_bound is None.

  Returns:
    (o [B, T, H, V] in q's dtype, final_state or None).

  Raises:
    ValueError: mismatched shapes, K > 256, unsupported dtypes (inputs not fp32/bf16/fp64,
      segment_ids not integer, initial_state not float), unknown backend or chunk size,
      gate_lower_bound not a float in [-5, 0), a traced scale for a Pallas backend.
  """
  _check(q, k, v, g, beta, initial_state, segment_ids, chunk_size, backend, gate_lower_bound)
  if checked and gate_lower_bound is not None:
    check_gate_bound(g, gate_lower_bound, segment_ids)
  backend = resolve_backend(backend)
  if backend.startswith("pallas") and scale is not None and not _static_number(scale):
    raise ValueError(f"scale must be a Python float for backend={backend!r} (a kernel "
                     f"constant), got {type(scale).__name__}; backend='xla' takes an array")
  kwargs = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                segment_ids=segment_ids, chunk_size=chunk_size)
  fn = getattr(backend_module(backend), BACKENDS[backend][1])
  if backend != "reference" and _accepts(fn, "gate_lower_bound"):
    kwargs["gate_lower_bound"] = gate_lower_bound
  if backend.startswith("pallas"):
    kwargs["interpret"] = interpret
  return fn(q, k, v, g, beta, **kwargs)


def _accepts(fn, name: str) -> bool:
  """Whether `fn` takes keyword `name` (optional backend features, e.g. gate_lower_bound)."""
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False
  return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
