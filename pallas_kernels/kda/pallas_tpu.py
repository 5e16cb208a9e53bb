"""KDA on TPU: Mosaic Pallas kernels, forward and backward under `jax.custom_vjp`.

This file is the wrapper (layout, `pallas_call`s, custom VJP, `chunk_kda_pallas_tpu`); the
kernel bodies are in pallas_tpu_kernels.py.

Where it runs: TPU (Mosaic). On CPU only with `interpret=True` (slow emulation, for tests).
Source: Kimi Linear (arXiv 2510.26692) §3 (chunkwise WY form of the gated delta rule);
ARCHITECTURE.md §2.4 (algorithm, exponent safety) and §2.5 (contract).

Layout. Outside the kernels (plain XLA, differentiated by autodiff): q, k, v, g are moved to
[B·H, T, ·] (dtype kept), T is padded to the chunk, K and V to multiples of 128 (zero q/k/v and
g = 0 there: harmless), padding tokens (segment id 0) get g = 0, β = 0, and the per-token scalars
β, document index (cumsum of segment resets) and "state-valid" flag are packed as rows of one
[B·H·chunks, 8, C] fp32 array (lane-dense; turned into columns inside the kernel by an identity
matmul). The grid is (B·H "parallel", chunks "arbitrary"); the fp32 state lives in VMEM scratch,
stored transposed as Sᵀ [V, K] so that the per-key decay e^G broadcasts along rows. Inside the
kernel G (the in-chunk inclusive cumsum of g) is a matmul with a lower-triangular ones matrix and
dg = Lᵀ ∂L/∂G is the reverse cumsum within the chunk. Every exponent is evaluated as a direct sum
of g over a token range (a 0/±1 matrix times g), never as a difference of two cumulative sums,
which would lose ~|G|·eps nats after an unbounded gate of −1000 (measured: 5e-5 → 1e-7 rel. RMSE).

Per chunk (C tokens, G the in-chunk cumulative log-decay, Γ = e^G, S the state entering):

    A_kk[i, j] = β_i Σ_d k_id k_jd e^(G_id − G_jd)     j < i, same document
    A_qk[i, j] = scale Σ_d q_id k_jd e^(G_id − G_jd)   j ≤ i, same document
    X = (I + A_kk)^(−1)   (block recursion M_2s = M_s − M_s (A ∘ B_s) M_s: no cancellation)
    U = X (β ⊙ V),  W = X (β ⊙ K ⊙ Γ),  V' = U − m0 ⊙ (W S)
    O = scale m0 ⊙ ((Q ⊙ Γ) S) + A_qk V'
    S' = m0_C e^(G_C) ⊙ S + (K ⊙ e^(G_C − G) ⊙ m_C)ᵀ V'

m0_i = 1 where token i is in the document that was open when the chunk began (the incoming state
reaches it); m_C,i = 1 where token i is in the chunk's last document (only that document survives
into the outgoing state). All exponents outside A_kk / A_qk are ≤ 0.

Pairwise factors on 16-token sub-tiles: for query sub-block a (rows 16a…16a+15) the reference
point is r = G at row 16a (the first row of the query sub-block), the operands are Q ⊙ e^(G − r)
(≤ 1) and K ⊙ e^(r − G) (≤ 1 for the earlier sub-blocks), one matmul per sub-block row. The
diagonal 16×16 tile is
  "dense": the same matmul; e^(r − G_j) ≥ 1 reaches e^(15·|g_min|) = e^75 for the bounded gate
           g ≥ −5 (inside fp32), overflows for the unbounded gate;
  "safe":  element-wise over (i, j, d) with the exponent G_i − G_j masked to 0 where j > i
           *before* exp, always ≤ 0.
r never depends on a token later than the rows it serves: causal bit for bit.

Backward: the forward (when differentiated) also writes the state entering every chunk
([B·H, chunks, V, K] fp32, 64 KiB per chunk and head at K = V = 128); the backward kernel walks
the chunks in reverse with ∂L/∂Sᵀ in VMEM scratch, recomputing A_qk, A_kk, X, W, U and V' per
chunk from the saved inputs. All matmuls are fp32 with Precision.HIGHEST (accuracy first; bf16
MXU operands for the off-diagonal products are the obvious speed-up, not measured here).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda.pallas_tpu_kernels import bwd_kernel, fwd_kernel
from pallas_kernels.kda.tiles import SAVE_NAME, SUB, resolve_diag, segment_resets

LANE = 128


def supported_on(device) -> bool:
  """Where this backend runs: TPU (Mosaic). On CPU only with `interpret=True`, for tests."""
  return device.platform == "tpu"


# ----------------------------------------------------------------------------- pallas_call

def _specs(BH, NC, C, Kp, Vp, reverse):
  ci = (lambda b, c: NC - 1 - c) if reverse else (lambda b, c: c)
  sq = pl.squeezed
  tok = lambda d: pl.BlockSpec((sq, C, d), lambda b, c: (b, ci(b, c), 0))
  return dict(
      qk=tok(Kp), v=tok(Vp),
      tok=pl.BlockSpec((sq, 8, C), lambda b, c: (b * NC + ci(b, c), 0, 0)),
      state=pl.BlockSpec((sq, Vp, Kp), lambda b, c: (b, 0, 0)),
      chunk_state=pl.BlockSpec((sq, sq, Vp, Kp), lambda b, c: (b, ci(b, c), 0, 0)),
  )


def _params(interpret):
  if interpret:
    return None
  return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


def _poison_args(out_shapes, poison, first_index):
  """NaN-filled buffers aliased to the outputs: any element the kernel fails to write stays NaN."""
  if not poison:
    return [], [], {}
  args = [jnp.full(s.shape, jnp.nan, s.dtype) for s in out_shapes]
  specs = [pl.BlockSpec(memory_space=pl.ANY) for _ in out_shapes]
  return args, specs, {first_index + i: i for i in range(len(out_shapes))}


def _fwd_call(q, k, v, g, tok, h0T, *, scale, C, dense, save_states, interpret, poison):
  BH, Tp, Kp = q.shape
  Vp = v.shape[-1]
  NC = Tp // C
  s = _specs(BH, NC, C, Kp, Vp, reverse=False)
  out_shape = [jax.ShapeDtypeStruct((BH, Tp, Vp), q.dtype),
               jax.ShapeDtypeStruct((BH, Vp, Kp), jnp.float32)]
  out_specs = [s["v"], s["state"]]
  if save_states:
    out_shape.append(jax.ShapeDtypeStruct((BH, NC, Vp, Kp), jnp.float32))
    out_specs.append(s["chunk_state"])
  pargs, pspecs, aliases = _poison_args(out_shape, poison, 6)
  kernel = functools.partial(fwd_kernel, scale=scale, dense=dense, save_states=save_states,
                             num_poison=len(pargs))
  return pl.pallas_call(
      kernel, grid=(BH, NC),
      in_specs=[s["qk"], s["qk"], s["v"], s["qk"], s["tok"], s["state"]] + pspecs,
      out_specs=out_specs, out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((Vp, Kp), jnp.float32)],
      input_output_aliases=aliases, compiler_params=_params(interpret), interpret=interpret,
      name="kda_fwd_dense" if dense else "kda_fwd_safe",
  )(q, k, v, g, tok, h0T, *pargs)


def _bwd_call(q, k, v, g, tok, states, do, dhT, *, scale, C, dense, interpret, poison):
  BH, Tp, Kp = q.shape
  Vp = v.shape[-1]
  NC = Tp // C
  s = _specs(BH, NC, C, Kp, Vp, reverse=True)
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
               jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(g.shape, g.dtype),
               jax.ShapeDtypeStruct(tok.shape, jnp.float32),
               jax.ShapeDtypeStruct((BH, Vp, Kp), jnp.float32)]
  out_specs = [s["qk"], s["qk"], s["v"], s["qk"], s["tok"], s["state"]]
  pargs, pspecs, aliases = _poison_args(out_shape, poison, 8)
  kernel = functools.partial(bwd_kernel, scale=scale, dense=dense, num_poison=len(pargs))
  return pl.pallas_call(
      kernel, grid=(BH, NC),
      in_specs=[s["qk"], s["qk"], s["v"], s["qk"], s["tok"], s["chunk_state"],
                s["v"], s["state"]] + pspecs,
      out_specs=out_specs, out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((Vp, Kp), jnp.float32)],
      input_output_aliases=aliases, compiler_params=_params(interpret), interpret=interpret,
      name="kda_bwd_dense" if dense else "kda_bwd_safe",
  )(q, k, v, g, tok, states, do, dhT, *pargs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _kda_core(q, k, v, g, tok, h0T, scale, C, dense, interpret, poison):
  o, hT = _fwd_call(q, k, v, g, tok, h0T, scale=scale, C=C, dense=dense,
                    save_states=False, interpret=interpret, poison=poison)
  return o, hT


def _kda_core_fwd(q, k, v, g, tok, h0T, scale, C, dense, interpret, poison):
  o, hT, states = (checkpoint_name(x, SAVE_NAME) for x in _fwd_call(
      q, k, v, g, tok, h0T, scale=scale, C=C, dense=dense, save_states=True,
      interpret=interpret, poison=poison))
  return (o, hT), (q, k, v, g, tok, states)


def _kda_core_bwd(scale, C, dense, interpret, poison, res, cts):
  q, k, v, g, tok, states = res
  do, dhT = cts
  dq, dk, dv, dg, dtok, dh0T = _bwd_call(
      q, k, v, g, tok, states, do.astype(q.dtype), dhT.astype(jnp.float32), scale=scale,
      C=C, dense=dense, interpret=interpret, poison=poison)
  return dq, dk, dv, dg, dtok, dh0T


_kda_core.defvjp(_kda_core_fwd, _kda_core_bwd)


# ----------------------------------------------------------------------------- public entry

def chunk_kda_pallas_tpu(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
    scale: float | None = None, initial_state: jax.Array | None = None,
    output_final_state: bool = False, segment_ids: jax.Array | None = None,
    chunk_size: int = 64, interpret: bool = False, diag: str = "auto",
    gate_lower_bound: float | None = None, poison_outputs: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
  """Chunked KDA with Mosaic TPU kernels (Kimi Linear, arXiv 2510.26692; ARCHITECTURE §2.4).

  Args:
    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay after the gate (≤ 0);
      beta: [B, T, H]. float32 or bfloat16 (kept in HBM as given; all math inside the kernels
      is fp32, the state included).
    scale: query scale, default K ** -0.5.
    initial_state: [B, H, K, V] (cast to fp32) or None (zeros).
    output_final_state: return the final state [B, H, K, V] fp32.
    segment_ids: [B, T] int32 packed-document ids, 0 = padding (identity step, zero output).
    chunk_size: 64 or 32 (16 also works).
    interpret: run the kernels in Pallas interpret mode (CPU tests).
    diag: diagonal-tile method, "auto" | "dense" | "safe" (module docstring). "auto" is dense
      only when `gate_lower_bound` says g ≥ g_min with |g_min| ≤ 88/15.
    gate_lower_bound: g_min of the gate that produced g (−5.0 for the bounded gate), or None.
    poison_outputs: test hook: every kernel output buffer (forward and backward) starts as NaN
      (aliased NaN inputs), so an element the kernels never write shows up as NaN.

  Returns:
    (o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32 or None).

  Raises:
    ValueError: chunk_size not a multiple of 16 / not a power of two, unknown diag.
  """
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  if C % SUB or C & (C - 1):
    raise ValueError(f"chunk_size={C}: expected 16, 32 or 64")
  dense = resolve_diag(diag, gate_lower_bound) == "dense"
  scale = K ** -0.5 if scale is None else float(scale)
  Kp, Vp = -(-K // LANE) * LANE, -(-V // LANE) * LANE
  Tp = -(-T // C) * C
  NC, BH = Tp // C, B * H
  if segment_ids is None:
    doc = jnp.zeros((B, T), jnp.int32)
    valid = jnp.ones((B, T), bool)
  else:
    doc = jnp.cumsum(segment_resets(segment_ids).astype(jnp.int32), axis=1)
    valid = segment_ids != 0
  g = jnp.where(valid[..., None, None], g, jnp.zeros((), g.dtype))
  beta = jnp.where(valid[..., None], beta.astype(jnp.float32), 0.0)

  def lay(x, d, dp):  # [B, T, H, d] -> [B·H, Tp, dp]
    x = jnp.moveaxis(x, 2, 1).reshape(BH, T, d)
    return jnp.pad(x, ((0, 0), (0, Tp - T), (0, dp - d)))

  qf, kf, gf = lay(q, K, Kp), lay(k, K, Kp), lay(g, K, Kp)
  vf = lay(v, V, Vp)
  # Document index per token (padded T repeats the last document) and the state-valid flag:
  # token i still belongs to the document open at the end of the previous chunk.
  doc = jnp.pad(doc, ((0, 0), (0, Tp - T)), mode="edge")
  prev = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), doc[:, :-1]], axis=1)
  start = jnp.repeat(prev[:, ::C], C, axis=1)
  sv = (doc == start).astype(jnp.float32)
  docf = (doc % 4096).astype(jnp.float32)  # only compared within a chunk: exact in fp32
  rep = lambda x: jnp.broadcast_to(x[:, None], (B, H, Tp)).reshape(BH * NC, 1, C)
  betaf = jnp.pad(jnp.moveaxis(beta, 2, 1).reshape(BH, T), ((0, 0), (0, Tp - T)))
  tok = jnp.concatenate([betaf.reshape(BH * NC, 1, C), rep(docf), rep(sv),
                         jnp.zeros((BH * NC, 5, C), jnp.float32)], axis=1)
  if initial_state is None:
    h0T = jnp.zeros((BH, Vp, Kp), jnp.float32)
  else:
    h0T = jnp.swapaxes(initial_state.astype(jnp.float32), -1, -2).reshape(BH, V, K)
    h0T = jnp.pad(h0T, ((0, 0), (0, Vp - V), (0, Kp - K)))

  o, hT = _kda_core(qf, kf, vf, gf, tok, h0T, scale, C, dense, interpret, poison_outputs)
  o = jnp.moveaxis(o[:, :T, :V].reshape(B, H, T, V), 1, 2)
  o = jnp.where(valid[..., None, None], o, 0).astype(q.dtype)
  if not output_final_state:
    return o, None
  S = jnp.swapaxes(hT[:, :V, :K].reshape(B, H, V, K), -1, -2)
  return o, S
