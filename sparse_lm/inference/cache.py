"""Decode caches of the hybrid decoder and their size (ARCHITECTURE.md §1-§3).

Per layer, what inference keeps between tokens (nothing else: AttnRes mixes sources within one
token, and the MoE routes each token on its own):

  KDA layer  S [B, H, K, V] fp32, the recurrent state (§2.1), and the short-convolution tails
             {"q", "k": [B, W-1, H*K], "v": [B, W-1, H*V]} in cfg.dtype: the last W-1 inputs
             of each causal conv. Constant size, whatever the context length.
  MLA layer  the latent cache {"c_kv": [B, S, kv_lora_rank] (after kv_norm), "k_rope":
             [B, S, qk_rope_head_dim]} in cfg.dtype: kv_lora_rank + qk_rope_head_dim values per
             token (512 + 64 = 576 at full scale), read by the absorbed attention (§3).

Every row has its own length, kept by the caller (the engine) as an int32 [B] array; positions
at or beyond a row's length hold stale values that no query reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from sparse_lm import sharding as shd
from sparse_lm.config import ModelConfig

# Logical axes of each cache array (rows, ..., heads / latent): rows over the batch axes
# (data, fsdp, expert) where the engine's batch divides, KDA heads over tensor, the latent
# and rope widths whole (kv_lora, as the MLA weights), positions whole.
CACHE_AXES = {
    "S": ("activation_batch", "activation_heads", None, None),
    "conv": ("activation_batch", None, "activation_heads"),
    "c_kv": ("activation_batch", None, "kv_lora"),
    "k_rope": ("activation_batch", None, "kv_lora"),
}


def padded_length(max_length: int, block: int) -> int:
  """The latent cache's allocated positions: max_length rounded up to the key block."""
  return -(-max_length // block) * block


def init_layer_cache(cfg: ModelConfig, kind: str, batch: int, length: int) -> dict:
  """Zeros for one layer: kind "kda" or "mla"; length = allocated latent positions."""
  dt = jnp.dtype(cfg.dtype)
  if kind == "kda":
    H, K, V, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_value_dim, cfg.kda_conv_size
    conv = {"q": jnp.zeros((batch, W - 1, H * K), dt), "k": jnp.zeros((batch, W - 1, H * K), dt),
            "v": jnp.zeros((batch, W - 1, H * V), dt)}
    return {"conv": conv, "S": jnp.zeros((batch, H, K, V), jnp.float32)}
  return {"c_kv": jnp.zeros((batch, length, cfg.kv_lora_rank), dt),
          "k_rope": jnp.zeros((batch, length, cfg.qk_rope_head_dim), dt)}


def init_cache(cfg: ModelConfig, batch: int, length: int) -> list[dict]:
  """One cache per decoder layer, in layer order (a list of dicts of arrays)."""
  return [init_layer_cache(cfg, kind, batch, length) for kind in cfg.layer_types]


def cache_shardings(cache, mesh: jax.sharding.Mesh) -> list[dict]:
  """NamedShardings of a cache (init_cache's tree, arrays or ShapeDtypeStructs) on `mesh`,
  by CACHE_AXES under the default rules (`sharding.LOGICAL_AXIS_RULES`: generation never
  splits a row's positions); a mesh axis that does not divide its dimension is dropped."""
  def one(path, a):
    keys = [getattr(k, "key", None) for k in path]
    names = CACHE_AXES["conv" if "conv" in keys else keys[-1]]
    spec = shd.logical_to_spec(names, rules=shd.LOGICAL_AXIS_RULES, mesh=mesh, shape=a.shape)
    return NamedSharding(mesh, spec)
  return jax.tree_util.tree_map_with_path(one, cache)


def cache_bytes(cfg: ModelConfig, length: int, batch: int = 1, *,
                mla_everywhere: bool = False) -> int:
  """Bytes of decode cache for `batch` rows of `length` tokens (the logical size: the engine
  allocates the latent cache rounded up to its key block).

  Args:
    cfg: the model.
    length: tokens per row (prompt and generated).
    batch: rows.
    mla_everywhere: the size for a model of the same shape with MLA in every layer (the
      comparison of docs/inference.md).

  Returns:
    int bytes: KDA layers (W-1)(2HK + HV) values in cfg.dtype plus H K V fp32, independent of
    length; MLA layers length x (kv_lora_rank + qk_rope_head_dim) values in cfg.dtype.

  Raises:
    TypeError: cfg is not a ModelConfig (a preset name: `config.get_preset(name)`).
    ValueError: length < 0 or batch < 1, or either is not an int (named).
  """
  if not isinstance(cfg, ModelConfig):
    raise TypeError(f"cache_bytes: cfg must be a ModelConfig, got {cfg!r} (for a preset "
                    "name: sparse_lm.config.get_preset(name))")
  for name, value, low in (("length", length, 0), ("batch", batch, 1)):
    if (not isinstance(value, (int, np.integer)) or isinstance(value, bool)
        or value < low):
      raise ValueError(f"cache_bytes: {name}={value!r} must be an int >= {low}")
  item = jnp.dtype(cfg.dtype).itemsize
  H, K, V, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_value_dim, cfg.kda_conv_size
  kda = (W - 1) * (2 * H * K + H * V) * item + H * K * V * 4
  mla = length * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * item
  if mla_everywhere:
    return batch * cfg.num_layers * mla
  return batch * (cfg.num_kda_layers * kda + cfg.num_mla_layers * mla)
