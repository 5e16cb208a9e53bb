"""Audit (hand mutation testing of sparse_lm/model/{kda,mla,transformer}.py): independent fp64
NumPy references (tests/model/numpy_layers.py and the decoder reference of
tests/model/test_independent_references.py, which read only parameter arrays) for what the
existing tests could not see:

- KDA with K != V and small activations (the L2-norm and output-RMSNorm epsilons matter): the
  tiny preset has K == V, so a decode scale of V^-1/2 instead of K^-1/2 passed, and at O(1)
  activations the per-head output RMSNorm cancels any constant factor on o (scale, q norm);
  the q/k L2-norm epsilon (1e-6, inside the square root, §2.2) was never exercised;
- MLA decode with kv_lora_rank != qk_nope_head_dim: in the tiny preset kv_lora + rope ==
  nope + rope (24), so an absorbed decode scaled by the latent width (kv_lora + rope)^-1/2
  instead of 1/sqrt(nope + rope) (§3) passed;
- `max_attention_logit` (QK-clip's S_max) with packed documents and padding: only tested on
  one unpadded document;
- the decoder with a KDA tail between the last full group and the last MLA layer (Kimi-Linear
  layout) under Block AttnRes: no test built one, so a tail layer that opened its block at the
  wrong index passed.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_lm.config import get_preset
from sparse_lm.model.kda import KDA
from sparse_lm.model.mla import MLA, max_attention_logit
from tests.model import numpy_layers as npl
from tests.model.test_independent_references import CFG as WIRING_CFG
from tests.model.test_independent_references import (_unstack, decoder_against_numpy,
                                                      randomised_model)

SEED = 1234


def _rel(ref, out):
  ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
  return np.linalg.norm(ref - out) / np.linalg.norm(ref)


def _f64(v):
  return np.asarray(v[...], np.float64)


def _prefill_then_decode(layer, x, cache, prefill):
  """The layer's decode path over x [B, T, D]: the first `prefill` tokens in one call, then one
  token a call; (outputs [B, T, D], the final cache)."""
  decode = nnx.jit(lambda m, x, c: m.decode(x, c))
  outs = []
  for a, b in [(0, prefill)] + [(t, t + 1) for t in range(prefill, x.shape[1])]:
    y, cache = decode(layer, x[:, a:b], cache)
    outs.append(y)
  return jnp.concatenate(outs, 1), cache


KDA_NAMES = ("w_q", "w_k", "w_v", "conv_q", "conv_k", "conv_v", "w_g_down", "w_g_up", "A_log",
             "dt_bias", "w_beta", "w_og", "o_norm", "w_o")


def test_kda_k_ne_v_small_activations_forward_and_decode():
  """K = 32, V = 16; conv kernels scaled by 3e-3 so |SiLU(conv)|^2 ~ the L2 eps (1e-6) and
  o^2 ~ the RMSNorm eps: the output then depends on the query scale K^-1/2 and on both
  epsilons. Chunked forward (two packed documents) and prefill + token-by-token decode against
  the fp64 NumPy layer."""
  cfg = get_preset("tiny", kda_value_dim=16)
  assert cfg.kda_head_dim != cfg.kda_value_dim
  layer = KDA(cfg, rngs=nnx.Rngs(SEED))
  rng = np.random.default_rng(SEED)
  for n in ("w_og", "A_log", "dt_bias", "o_norm"):
    v = getattr(layer, n)
    v[...] = v[...] + jnp.asarray(rng.standard_normal(v.shape), jnp.float32) * 0.5
  for n in ("conv_q", "conv_k", "conv_v"):
    v = getattr(layer, n)
    v[...] = v[...] * 3e-3
  B, T = 2, 12
  x = jnp.asarray(rng.standard_normal((B, T, cfg.d_model)), jnp.float32)
  p = {n: _f64(getattr(layer, n)) for n in KDA_NAMES}
  seg = np.ones((B, T), np.int32)
  seg[0, 5:] = 2
  ref = npl.kda_layer(p, np.asarray(x, np.float64), seg,
                      gate_lower_bound=cfg.kda_gate_lower_bound, eps=cfg.norm_eps)
  assert np.std(ref) > 0
  y = nnx.jit(lambda m, x, s: m(x, segment_ids=s))(layer, x, jnp.asarray(seg))
  assert _rel(ref, y) < 1e-5, _rel(ref, y)
  # decode: one document per row
  ref1 = npl.kda_layer(p, np.asarray(x, np.float64), np.ones((B, T), np.int32),
                       gate_lower_bound=cfg.kda_gate_lower_bound, eps=cfg.norm_eps)
  out, _ = _prefill_then_decode(layer, x, layer.init_cache(B), prefill=5)
  assert _rel(ref1, out) < 1e-5, _rel(ref1, out)


def test_mla_decode_with_latent_width_not_equal_to_qk_width():
  """kv_lora_rank = 32: latent width 32 + 8 != q/k width 16 + 8. Absorbed decode (prefill of
  7 tokens, then one at a time) and the prefill forward against the fp64 NumPy layer (§3:
  softmax scale 1/sqrt(nope + rope))."""
  cfg = get_preset("tiny", kv_lora_rank=32)
  assert cfg.kv_lora_rank + cfg.qk_rope_head_dim != cfg.qk_head_dim
  layer = MLA(cfg, rngs=nnx.Rngs(SEED))
  rng = np.random.default_rng(SEED)
  for norm in (layer.q_norm, layer.kv_norm):
    norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, norm.scale.shape), jnp.float32)
  layer.w_uq[...] = layer.w_uq[...] * 4.0  # peaky softmax: the scale is visible
  B, T = 2, 11
  x = jnp.asarray(rng.standard_normal((B, T, cfg.d_model)), jnp.float32)
  p = {n: _f64(getattr(layer, n)) for n in ("w_dq", "w_uq", "w_dkv", "w_ukv", "w_gate", "w_o")}
  p["q_norm"], p["kv_norm"] = _f64(layer.q_norm.scale), _f64(layer.kv_norm.scale)
  ref = npl.mla_layer(p, np.asarray(x, np.float64), np.ones((B, T), np.int32),
                      kv_lora_rank=cfg.kv_lora_rank, nope=cfg.qk_nope_head_dim, eps=cfg.norm_eps)
  assert _rel(ref, nnx.jit(lambda m, x: m(x))(layer, x)) < 1e-5
  out, cache = _prefill_then_decode(layer, x, layer.init_cache(B, T + 2), prefill=7)
  assert int(cache.length) == T
  assert _rel(ref, out) < 1e-5, _rel(ref, out)


def test_max_attention_logit_with_documents_and_padding():
  """S_max per head = max over batch, query i, key j <= i of the same (non-padding) document
  of scale q_i . k_j; padding tokens (segment 0) are given large q / k so that counting them
  would change the answer."""
  rng = np.random.default_rng(SEED)
  B, T, H, D = 2, 10, 3, 8
  q = rng.standard_normal((B, T, H, D))
  k = rng.standard_normal((B, T, H, D))
  seg = np.array([[1, 1, 1, 2, 2, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1, 2, 2, 0, 0]], np.int32)
  q[seg == 0] *= 10.0
  k[seg == 0] *= 10.0
  scale = D ** -0.5
  ref = np.full(H, -np.inf)
  for b in range(B):
    for i in range(T):
      for j in range(i + 1):
        if seg[b, i] != 0 and seg[b, i] == seg[b, j]:
          ref = np.maximum(ref, scale * np.einsum("hd,hd->h", q[b, i], k[b, j]))
  got = max_attention_logit(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                            scale=scale, segment_ids=jnp.asarray(seg), block=4)
  np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)


def test_decoder_with_kda_tail_matches_numpy_forward():
  """6 layers, MLA every 2nd: the head group (0, 1), one scanned group (2, 3), a KDA tail
  layer 4 and the last MLA layer 5; AttnRes blocks of 2 layers open at 0, 2 and 4 (the tail
  layer opens one). Logits against the fp64 NumPy decoder of test_independent_references."""
  cfg = dataclasses.replace(WIRING_CFG, num_layers=6)
  assert cfg.layer_types == ("kda", "mla", "kda", "mla", "kda", "mla")
  rng = np.random.default_rng(SEED)
  model = randomised_model(cfg, SEED, rng)
  assert model.tail is not None and len(model.tail) == 1
  layers = (list(model.head.layers) + list(_unstack(model.groups, 0).layers)
            + list(model.tail) + [model.last])
  ref, logits, _ = decoder_against_numpy(model, layers, cfg, rng, B=2, T=9)
  assert np.std(ref) > 0.1
  assert _rel(ref, logits) < 1e-4, _rel(ref, logits)
