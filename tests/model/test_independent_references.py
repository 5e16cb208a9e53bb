"""Independent fp64 NumPy references for what the other tests only check against the code
itself (audit of tests/model and tests/moe):

- the whole decoder's wiring (ARCHITECTURE §4 Block AttnRes around §2/§3/§5 sub-layers: which
  sources each sub-layer reads, its own pseudo-query, the pre-norm after the mix, block commits,
  the final AttnRes, final norm and untied LM head). tests/model/test_transformer.py checks only
  self-consistency (causality, packing, scan == unrolled), so a mis-wired stream passed it;
- the Switch-style auxiliary balance loss of the `aux_loss` balancer (§6), which
  tests/moe/test_moe_balancing.py::test_ablation_balancers compared with
  `balancing.switch_aux_loss` itself.

The references read only parameter arrays of the NNX modules and call no sparse_lm code; the
per-layer forwards come from tests/model/numpy_layers.py (itself independent).
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_lm.config import get_preset
from sparse_lm.model.transformer import Transformer
from sparse_lm.moe import balancing
from tests.model import numpy_layers as npl


def _seed():
  seed = int(np.random.randint(1 << 30))
  print(f"seed={seed}")
  return seed


def _rel(ref, out):
  ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
  return np.linalg.norm(ref - out) / np.linalg.norm(ref)


def _a(v):
  return np.asarray(v[...], np.float64)


# ------------------------------------------------------------------ the decoder's wiring
# Layers 0 KDA (dense FFN), 1 MLA, 2 KDA, 3 MLA (one scanned group), 4 MLA (last). AttnRes
# blocks of 2 layers open at 0, 2 and 4: block commits in the head, in the scanned group and at
# the last layer.
CFG = get_preset("tiny", num_layers=5, mla_every=2, attnres_block_layers=2, d_model=32,
                 vocab_size=64, dense_hidden=48, expert_hidden=24, shared_expert_hidden=24,
                 moe_latent_dim=16, route_scale=2.5, attention_chunk_size=16,
                 loss_chunk_size=16)


def _np_attnres(sources, w, eps):
  """§4: h = sum_j alpha_j s_j, alpha = softmax_j(w . RMSNorm(s_j)) (no learned key scale)."""
  s = np.stack(sources)
  keys = s / np.sqrt(np.mean(s * s, -1, keepdims=True) + eps)
  logits = keys @ w
  a = np.exp(logits - logits.max(0))
  a /= a.sum(0)
  return np.sum(a[..., None] * s, 0)


def _np_moe(moe, x, cfg, min_gap):
  p = {n: _a(getattr(moe, n)) for n in ("router", "balancer_bias", "w_down", "expert_gate",
                                        "expert_up", "expert_down", "latent_norm", "w_up")}
  for n in ("gate", "up", "down"):
    p[f"shared_{n}"] = _a(getattr(moe.shared, f"w_{n}"))
  z = np.sort(npl.sigmoid(x.reshape(-1, x.shape[-1]) @ p["router"]) + p["balancer_bias"], -1)
  k = cfg.experts_per_token
  min_gap.append(float(np.min(z[:, -k] - z[:, -k - 1])))  # a near-tie may route differently
  return npl.latent_moe_layer(p, x, k=k, route_scale=cfg.route_scale, beta1=4.0, beta2=25.0,
                              eps=cfg.norm_eps)


def _np_mixer(layer, kind, x, seg, cfg):
  m = layer.mixer
  if kind == "kda":
    p = {n: _a(getattr(m, n)) for n in (
        "w_q", "w_k", "w_v", "conv_q", "conv_k", "conv_v", "w_g_down", "w_g_up", "A_log",
        "dt_bias", "w_beta", "w_og", "o_norm", "w_o")}
    return npl.kda_layer(p, x, seg, gate_lower_bound=cfg.kda_gate_lower_bound,
                         eps=cfg.norm_eps)
  p = {n: _a(getattr(m, n)) for n in ("w_dq", "w_uq", "w_dkv", "w_ukv", "w_gate", "w_o")}
  p["q_norm"], p["kv_norm"] = _a(m.q_norm.scale), _a(m.kv_norm.scale)
  return npl.mla_layer(p, x, seg, kv_lora_rank=cfg.kv_lora_rank, nope=cfg.qk_nope_head_dim,
                       eps=cfg.norm_eps)


def _np_decoder(layers, model, tokens, seg, cfg, min_gap):
  """fp64 forward of §4 around the layers: b_0 = embedding; each sub-layer reads the AttnRes
  mix of [b_0, committed block sums..., the current block's partial sum (if non-empty)] with
  its own pseudo-query, applies its pre-norm, and adds its output to the partial sum; a block
  opening commits the partial sum; then the final AttnRes, final RMSNorm and the LM head."""
  eps = cfg.norm_eps
  rms = lambda x, scale: npl.rms_norm(x, _a(scale), eps)
  blocks, partial = [_a(model.embed.embedding)[np.asarray(tokens)]], None
  for i, (layer, kind) in enumerate(zip(layers, cfg.layer_types)):
    if i % cfg.attnres_block_layers == 0 and partial is not None:
      blocks, partial = blocks + [partial], None
    for query, norm, run in (
        (layer.attn_query, layer.attn_norm, lambda x: _np_mixer(layer, kind, x, seg, cfg)),
        (layer.ffn_query, layer.ffn_norm,
         lambda x: (npl.situ_glu(x, _a(layer.ffn.w_gate), _a(layer.ffn.w_up),
                                 _a(layer.ffn.w_down), 4.0, 25.0)
                    if i < cfg.num_dense_layers else _np_moe(layer.ffn, x, cfg, min_gap)))):
      h = _np_attnres(blocks + ([] if partial is None else [partial]), _a(query), eps)
      y = run(rms(h, norm.scale))
      partial = y if partial is None else partial + y
  h = _np_attnres(blocks + [partial], _a(model.final_query), eps)
  return rms(h, model.final_norm.scale) @ _a(model.lm_head)


def _unstack(module, g):
  """Group g of the nnx.vmap-stacked groups as a plain module (parameter slices only)."""
  graphdef, state = nnx.split(module)
  return nnx.merge(graphdef, jax.tree.map(lambda a: a[g], state))


def randomised_model(cfg, seed, rng):
  """A Transformer whose zero- or one-initialised parameters (pseudo-queries, norm scales, KDA
  gate and output gate, routing bias) are drawn at random from `rng`, so that a mix that reads
  the wrong sources or query, a pre-norm in the wrong place or a skipped final norm is visible."""
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  graphdef, state = nnx.split(model)

  def randomise(path, x):
    name = jax.tree_util.keystr(path)
    if "query" in name:
      return jnp.asarray(rng.standard_normal(x.shape) * 0.3, x.dtype)
    if "scale" in name or "o_norm" in name or "latent_norm" in name:
      return jnp.asarray(rng.uniform(0.5, 1.5, x.shape), x.dtype)
    if any(n in name for n in ("w_og", "A_log", "dt_bias")):
      return x + jnp.asarray(rng.standard_normal(x.shape) * 0.5, x.dtype)
    if "balancer_bias" in name:
      return jnp.asarray(rng.standard_normal(x.shape) * 0.1, x.dtype)
    return x

  return nnx.merge(graphdef, jax.tree.map_with_path(randomise, state))


def decoder_against_numpy(model, layers, cfg, rng, *, B, T):
  """(fp64 NumPy logits, the model's logits, the top-k gaps) on random tokens, two packed
  documents in row 0; inputs are redrawn (up to 5 times) until no token sits on a top-k
  near-tie, where fp32 and fp64 could route differently."""
  assert [l.mixer_kind for l in layers] == list(cfg.layer_types)
  for _ in range(5):
    tokens = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    seg = np.ones((B, T), np.int32)
    seg[0, rng.integers(3, T - 3):] = 2
    min_gap = []
    ref = _np_decoder(layers, model, tokens, seg, cfg, min_gap)
    if min(min_gap) > 1e-4:
      break
  logits = nnx.jit(lambda m, t, s: m(t, segment_ids=s))(model, jnp.asarray(tokens),
                                                          jnp.asarray(seg))
  return ref, logits, min_gap


def test_decoder_wiring_matches_numpy_forward():
  """Logits of a 5-layer model (KDA/MLA mixers, dense and LatentMoE FFNs, Block AttnRes over
  three blocks, packed documents) against the fp64 NumPy forward of ARCHITECTURE §2-§5 built
  from the parameter arrays only. Every zero- or one-initialised parameter (pseudo-queries,
  norm scales, KDA gate / output gate, routing bias) is randomised so that a mix that reads the
  wrong sources or query, a pre-norm in the wrong place or a skipped final norm is visible."""
  cfg = CFG
  seed = _seed()
  rng = np.random.default_rng(seed)
  model = randomised_model(cfg, seed, rng)
  layers = (list(model.head.layers) + list(_unstack(model.groups, 0).layers) + [model.last])
  ref, logits, min_gap = decoder_against_numpy(model, layers, cfg, rng, B=2, T=13)
  assert len(min_gap) == cfg.num_layers - cfg.num_dense_layers
  assert np.std(ref) > 0.1
  assert _rel(ref, logits) < 1e-4, _rel(ref, logits)


# ------------------------------------------------------------------ Switch-style aux loss
def test_switch_aux_loss_matches_numpy_formula():
  """§6 `aux_loss` balancer: E * sum_j f_j P_j with f_j = (assignments to j) / (k * tokens)
  and P_j the mean over (valid) tokens of s_ij / sum_e s_ie; padding (weight 0) excluded. Also
  its gradient w.r.t. the scores (through P only; f is a constant). The top-k ids and the
  scores are random and unrelated, so f and P differ per expert."""
  rng = np.random.default_rng(_seed())
  n, e, k = 53, 7, 3
  s = npl.sigmoid(rng.standard_normal((n, e)) * 2)
  ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
  weight = (rng.random(n) > 0.25).astype(np.float64)
  tokens = weight.sum()
  counts = np.zeros(e)
  np.add.at(counts, ids, np.broadcast_to(weight[:, None], ids.shape))
  f = counts / (k * tokens)

  def ref(s):
    p = s / s.sum(-1, keepdims=True)
    return e * np.sum(f * (weight @ p) / tokens)

  sj = jnp.asarray(s, jnp.float32)
  load = balancing.expert_load(jnp.asarray(ids, jnp.int32), jnp.asarray(weight, jnp.float32), e)
  np.testing.assert_allclose(np.asarray(load), counts)  # the load the loss is given
  got, grad = jax.value_and_grad(lambda s: balancing.switch_aux_loss(
      s, load, jnp.asarray(weight, jnp.float32), k))(sj)
  np.testing.assert_allclose(float(got), ref(s), rtol=1e-5)
  # d/ds_ij of e * sum_j f_j * mean_i p_ij, p = s / sum(s): (e / tokens) w_i (f_j - f . p_i) / S_i
  p = s / s.sum(-1, keepdims=True)
  want = e / tokens * weight[:, None] * (f[None, :] - (p @ f)[:, None]) / s.sum(-1,
                                                                                 keepdims=True)
  np.testing.assert_allclose(np.asarray(grad, np.float64), want, rtol=1e-4,
                             atol=1e-6 * np.abs(want).max())
