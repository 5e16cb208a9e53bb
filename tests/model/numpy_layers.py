"""Independent float64 NumPy forwards of one KDA layer, one Gated MLA layer and one LatentMoE
layer, written from ARCHITECTURE §2.1-§2.3, §3 and §5. They read only parameter arrays (a dict
of NumPy arrays named like the modules' params) and never call sparse_lm code."""

import numpy as np


def sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def silu(x):
  return x * sigmoid(x)


def rms_norm(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def l2_norm(x, eps=1e-6):
  return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def short_conv(y, w, seg):
  """Causal depthwise conv, no bias, no mixing across segment ids: y [B,T,C], w [W,C]."""
  B, T, _ = y.shape
  W = w.shape[0]
  out = np.zeros_like(y)
  for b in range(B):
    for t in range(T):
      for lag in range(W):
        if t - lag >= 0 and seg[b, t - lag] == seg[b, t]:
          out[b, t] += w[W - 1 - lag] * y[b, t - lag]
  return out


def kda_recurrence(q, k, v, g, beta, seg, scale):
  """§2.1 token by token; the state restarts at each document; padding (seg 0) outputs 0."""
  B, T, H, K = q.shape
  o = np.zeros((B, T, H, v.shape[-1]))
  for b in range(B):
    S = np.zeros((H, K, v.shape[-1]))
    for t in range(T):
      if seg[b, t] == 0:
        continue
      if t > 0 and seg[b, t] != seg[b, t - 1]:
        S = np.zeros_like(S)
      S = np.exp(g[b, t])[:, :, None] * S
      pred = np.einsum("hkv,hk->hv", S, k[b, t])
      S = S + beta[b, t][:, None, None] * k[b, t][:, :, None] * (v[b, t] - pred)[:, None, :]
      o[b, t] = np.einsum("hkv,hk->hv", S, scale * q[b, t])
  return o


def kda_layer(p, x, seg, *, gate_lower_bound, eps):
  """§2.2: y = W_o[sigmoid(x W_og) * RMSNorm_head(o)], o the §2.1 recurrence of
  q, k = L2Norm(SiLU(ShortConv(x W))), v = SiLU(ShortConv(x W_v)), the §2.3 gate of the
  low-rank z = (x W_g_down) W_g_up and beta = sigmoid(x W_beta)."""
  B, T, _ = x.shape

  def branch(w, conv):  # w [D, H, d], conv [W, H, d]
    y = np.einsum("btd,dhe->bthe", x, w)
    H, d = y.shape[-2:]
    return silu(short_conv(y.reshape(B, T, H * d), conv.reshape(-1, H * d), seg)
                ).reshape(B, T, H, d)

  q = l2_norm(branch(p["w_q"], p["conv_q"]))
  k = l2_norm(branch(p["w_k"], p["conv_k"]))
  v = branch(p["w_v"], p["conv_v"])
  H, K = q.shape[-2:]
  z = np.einsum("btr,rhk->bthk", x @ p["w_g_down"], p["w_g_up"])
  a = np.exp(p["A_log"])[:, None]
  pre = z + p["dt_bias"].reshape(H, K)
  if gate_lower_bound is None:
    g = -a * np.log1p(np.exp(pre))
  else:
    g = gate_lower_bound * sigmoid(a * pre)
  beta = sigmoid(np.einsum("btd,dh->bth", x, p["w_beta"]))
  o = kda_recurrence(q, k, v, g, beta, seg, K ** -0.5)
  gate = sigmoid(np.einsum("btd,dhv->bthv", x, p["w_og"]))
  return np.einsum("bthv,hvd->btd", gate * rms_norm(o, p["o_norm"], eps), p["w_o"])


def mla_layer(p, x, seg, *, kv_lora_rank, nope, eps):
  """§3: c_q = RMSNorm(x W_dq), q = c_q W_uq; [c_kv; k_rope] = x W_dkv, c_kv = RMSNorm(c_kv),
  [k_nope; v] = c_kv W_ukv, k = [k_nope; k_rope shared by the heads]; causal, segment-masked
  softmax with scale 1/sqrt(nope + rope), no rotary; y = W_o[sigmoid(x W_gate) * o]."""
  B, T, _ = x.shape
  q = np.einsum("btc,che->bthe", rms_norm(x @ p["w_dq"], p["q_norm"], eps), p["w_uq"])
  ckv = x @ p["w_dkv"]
  c_kv, k_rope = rms_norm(ckv[..., :kv_lora_rank], p["kv_norm"], eps), ckv[..., kv_lora_rank:]
  kv = np.einsum("btc,che->bthe", c_kv, p["w_ukv"])
  H = kv.shape[2]
  k = np.concatenate([kv[..., :nope], np.repeat(k_rope[:, :, None], H, axis=2)], -1)
  v = kv[..., nope:]
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  mask = (np.arange(T)[:, None] >= np.arange(T)[None, :])[None] & (
      seg[:, :, None] == seg[:, None, :])
  s = np.where(mask[:, None], s, -np.inf)
  w = np.exp(s - s.max(-1, keepdims=True))
  o = np.einsum("bhqk,bkhd->bqhd", w / w.sum(-1, keepdims=True), v)
  gate = sigmoid(np.einsum("btd,dhv->bthv", x, p["w_gate"]))
  return np.einsum("bthv,hvd->btd", gate * o, p["w_o"])


def situ_glu(x, w_gate, w_up, w_down, beta1, beta2):
  """§5: W_d [beta1 tanh(g/beta1) sigmoid(g)] * [beta2 tanh(u/beta2)]."""
  g, u = x @ w_gate, x @ w_up
  return (beta1 * np.tanh(g / beta1) * sigmoid(g) * beta2 * np.tanh(u / beta2)) @ w_down


def latent_moe_layer(p, x, *, k, route_scale, beta1, beta2, eps):
  """§5 (dropless): s = sigmoid(x W_r); top-k of s + b; gates s_sel / sum s_sel * route_scale;
  u = sum_i p_i E_i(x W_down) with SiTU-GLU experts; y = shared(x) + W_up RMSNorm(u)."""
  B, T, D = x.shape
  xf = x.reshape(-1, D)
  s = sigmoid(xf @ p["router"])
  ids = np.argsort(-(s + p["balancer_bias"]), axis=-1, kind="stable")[:, :k]
  s_sel = np.take_along_axis(s, ids, -1)
  gates = s_sel / s_sel.sum(-1, keepdims=True) * route_scale
  z = xf @ p["w_down"]
  u = np.zeros_like(z)
  for t in range(xf.shape[0]):
    for j in range(k):
      e = ids[t, j]
      u[t] += gates[t, j] * situ_glu(z[t], p["expert_gate"][e], p["expert_up"][e],
                                     p["expert_down"][e], beta1, beta2)
  y = rms_norm(u, p["latent_norm"], eps) @ p["w_up"]
  y = y + situ_glu(xf, p["shared_gate"], p["shared_up"], p["shared_down"], beta1, beta2)
  return y.reshape(B, T, D)
