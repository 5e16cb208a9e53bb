"""The decoder run from a cache: prefill pieces and decode steps, every row its own length.

One function, `forward_cached`, serves both: it takes T new tokens per row (T = the prefill
piece, or 1 for a decode step), of which the first n_valid[b] are real, appends them to row b's
caches at positions start[b] .. start[b] + n_valid[b] - 1, and returns the logits after each
row's last real token. Rows are right-padded; a row with n_valid = 0 is left unchanged (its KDA
state and conv tails exactly, its latent cache up to its length), which is how idle slots ride
along in a batched step.

Per layer (ARCHITECTURE.md §2-§5):
  KDA  projections and short conv continue from the cached conv tails; the recurrence continues
       from S: `chunk_kda(..., initial_state=S, output_final_state=True)` for a piece (padding
       made identity steps: g = 0, beta = 0), the single-token `recurrent_step` when T = 1.
  MLA  absorbed attention (DeepSeek-V2 §2.1.1): W_uk folded into the query, W_uv into the
       output, one (kv_lora + rope)-wide head over the latent cache; a piece reads the cache in
       key blocks with an online softmax (memory O(T x block)), only the blocks up to the
       batch's furthest position.
  MoE  routing with the frozen balancing biases and no capacity (never drops a token). A
       decode step (T = 1) reads only the experts its tokens chose when the batch's
       assignments are no more than the experts (`moe_decode`: gathered expert weights), else
       runs every expert on every token (one dense pass over all expert weights); a prefill
       piece goes through the model's grouped matmuls (`moe_prefill`: on a mesh the model's
       expert-parallel exchange with its caps off, or `moe_decode` where the token shards do
       not divide the piece).
  AttnRes mixes the sources of one token: nothing cached.
A decode step (T = 1) on a GPU runs the AttnRes reads, KDA and the routed experts as fused
Pallas kernels instead (fused.py, cfg.decode_backend); this file's path is their reference.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.kda import chunk_kda, recurrent_step
from sparse_lm import nn
from sparse_lm import sharding as shd
from sparse_lm.inference import fused
from sparse_lm.model import attnres
from sparse_lm.model.kda import kda_output, kda_projections
from sparse_lm.moe import router as router_lib
from sparse_lm.moe.expert_parallel import TOKEN_AXES
from sparse_lm.moe.latent_moe import dense_reference
from sparse_lm.moe.situ_glu import situ_activation

_NEG = -1e30


class DecoderStack(nnx.Module):
  """The Transformer's modules with the scanned layer groups unstacked into a flat list.

  Shares the embedding, head-group layers, last layer, final norm and LM head with `model`
  (no copy); the stacked groups are sliced into per-layer copies once, so a decode step reads
  each layer's weights in place instead of slicing a stacked array every step.
  input_matrices=True (the one-device engine with the fused decode kernels) also keeps each
  KDA and MoE layer's input projections concatenated (`fused.kda_input_matrix`,
  `fused.moe_input_matrix`: copies in the compute dtype), which the fused decode step reads
  in one GEMM per layer, and each MoE layer's two output projections stacked
  (`fused.moe_output_matrix`), read in one GEMM; likewise each MLA layer's input projections
  (`fused.mla_input_matrix`).
  """

  def __init__(self, model, *, input_matrices: bool = False):
    self.cfg = model.cfg
    self.embed = model.embed
    layer_list = list(model.head.layers)
    if model.groups is not None:
      graphdef, state = nnx.split(model.groups)
      for g in range(model.num_groups - 1):
        group = nnx.merge(graphdef, jax.tree.map(lambda a, g=g: a[g], state))
        _drop_layers_axis(group)
        layer_list += list(group.layers)
    layer_list += list(model.tail or ())  # KDA layers after the last whole group (48B)
    layer_list.append(model.last)
    self.layers = nnx.List(layer_list)
    # The fused decode step's one input GEMM per KDA, MLA and MoE layer (fused.kda_input_matrix,
    # fused.mla_input_matrix, fused.moe_input_matrix) and one output GEMM per MoE layer
    # (fused.moe_output_matrix), built once here: copies of those weights in the compute
    # dtype, keyed by layer index.
    kda_in = moe_in = moe_out = mla_in = None
    if input_matrices:
      dt = jnp.dtype(self.cfg.dtype)
      kda_in = nnx.Dict({
          str(i): nnx.Variable(fused.kda_input_matrix(layer.mixer.arrays(), dt))
          for i, layer in enumerate(layer_list) if layer.mixer_kind == "kda"})
      def per_moe_layer(build):  # {layer index: Variable} of the MoE layers that have one
        built = {str(i): build(layer.ffn, dt) for i, layer in enumerate(layer_list)
                 if not layer.dense_ffn}
        return nnx.Dict({i: nnx.Variable(w) for i, w in built.items() if w is not None})

      moe_in = per_moe_layer(fused.moe_input_matrix)
      moe_out = per_moe_layer(fused.moe_output_matrix)
      mla_in = nnx.Dict({
          str(i): nnx.Variable(fused.mla_input_matrix(layer.mixer, dt))
          for i, layer in enumerate(layer_list) if layer.mixer_kind != "kda"})
    self.kda_inputs, self.moe_inputs, self.moe_outputs = kda_in, moe_in, moe_out
    self.mla_inputs = mla_in
    self.final_query = model.final_query
    self.final_norm = model.final_norm
    self.lm_head = model.lm_head


def _drop_layers_axis(module) -> None:
  """Remove the leading "layers" logical axis name of a sliced group's variables (so that
  `sparse_lm.sharding.state_shardings` places each per-layer copy like its stacked source)."""
  for _, node in nnx.iter_graph(module):
    if isinstance(node, nnx.Variable):
      names = node.get_metadata().get("out_sharding")
      if names and names[0] == "layers" and len(names) == node[...].ndim + 1:
        node.set_metadata(out_sharding=tuple(names[1:]))


def on_mesh() -> bool:
  """Whether the trace runs under a `sparse_lm.sharding.use_mesh` mesh of more than one device
  (the engine's mesh path: no fused Pallas kernels, expert-sharded MoE; see engine.py)."""
  mesh = shd.current_mesh()
  return mesh is not None and mesh.size > 1


def _project(x, w, dtype):
  """x [..., D] @ w [D, ...] in dtype with fp32 accumulation (as layers.project)."""
  y = jnp.tensordot(x.astype(dtype), w.astype(dtype), axes=1,
                    preferred_element_type=jnp.float32)
  return y.astype(dtype)


# A decode step of fewer rows than this runs its projections on this many rows (zero rows
# appended, `pad_rows`); 0 turns the padding off (the reference path of the tests).
DECODE_MIN_ROWS = 2


def pad_rows(x: jax.Array, rows: int) -> jax.Array:
  """x [B, ...] -> [max(B, rows), ...]: zero rows appended behind an optimization barrier.

  A batch-1 decode step's matmuls are matrix-vector products, which XLA's GPU compiler
  strength-reduces to elementwise multiplies and reductions; for the gathered experts those
  ran at about 0.4 TB/s on an H200 (docs/inference.md). With two rows a matmul stays a GEMM
  (cuBLAS / Triton), which reads its weights near the bandwidth limit. The barrier keeps the
  simplifier from seeing the zeros. Row b < B of any row-wise function of the result is
  unchanged (up to the GEMM's summation order).
  """
  if x.shape[0] >= rows:
    return x
  zeros = jnp.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)
  return jax.lax.optimization_barrier(jnp.concatenate([x, zeros], axis=0))


def conv_tails(p: dict, x: jax.Array, old: dict, n_valid: jax.Array, dtype) -> dict:
  """The last W-1 conv inputs after each row's n_valid[b] real tokens of x.

  Row b's tail is concat(old, x W)[n_b : n_b + W-1]: positions before the piece come from the
  old tail, the rest are the projections of the piece's last real tokens (recomputed for those
  W-1 tokens only).

  Args:
    p: the KDA arrays (w_q, w_k, w_v [D, H, d]); x: [B, T, D]; old: {"q","k","v": [B, W-1, C]};
    n_valid: [B] int32 in [0, T].

  Returns:
    {"q","k","v": [B, W-1, C]} in the tails' dtype.
  """
  B, T, _ = x.shape
  W1 = old["q"].shape[1]
  idx = n_valid[:, None] - W1 + jnp.arange(W1)[None]  # [B, W-1] position in the piece
  xg = jnp.take_along_axis(x, jnp.clip(idx, 0, T - 1)[..., None], axis=1)
  new = {}
  for name in ("q", "k", "v"):
    y = _project(xg, p["w_" + name], dtype).reshape(B, W1, -1)
    prev = jnp.take_along_axis(old[name], jnp.clip(idx + W1, 0, W1 - 1)[..., None], axis=1)
    new[name] = jnp.where((idx >= 0)[..., None], y.astype(prev.dtype), prev)
  return new


def kda_cached(mixer, x: jax.Array, cache: dict, n_valid: jax.Array) -> tuple[jax.Array, dict]:
  """KDA over T new tokens per row from its cache: x [B, T, D] -> (y [B, T, D], cache)."""
  cfg = mixer.cfg
  dtype = jnp.dtype(cfg.dtype)
  p = mixer.arrays()
  B, T = x.shape[:2]
  rows = DECODE_MIN_ROWS if T == 1 else 0  # see pad_rows
  xp = pad_rows(x, rows)
  conv_p = {name: pad_rows(c, rows) for name, c in cache["conv"].items()}
  proj, tails = kda_projections(p, xp, gate_lower_bound=cfg.kda_gate_lower_bound,
                                eps=cfg.l2_norm_eps, dtype=dtype, conv_state=conv_p)
  proj, tails = jax.tree.map(lambda a: a[:B], (proj, tails))
  valid = jnp.arange(T)[None] < n_valid[:, None]
  g = jnp.where(valid[..., None, None], proj.g, 0.0)  # padding: identity step
  beta = jnp.where(valid[..., None], proj.beta, 0.0)
  if T == 1:
    o, S = recurrent_step(cache["S"], proj.q[:, 0], proj.k[:, 0], proj.v[:, 0], g[:, 0],
                          beta[:, 0], cfg.kda_head_dim ** -0.5)
    o = o[:, None]
  else:
    o, S = chunk_kda(proj.q, proj.k, proj.v, g, beta, initial_state=cache["S"],
                     output_final_state=True, chunk_size=cfg.kda_chunk_size,
                     backend=cfg.kda_backend, gate_lower_bound=cfg.kda_gate_lower_bound)
  if T == 1:  # the conv's own new tails; an idle row (n_valid = 0) keeps its old ones
    conv = {name: jnp.where(n_valid[:, None, None] > 0, tails[name].astype(old.dtype), old)
            for name, old in cache["conv"].items()}
  else:
    conv = conv_tails(p, x, cache["conv"], n_valid, dtype)
  y = kda_output(p, xp, pad_rows(o.astype(dtype), rows), eps=cfg.norm_eps, dtype=dtype)[:B]
  return y, {"conv": conv, "S": S}


def latent_attention(q_lat: jax.Array, q_rope: jax.Array, c_kv: jax.Array, k_rope: jax.Array,
                     q_pos: jax.Array, *, scale: float, block: int) -> jax.Array:
  """Absorbed MLA attention over a latent cache, causal by absolute position.

  Query (b, t) sees cache positions s <= q_pos[b, t]. Scores and softmax in fp32; the matmul
  operands in the cache's dtype.

  Args:
    q_lat: [B, T, H, C] (q_nope W_ukᵀ); q_rope: [B, T, H, R]; c_kv: [B, S, C]; k_rope: [B, S, R];
    q_pos: [B, T] int32 >= 0; scale: logit scale; block: key block (S must be a multiple when
      block < S; block >= S: one full-softmax pass).

  Returns:
    o_lat [B, T, H, C] fp32 (multiply by W_uv for the head outputs).
  """
  B, T, H, C = q_lat.shape
  S = c_kv.shape[1]
  dt = c_kv.dtype
  ql, qr = q_lat.astype(dt), q_rope.astype(dt)

  def scores(c, r, k0):
    s = (jnp.einsum("bthc,bsc->bhts", ql, c, preferred_element_type=jnp.float32) +
         jnp.einsum("bthr,bsr->bhts", qr, r, preferred_element_type=jnp.float32)) * scale
    mask = (k0 + jnp.arange(c.shape[1]))[None, None, None, :] <= q_pos[:, None, :, None]
    return jnp.where(mask, s, _NEG), mask

  if block >= S:
    s, _ = scores(c_kv, k_rope, 0)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhts,bsc->bthc", p.astype(dt), c_kv, preferred_element_type=jnp.float32)

  def body(j, carry):
    m, l, acc = carry
    k0 = j * block
    c = jax.lax.dynamic_slice_in_dim(c_kv, k0, block, axis=1)
    r = jax.lax.dynamic_slice_in_dim(k_rope, k0, block, axis=1)
    s, mask = scores(c, r, k0)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    acc = acc * corr[..., None] + jnp.einsum("bhts,bsc->bhtc", p.astype(dt), c,
                                             preferred_element_type=jnp.float32)
    return m_new, l * corr + jnp.sum(p, axis=-1), acc

  init = (jnp.full((B, H, T), _NEG, jnp.float32), jnp.zeros((B, H, T), jnp.float32),
          jnp.zeros((B, H, T, C), jnp.float32))
  num_blocks = jnp.max(q_pos) // block + 1  # blocks past every query are skipped
  _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
  return (acc / l[..., None]).transpose(0, 2, 1, 3)


def mla_cached(mixer, x: jax.Array, cache: dict, start: jax.Array, *, kv_block: int,
               xp: jax.Array | None = None, w_in: jax.Array | None = None
               ) -> tuple[jax.Array, dict]:
  """Gated MLA over T new tokens per row: writes their latents at start[b] + t and attends
  causally over the cache. x [B, T, D] -> (y [B, T, D], cache). Writes past the allocated
  cache are dropped (the engine never asks for them). xp: x with its decode padding rows
  already appended ([R, T, D], `fused.stream_read(..., rows=...)`), else padded here.
  w_in: the layer's `fused.mla_input_matrix` (the decode step's one input GEMM, fp32
  accumulation, each projection rounded from it as `nn.project` rounds its own), else the
  projections run one by one.

  Raises:
    ValueError: w_in of another shape than this layer's mla_input_matrix."""
  cfg = mixer.cfg
  dtype = jnp.dtype(cfg.dtype)
  B, T, D = x.shape
  rows = DECODE_MIN_ROWS if T == 1 else 0  # see pad_rows
  xp = pad_rows(x, rows) if xp is None else xp
  gate_logits = None
  if w_in is None:
    q = mixer.query(xp)[:B].astype(jnp.float32)
    c_kv, k_rope = jax.tree.map(lambda a: a[:B], mixer.latent(xp))
  else:
    cols = fused.mla_input_cols(mixer)
    if w_in.shape != (D, sum(w for _, w in cols.values())):
      raise ValueError(f"mla_cached: w_in {w_in.shape} is not this layer's mla_input_matrix; "
                       "rebuild it from the layer's weights")
    R = xp.shape[0]
    xw = jnp.dot(xp.reshape(R * T, D).astype(dtype), w_in.astype(dtype),
                 preferred_element_type=jnp.float32).reshape(R, T, -1)
    piece = lambda n: jax.lax.slice_in_dim(xw, cols[n][0], cols[n][0] + cols[n][1], axis=2)
    H = cfg.mla_num_heads
    if cfg.q_lora_rank:  # the model's own formulas from the pieces of the one GEMM
      q = mixer.query_from_down(piece("w_dq"))
    else:
      q = piece("w_q").astype(dtype).reshape(R, T, H, cfg.qk_head_dim)
    q = q[:B].astype(jnp.float32)
    c_kv, k_rope = mixer.latent_from_down(piece("w_dkv")[:B])
    if cfg.mla_output_gate:
      gate_logits = piece("w_gate").reshape(R, T, H, cfg.v_head_dim)
  pos = start[:, None] + jnp.arange(T)[None]
  row = jnp.arange(B)[:, None]
  c_all = cache["c_kv"].at[row, pos].set(c_kv.astype(cache["c_kv"].dtype), mode="drop")
  r_all = cache["k_rope"].at[row, pos].set(k_rope.astype(cache["k_rope"].dtype), mode="drop")
  nope = cfg.qk_nope_head_dim
  w_ukv = mixer.w_ukv[...].astype(jnp.float32)
  w_uk, w_uv = w_ukv[..., :nope], w_ukv[..., nope:]
  q_lat = jnp.einsum("bthd,chd->bthc", q[..., :nope], w_uk)
  o_lat = latent_attention(q_lat, q[..., nope:], c_all, r_all, pos, scale=mixer.scale,
                           block=kv_block if T > 1 else c_all.shape[1])
  o = jnp.einsum("bthc,chd->bthd", o_lat, w_uv).astype(dtype)
  return (mixer.output(xp, pad_rows(o, rows), gate_logits=gate_logits)[:B],
          {"c_kv": c_all, "k_rope": r_all})


# "moe_decode" (decode steps use `moe_decode`) or "model" (the model's own MoE, as prefill;
# benchmarks/decode.py --profile compares the two).
DECODE_MOE = "moe_decode"
# Gathered expert weights while the batch's assignments N k are at most this many experts.
GATHER_MAX_ASSIGNMENTS_PER_EXPERT = 1.0


def gathered_experts(z: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                     params: dict[str, jax.Array], *, beta1: float, beta2: float,
                     min_rows: int = 0) -> jax.Array:
  """u = sum_j gates_j E_{id_j}(z) with each token's chosen experts' weights gathered.

  Reads N k experts' weights (not all E): the decode step's MoE for a small batch. Same
  contract and rounding as `sparse_lm.moe.latent_moe.dispatch_and_compute` (matmul outputs in
  z's dtype, SiTU-GLU in fp32, fp32 combine). Each of the N k assignments is one batch entry
  of a batched matmul; gate and up weights are gathered side by side ([A, L, 2F]: one gather
  and one matmul). min_rows > 1 pads each entry's single row with zero rows (`pad_rows`), so
  the GPU compiler keeps the products as GEMMs.

  Args:
    z: [N, L] latent activations in the compute dtype; expert_ids: [N, k] int32 in [0, E]
      (E = sentinel, contributes 0); gates: [N, k] fp32; params: {"w_gate", "w_up": [E, L, F],
      "w_down": [E, F, L]}; beta1, beta2: SiTU-GLU clip levels; min_rows: see above.

  Returns:
    u [N, L] fp32.
  """
  E, _, F = params["w_gate"].shape
  N, k = expert_ids.shape
  ids = jnp.minimum(expert_ids, E - 1).reshape(N * k)  # [A]
  dt = z.dtype
  x = jnp.repeat(z, k, axis=0)[:, None]  # [A, 1, L]
  x = jnp.moveaxis(pad_rows(jnp.moveaxis(x, 1, 0), min_rows), 0, 1)  # [A, R, L]
  w_gu = jnp.concatenate([params["w_gate"][ids], params["w_up"][ids]], axis=-1).astype(dt)
  gu = jnp.einsum("arl,alf->arf", x, w_gu, preferred_element_type=jnp.float32).astype(dt)
  h = situ_activation(gu[..., :F], gu[..., F:], beta1, beta2, out_dtype=dt)
  out = jnp.einsum("arf,afl->arl", h, params["w_down"][ids].astype(dt),
                   preferred_element_type=jnp.float32).astype(dt)[:, 0].astype(jnp.float32)
  w = jnp.where(expert_ids < E, gates.astype(jnp.float32), 0.0).reshape(N * k, 1)
  return jnp.sum((w * out).reshape(N, k, -1), axis=1)


def moe_decode(moe, x: jax.Array, valid: jax.Array, experts=None,
               w_in: jax.Array | None = None, xp: jax.Array | None = None,
               routed_experts=None, w_out: jax.Array | None = None) -> jax.Array:
  """A LatentMoE (sparse_lm.moe.latent_moe, ARCHITECTURE §5) at inference: the frozen biases
  route, nothing is dropped, no statistics. x [B, T, D] in the compute dtype, valid [B, T]
  bool -> y [B, T, D]. The routed experts run as `gathered_experts` when N k <= E x
  GATHER_MAX_ASSIGNMENTS_PER_EXPERT, else every expert on every token (`dense_reference`).
  With fewer than DECODE_MIN_ROWS tokens the projections run on zero-padded rows (`pad_rows`).
  experts(z, ids, gates) -> u replaces `gathered_experts` when given (the Pallas kernel,
  `fused.routed_experts`; z may carry the zero rows of the padding past n). w_in:
  `fused.moe_input_matrix(moe, compute dtype)`: the latent down-projection and the shared
  expert's gate and up as one GEMM (fp32 accumulation, each piece rounded to the compute
  dtype as its own product would be). xp: x's B T rows already padded, [R, D] in the compute
  dtype (`fused.stream_read(..., rows=...)`), else padded here. routed_experts(z, logits,
  valid, z_col=) -> u: routing and the routed experts in one call
  (`fused.routed_experts_routing`: logits [n, E] fp32 `router.router_logits`, valid [n], the
  latent in z's columns [z_col, z_col + L): with w_in, the GEMM's fp32 output unsliced);
  replaces router_scores, route() and `experts` when given and the batch is small enough to
  gather. w_out (with w_in): `fused.moe_output_matrix(moe, compute dtype)`: the latent's
  up-projection and the shared expert's down-projection as one GEMM of [RMSNorm(u) | h]
  (fp32 accumulation, rounded once to the compute dtype).

  Raises:
    ValueError: w_in or w_out of another shape than the layer's moe_input_matrix /
      moe_output_matrix.
  """
  B, T, D = x.shape
  n, E, k = B * T, moe.num_experts, moe.experts_per_token
  dt = jnp.dtype(moe.compute_dtype)
  rows = DECODE_MIN_ROWS
  xf = x.reshape(n, D)
  xp = pad_rows(xf.astype(dt), rows) if xp is None else xp.astype(dt)  # [max(n, rows), D]
  small = n * k <= E * GATHER_MAX_ASSIGNMENTS_PER_EXPERT
  fused_routing = small and routed_experts is not None
  if not fused_routing:
    scores = router_lib.router_scores(xf, moe.router[...])
    routing = router_lib.route(scores, moe.balancer_bias[...], k, moe.route_scale,
                               cutoff=moe.qb_cutoff)
    ids = jnp.where(valid.reshape(n, 1), routing.expert_ids, E)
  xw = None
  shared_gu = None
  if w_in is not None:
    widths = [w.shape[1] for w in fused.moe_input_weights(moe)]
    if w_in.shape != (D, sum(widths)):
      raise ValueError(f"moe_decode: w_in {w_in.shape} is not this layer's moe_input_matrix "
                       f"({D}, {sum(widths)}); rebuild it from the layer's weights")
    xw = jnp.dot(xp, w_in.astype(dt), preferred_element_type=jnp.float32)
    pieces = jnp.split(xw, list(itertools.accumulate(widths))[:-1], axis=1)
    pieces = [a.astype(dt) for a in pieces]
    z_rows = pieces.pop(0) if moe.latent else xp
    shared_gu = pieces if moe.shared is not None else None
  else:
    z_rows = jnp.dot(xp, moe.w_down[...].astype(dt)) if moe.latent else xp  # [max(n, rows), L]
  z = z_rows[:n]
  if fused_routing:  # reads rows < n only; the latent straight from the GEMM when there is one
    logits = router_lib.router_logits(xf, moe.router[...])
    zin = xw if xw is not None and moe.latent else z_rows
    u = routed_experts(zin, logits, valid.reshape(n), z_col=0)
  elif small and experts is not None:
    u = experts(z_rows, ids, routing.gates)  # reads rows < n only: no slice kernel
  elif small:
    u = gathered_experts(z, ids, routing.gates, moe.expert_params(), beta1=moe.beta1,
                         beta2=moe.beta2, min_rows=rows)
  else:
    u = dense_reference(z, ids, routing.gates, moe.expert_params(), beta1=moe.beta1,
                        beta2=moe.beta2)
  # the latent's RMSNorm (rows padded for the GEMM) and the shared expert's SiTU-GLU from its
  # pre-activations, then their products: one GEMM with w_out, else one each
  un = (pad_rows(nn.rms_norm(u, moe.latent_norm[...], moe.norm_eps).astype(dt), rows)
        if moe.latent else None)
  h = (situ_activation(*shared_gu, moe.shared.beta1, moe.shared.beta2, out_dtype=dt)
       if shared_gu is not None else None)
  if w_out is not None and un is not None and h is not None:
    if w_out.shape != (un.shape[1] + h.shape[1], D):
      raise ValueError(f"moe_decode: w_out {w_out.shape} is not this layer's moe_output_matrix "
                       f"({un.shape[1] + h.shape[1]}, {D}); rebuild it from the layer's weights")
    y = jnp.dot(jnp.concatenate([un, h], axis=1), w_out.astype(dt),
                preferred_element_type=jnp.float32)[:n].astype(dt)
    return y.reshape(B, T, D).astype(x.dtype)
  y = jnp.dot(un, moe.w_up[...].astype(dt))[:n] if un is not None else u.astype(dt)
  y = y.reshape(B, T, D)
  if h is not None:
    y = y + jnp.dot(h, moe.shared.w_down[...].astype(dt))[:n].reshape(B, T, D)
  elif moe.shared is not None:
    y = y + moe.shared(xp[:, None])[:n].reshape(B, T, D)
  return y.astype(x.dtype)


def layer_cached(layer, stream: dict, cache: dict, *, opens: bool, start, valid, n_valid,
                 kv_block: int, kernels=(False, False),
                 kda_w_in: jax.Array | None = None,
                 moe_w_in: jax.Array | None = None,
                 moe_w_out: jax.Array | None = None,
                 mla_w_in: jax.Array | None = None) -> tuple[dict, dict]:
  """One DecoderLayer (transformer.py) from its cache: the same sub-layer order and AttnRes
  reads; MoE without capacity drops. kernels = (use, interpret) (`fused.decode_kernels`):
  a decode step's AttnRes reads, KDA and routed experts through the fused Pallas kernels;
  kda_w_in: the KDA layer's prebuilt `fused.kda_input_matrix` for that path (else built in the
  step); moe_w_in, moe_w_out: the MoE layer's `fused.moe_input_matrix` and
  `fused.moe_output_matrix` for a decode step (else its projections run one by one); mla_w_in:
  the MLA layer's `fused.mla_input_matrix` for a decode step."""
  cfg = layer.cfg
  dtype = jnp.dtype(cfg.dtype)
  use = kernels[0] and valid.shape[1] == 1
  fuse_res = use and cfg.residual == "attnres_block" and fused.FUSE["attnres"]
  stream = attnres.open_block(cfg, stream, opens)
  B = valid.shape[0]
  xp = None  # the sub-layer input with the GEMMs' zero rows, from the fused read
  if fuse_res:
    x, stream = fused.stream_read(cfg, stream, layer.attn_query[...], layer.attn_norm,
                                  interpret=kernels[1], rows=DECODE_MIN_ROWS)
    x, xp = x[:B], x[:, 0]
  else:
    x = layer.attn_norm(attnres.sublayer_input(cfg, stream, layer.attn_query[...]))
    x = x.astype(dtype)
  if layer.mixer_kind == "kda" and use and fused.FUSE["kda"]:
    y, cache = fused.kda_step_fused(layer.mixer, x, cache, n_valid, pad=pad_rows,
                                    rows=DECODE_MIN_ROWS, interpret=kernels[1], w_in=kda_w_in,
                                    xp=xp)
  elif layer.mixer_kind == "kda":
    y, cache = kda_cached(layer.mixer, x, cache, n_valid)
  else:
    y, cache = mla_cached(layer.mixer, x, cache, start, kv_block=kv_block,
                          xp=None if xp is None else xp[:, None],
                          w_in=mla_w_in if valid.shape[1] == 1 and fused.FUSE["mla_input"]
                          else None)
  if fuse_res:
    x, stream = fused.stream_read(cfg, stream, layer.ffn_query[...], layer.ffn_norm, y=y,
                                  interpret=kernels[1], rows=DECODE_MIN_ROWS)
    x, xp = x[:B], x[:, 0]
  else:
    stream = attnres.add_output(cfg, stream, y)
    x = layer.ffn_norm(attnres.sublayer_input(cfg, stream, layer.ffn_query[...])).astype(dtype)
  if layer.dense_ffn:
    rows = DECODE_MIN_ROWS if x.shape[1] == 1 else 0
    y = layer.ffn(pad_rows(x, rows) if xp is None else xp[:, None])[:x.shape[0]]
  elif x.shape[1] == 1 and DECODE_MOE == "moe_decode":
    experts = (functools.partial(fused.routed_experts, layer.ffn, interpret=kernels[1])
               if use and fused.FUSE["moe"] else None)
    routed = (functools.partial(fused.routed_experts_routing, layer.ffn, interpret=kernels[1])
              if experts is not None and fused.routing_in_kernel(layer.ffn, kernels[1])
              else None)
    y = moe_decode(layer.ffn, x, valid, experts, w_in=moe_w_in, xp=xp, routed_experts=routed,
                   w_out=moe_w_out if fused.FUSE["moe_output"] else None)
  else:
    y = moe_prefill(layer.ffn, x, valid)
  return attnres.add_output(cfg, stream, y), cache


def moe_prefill(moe, x: jax.Array, valid: jax.Array) -> jax.Array:
  """A prefill piece's LatentMoE: the model's own layer (grouped matmuls; under an `expert`
  mesh axis the expert-parallel exchange) with every cap off: inference never drops. On a mesh
  whose token shards (data x fsdp x expert x context) do not divide the piece's B x T tokens,
  which the exchange needs, `moe_decode` (experts sharded where they are: each device runs its
  own experts, nothing gathered). x [B, T, D], valid [B, T] -> y [B, T, D]."""
  mesh = shd.current_mesh()
  if mesh is not None and mesh.shape.get("expert", 1) > 1:
    shards = math.prod(mesh.shape.get(a, 1) for a in TOKEN_AXES)
    if (x.shape[0] * x.shape[1]) % shards:
      return moe_decode(moe, x, valid)
  moe.capacity_factor = None  # this is a traced copy of the layer
  moe.ragged_buffer_factor = None
  y, _ = moe(x, valid=valid, train=False)
  return y


def forward_cached(stack: DecoderStack, tokens: jax.Array, cache: list[dict], start: jax.Array,
                   n_valid: jax.Array, *, kv_block: int) -> tuple[jax.Array, list[dict]]:
  """Run T new tokens per row through the decoder from its caches.

  Args:
    stack: the model's modules (DecoderStack).
    tokens: [B, T] int32; row b's first n_valid[b] are real, the rest padding.
    cache: per-layer caches (cache.init_cache), batch B.
    start: [B] int32, tokens already in each row's cache (its length).
    n_valid: [B] int32 in [0, T].
    kv_block: key block of the latent attention for T > 1.

  Returns:
    logits [B, vocab] fp32 after each row's last real token (garbage for n_valid = 0), and the
    new caches (row lengths become start + n_valid).
  """
  cfg = stack.cfg
  dtype = jnp.dtype(cfg.dtype)
  T = tokens.shape[1]
  kernels = fused.decode_kernels(cfg) if T == 1 and not on_mesh() else (False, False)
  valid = jnp.arange(T)[None] < n_valid[:, None]
  stream = attnres.init_stream(cfg, stack.embed(tokens))
  new_cache = []
  kda_in = {} if stack.kda_inputs is None else stack.kda_inputs
  moe_in = {} if stack.moe_inputs is None or T != 1 else stack.moe_inputs
  moe_out = {} if stack.moe_outputs is None or T != 1 else stack.moe_outputs
  mla_in = {} if stack.mla_inputs is None or T != 1 else stack.mla_inputs
  for i, (layer, c) in enumerate(zip(stack.layers, cache)):
    stream, c = layer_cached(layer, stream, c, opens=i % cfg.attnres_block_layers == 0,
                             start=start, valid=valid, n_valid=n_valid, kv_block=kv_block,
                             kernels=kernels,
                             kda_w_in=kda_in[str(i)][...] if str(i) in kda_in else None,
                             moe_w_in=moe_in[str(i)][...] if str(i) in moe_in else None,
                             moe_w_out=moe_out[str(i)][...] if str(i) in moe_out else None,
                             mla_w_in=mla_in[str(i)][...] if str(i) in mla_in else None)
    new_cache.append(c)
  if kernels[0] and cfg.residual == "attnres_block" and fused.FUSE["attnres"]:
    h, _ = fused.stream_read(cfg, stream, stack.final_query[...], stack.final_norm,
                             interpret=kernels[1])
    h = h[:, 0]
  else:
    h = attnres.final_output(cfg, stream, stack.final_query[...])  # [B, T, D]
    last = jnp.clip(n_valid - 1, 0, T - 1)
    h = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
    h = stack.final_norm(h).astype(dtype)
  logits = jnp.dot(h, stack.lm_head[...].astype(dtype), preferred_element_type=jnp.float32)
  return logits, new_cache
