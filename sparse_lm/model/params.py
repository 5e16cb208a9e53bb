"""Parameter counts and FLOPs per token, from abstract shapes (no allocation).

`count_params(get_preset("full"))` runs in a few seconds on a CPU: the model is built under
`nnx.eval_shape`, so only shapes exist.

Counting conventions (ARCHITECTURE.md §1):
  total   every trainable parameter (nnx.Param), including both embedding tables... i.e. the
          input embedding and the untied LM head. Balancer state (bias, histograms) is not a
          parameter.
  active  the parameters one token's forward pass multiplies with: everything except the
          routed experts, plus k/E of the routed experts, minus the input embedding table (a
          lookup touches one row, not a matmul; the LM head counts). With this convention the
          full preset gives 104.2B, the published figure; counting the input table too would
          give 105.4B (1.1% more).
"""

from __future__ import annotations

from flax import nnx

from sparse_lm.config import ModelConfig
from sparse_lm.model.transformer import Transformer


def _abstract_params(cfg: ModelConfig):
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  return nnx.state(model, nnx.Param)


def _names(var) -> tuple:
  names = tuple(var.get_metadata().get("out_sharding") or ())
  return names[1:] if names[:1] == ("layers",) else names


def param_breakdown(cfg: ModelConfig, params: nnx.State | None = None) -> dict[str, int]:
  """Parameter counts by kind: "routed_experts", "embedding" (input table), "lm_head",
  "other", and "total". Routed-expert weights are the Params whose first logical axis (after
  any stacked `layers` axis) is `exp`. `params`: the model's nnx.Param state (concrete or
  abstract, e.g. a TrainState's) if one is at hand; otherwise the model is built abstractly
  (about 1.6 s for `tiny` on 2 CPU cores)."""
  state = _abstract_params(cfg) if params is None else params
  out = {"routed_experts": 0, "embedding": 0, "lm_head": 0, "other": 0}
  for path, var in nnx.to_flat_state(state):
    size = 1
    for s in var.shape:
      size *= int(s)
    keys = [str(p) for p in path]
    if _names(var)[:1] == ("exp",):
      out["routed_experts"] += size
    elif keys[:1] == ["embed"]:
      out["embedding"] += size
    elif keys[:1] == ["lm_head"]:
      out["lm_head"] += size
    else:
      out["other"] += size
  out["total"] = sum(out.values())
  return out


def count_params(cfg: ModelConfig, params: nnx.State | None = None) -> dict[str, int]:
  """{"total": int, "active": int} parameters (conventions in the module docstring);
  `params` as in `param_breakdown`."""
  b = param_breakdown(cfg, params)
  routed_active = b["routed_experts"] * cfg.experts_per_token // cfg.num_experts
  active = b["other"] + b["lm_head"] + routed_active
  return {"total": b["total"], "active": active}


def flops_per_token(cfg: ModelConfig, seq_len: int,
                    params: nnx.State | None = None) -> dict[str, float]:
  """Training FLOPs per token (forward + backward = 3x forward) for MFU.

  matmul:    6 * active parameters (2 per multiply-add, x3 for fwd+bwd).
  attention: per MLA layer, QKᵀ and PV over on average seq_len / 2 keys (causal):
             6 * H * (d_qk + d_v) * seq_len / 2.
  kda:       per KDA layer and head, the chunked algorithm's state terms (S q, Sᵀk / W S,
             state update: ~3 K·V multiply-adds) and intra-chunk terms (A_kk, A_qk over
             C = kda_chunk_size keys of width K, and A_qk V' of width V, ~C·(2K + V)/2):
             6 * H * (3·K·V + C·(2K + V)/2).

  `params`: as in `param_breakdown` (the counts come from it when given).

  Returns:
    {"matmul", "attention", "kda", "total"} in FLOPs per token.
  """
  active = count_params(cfg, params)["active"]
  matmul = 6.0 * active
  H, dqk, dv = cfg.mla_num_heads, cfg.qk_head_dim, cfg.v_head_dim
  attention = cfg.num_mla_layers * 6.0 * H * (dqk + dv) * seq_len / 2
  Hk, K, V, C = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_value_dim, cfg.kda_chunk_size
  kda = cfg.num_kda_layers * 6.0 * Hk * (3 * K * V + C * (2 * K + V) / 2)
  return {"matmul": matmul, "attention": attention, "kda": kda,
          "total": matmul + attention + kda}
