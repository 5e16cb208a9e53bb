"""Rules every KDA backend shares: chunk and sub-tile sizes, the diagonal-tile method, the
gate lower bound's checked mode, and where packed documents reset the state.

Source: ARCHITECTURE.md §2.4 (chunked algorithm, exponent safety) and §2.5 (the contract).
The backends (reference.py, xla.py, pallas_tpu.py, pallas_gpu.py) import this module and
nothing else of the package (the Pallas ones also their own kernel file; pallas_gpu.py also
xla.py, whose intra-chunk functions it runs); api.py picks among them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

CHUNK_SIZES = (16, 32, 64)  # tokens per chunk of the chunked backends
SUB = 16  # sub-tile size (tokens) of the pairwise products e^(G_i - G_j)
DIAG_MODES = ("auto", "dense", "safe")
# Largest |g_min| for which a dense diagonal tile of SUB tokens keeps every exponent below
# log(float32 max) ≈ 88.7 nats with r at the tile's first row: (SUB − 1) · |g_min| < 88.
DENSE_MAX_ABS_BOUND = 88.0 / (SUB - 1)
# `jax.ad_checkpoint.checkpoint_name` of what the Pallas backends' forward computes for their
# hand-written backward: the operator's output, its final state, and the residuals (pallas_gpu:
# the intra-chunk outputs W, U, Q ⊙ Γ, A_qk, Kd, d, the WY kernels' X and S_k, the state pass's
# H_n and V'; pallas_tpu: the chunk states). A remat policy that saves this name
# (`sparse_lm.nn.remat_policy("save_kda")`, whose KDA_OPERATOR_NAME is this string) recomputes
# the rest of a layer but not the operator's forward kernels. Inputs (q, k, v, g, β) are not
# named: the recompute makes them.
SAVE_NAME = "kda_operator"


def segment_resets(segment_ids: jax.Array) -> jax.Array:
  """Where the state resets: [B, T] bool.

  A reset happens at position t > 0 whose segment id is non-zero and differs from the id at
  t - 1. Position 0 never resets: the initial state flows into the first token. Padding
  (id 0) never resets; it is made an identity step (g = 0, beta = 0) and its output is zero.
  """
  prev = jnp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)
  t = jnp.arange(segment_ids.shape[1])[None, :]
  return (segment_ids != prev) & (segment_ids != 0) & (t > 0)


def resolve_diag(diag: str, gate_lower_bound: float | None) -> str:
  """Pick the diagonal-tile method: "auto" is dense only for a known lower-bounded gate.

  Args:
    diag: "auto" | "dense" | "safe".
    gate_lower_bound: g_min of the gate that produced g (e.g. `cfg.kda_gate_lower_bound`, −5.0),
      or None when g is not known to be bounded (unbounded softplus gate, foreign inputs).

  Returns:
    "dense" or "safe". "auto" gives "dense" iff gate_lower_bound is not None and
    |gate_lower_bound| ≤ 88 / 15 ≈ 5.87 (every dense exponent stays inside fp32), else "safe".

  Raises:
    ValueError: unknown diag.
  """
  if diag not in DIAG_MODES:
    raise ValueError(f"diag={diag!r}: expected one of {DIAG_MODES}")
  if diag != "auto":
    return diag
  if gate_lower_bound is not None and -DENSE_MAX_ABS_BOUND <= gate_lower_bound < 0:
    return "dense"
  return "safe"


def dense_diag_max_exponent(g: jax.Array, *, chunk_size: int = 64,
                            segment_ids: jax.Array | None = None) -> jax.Array:
  """Largest exponent r − G_j the dense diagonal-tile path would feed to exp (nats, fp32 scalar).

  With r at the first row of each 16-token tile the key-side factor is e^(r − G_j); for g ≤ 0
  its largest exponent in a tile is −Σ g over the tile's last 15 tokens. Debug helper for the
  seed's claim (ARCHITECTURE §2.4): ≤ 15·|g_min| = 75 for the gate bounded at −5; thousands for
  an unbounded gate (fp32 overflows above ≈ 88.7).

  Args:
    g: [B, T, H, K] log-decay; chunk_size: 16 | 32 | 64 (tiles never straddle chunks);
      segment_ids: [B, T] or None (padding tokens count as g = 0).
  """
  B, T, H, K = g.shape
  C = chunk_size
  sub = min(SUB, C)
  N = max(1, math.ceil(T / C))
  g = g.astype(jnp.float32)
  if segment_ids is not None:
    g = jnp.where((segment_ids != 0)[..., None, None], g, 0)
  g = jnp.pad(g, [(0, 0), (0, N * C - T), (0, 0), (0, 0)])
  g = g.reshape(B, N, C // sub, sub, H, K)
  Pf = jnp.cumsum(g[:, :, :, 1:], axis=3)  # G_j − r for j after the tile's first row
  return jnp.maximum(jnp.max(-Pf), 0.0) if sub > 1 else jnp.zeros((), jnp.float32)
