"""Which Hugging Face tensor(s) fill which sparse_lm parameter, and how (HF_FORMATS.md).

`sources(cfg, layout, abstract_state)` returns one `Source` per model variable that a
checkpoint holds. A Source names the HF tensor(s) for each index of its leading stacked axes
(the scanned layer groups' `layers` axis and the routed experts' axis, both enumerated by HF
as separate tensors) and converts one HF block to our block and back:

  linear    HF `nn.Linear.weight` [out, in] <-> our kernel [*in, *out] (transpose + reshape)
  conv      HF depthwise Conv1d [H*d, 1, W] <-> our [W, H, d]
  reshape   same values, another shape (A_log [1,1,H,1] or [H] <-> [H]; norms; biases)
  query     AttnRes pseudo-query: ours = HF norm.weight [D] * proj.weight[0] [1, D]; exported
            as norm = 1, proj = query (the fold of HF_FORMATS.md)

Layer i of the HF list sits in our `head` group (i < mla_every), in the stacked `groups`
(index i // mla_every - 1, position i % mla_every), in `tail` (the KDA layers after the last
whole group, when there are any) or is `last` (i = num_layers - 1).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from sparse_lm.config import ModelConfig

K3_PREFIX = "language_model."


@dataclasses.dataclass(frozen=True)
class Source:
  """How one model variable is read from / written to HF tensors.

  path: the variable's path in the model's flat nnx state.
  lead: sizes of the leading axes whose every index is a separate HF tensor (() if none).
  names: leading index tuple -> the HF tensor names (one, or two for "query").
  kind: "linear" | "conv" | "reshape" | "query".
  n_in: for "linear", how many leading block axes are the input (2 for W_o [H, V, D]).
  hf_shape: for "reshape", the HF shape (None = the block's shape).
  """
  path: tuple
  lead: tuple[int, ...]
  names: Callable[[tuple[int, ...]], tuple[str, ...]]
  kind: str
  n_in: int = 1
  hf_shape: tuple[int, ...] | None = None

  def hf_shapes(self, block: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The HF tensor shapes that hold one block of our shape `block`."""
    if self.kind == "linear":
      return ((math.prod(block[self.n_in:]), math.prod(block[:self.n_in])),)
    if self.kind == "conv":
      return ((math.prod(block[1:]), 1, block[0]),)
    if self.kind == "query":
      return (tuple(block), (1,) + tuple(block))
    return (tuple(self.hf_shape or block),)

  def to_ours(self, arrays: list[np.ndarray], block: tuple[int, ...]) -> np.ndarray:
    """HF tensors -> our block (numpy, HF dtype; the query fold in fp32)."""
    a = arrays[0]
    if self.kind == "linear":
      return a.T.reshape(block)
    if self.kind == "conv":
      return a[:, 0, :].T.reshape(block)
    if self.kind == "query":
      return (a.astype(np.float32) * arrays[1][0].astype(np.float32)).reshape(block)
    return a.reshape(block)

  def to_hf(self, b: np.ndarray) -> list[np.ndarray]:
    """Our block -> the HF tensors (contiguous)."""
    if self.kind == "linear":
      return [np.ascontiguousarray(b.reshape(math.prod(b.shape[:self.n_in]), -1).T)]
    if self.kind == "conv":
      return [np.ascontiguousarray(b.reshape(b.shape[0], -1).T[:, None, :])]
    if self.kind == "query":
      return [np.ones(b.shape, b.dtype), np.ascontiguousarray(b[None])]
    return [np.ascontiguousarray(b.reshape(self.hf_shape or b.shape))]


def _layer_table(cfg: ModelConfig, layout: str, mixer: str, dense: bool) -> list[tuple]:
  """(relative path, HF suffix (with {e} for experts), kind, n_in, hf_shape, expert?) rows."""
  rows = [(("attn_norm", "scale"), "input_layernorm.weight", "reshape"),
          (("ffn_norm", "scale"), "post_attention_layernorm.weight", "reshape")]
  if cfg.residual == "attnres_block":
    rows += [(("attn_query",), "self_attention_res_{}.weight", "query"),
             (("ffn_query",), "mlp_res_{}.weight", "query")]
  a = "self_attn."
  if mixer == "kda":
    H = cfg.kda_num_heads
    rows += [(("mixer", f"w_{x}"), f"{a}{x}_proj.weight", "linear") for x in "qkv"]
    rows += [(("mixer", f"conv_{x}"), f"{a}{x}_conv1d.weight", "conv") for x in "qkv"]
    rows += [(("mixer", "w_g_down"), a + "f_a_proj.weight", "linear"),
             (("mixer", "w_g_up"), a + "f_b_proj.weight", "linear"),
             (("mixer", "A_log"), a + "A_log", "reshape", 1,
              (1, 1, H, 1) if layout == "kimi_linear" else (H,)),
             (("mixer", "dt_bias"), a + "dt_bias", "reshape"),
             (("mixer", "w_beta"), a + "b_proj.weight", "linear")]
    if cfg.kda_output_gate_rank:
      rows += [(("mixer", "w_og_down"), a + "g_a_proj.weight", "linear"),
               (("mixer", "w_og_up"), a + "g_b_proj.weight", "linear")]
    else:
      rows += [(("mixer", "w_og"), a + "g_proj.weight", "linear")]
    rows += [(("mixer", "o_norm"), a + "o_norm.weight", "reshape"),
             (("mixer", "w_o"), a + "o_proj.weight", "linear", 2)]
  else:
    if cfg.q_lora_rank:
      rows += [(("mixer", "w_dq"), a + "q_a_proj.weight", "linear"),
               (("mixer", "q_norm", "scale"), a + "q_a_layernorm.weight", "reshape"),
               (("mixer", "w_uq"), a + "q_b_proj.weight", "linear")]
    else:
      rows += [(("mixer", "w_q"), a + "q_proj.weight", "linear")]
    rows += [(("mixer", "w_dkv"), a + "kv_a_proj_with_mqa.weight", "linear"),
             (("mixer", "kv_norm", "scale"), a + "kv_a_layernorm.weight", "reshape"),
             (("mixer", "w_ukv"), a + "kv_b_proj.weight", "linear")]
    if cfg.mla_output_gate:
      rows += [(("mixer", "w_gate"), a + "g_proj.weight", "linear")]
    rows += [(("mixer", "w_o"), a + "o_proj.weight", "linear", 2)]
  if dense:
    rows += [(("ffn", f"w_{x}"), f"mlp.{x}_proj.weight", "linear") for x in ("gate", "up", "down")]
    return rows
  m = "block_sparse_moe."
  rows += [(("ffn", "router"), m + "gate.weight", "linear"),
           (("ffn", "balancer_bias"), m + "gate.e_score_correction_bias", "reshape"),
           (("ffn", "expert_gate"), m + "experts.{e}.w1.weight", "linear", 1, None, True),
           (("ffn", "expert_up"), m + "experts.{e}.w3.weight", "linear", 1, None, True),
           (("ffn", "expert_down"), m + "experts.{e}.w2.weight", "linear", 1, None, True)]
  if cfg.moe_latent:
    rows += [(("ffn", "w_down"), m + "routed_expert_down_proj.weight", "linear"),
             (("ffn", "latent_norm"), m + "routed_expert_norm.weight", "reshape"),
             (("ffn", "w_up"), m + "routed_expert_up_proj.weight", "linear")]
  if cfg.num_shared_experts:
    rows += [(("ffn", "shared", f"w_{x}"), f"{m}shared_experts.{x}_proj.weight", "linear")
             for x in ("gate", "up", "down")]
  return rows


def _names_fn(prefix: str, layer_of: Callable, suffix: str, expert: bool, kind: str):
  def names(idx):
    i = layer_of(idx)
    e = idx[-1] if expert else None
    s = suffix.format(e=e) if expert else suffix
    base = f"{prefix}model.layers.{i}."
    if kind == "query":
      return (base + s.format("norm"), base + s.format("proj"))
    return (base + s,)
  return names


def sources(cfg: ModelConfig, layout: str) -> list[Source]:
  """Every Source of a Transformer(cfg) in `layout` ("kimi_linear" or "kimi_k3")."""
  p = K3_PREFIX if layout == "kimi_k3" else ""
  m, n = cfg.mla_every, cfg.num_layers
  num_groups = (n - 1) // m
  types = cfg.layer_types
  slots = [(("head", "layers", j), (), (lambda idx, j=j: j)) for j in range(m)]
  if num_groups > 1:
    slots += [(("groups", "layers", j), (num_groups - 1,),
               (lambda idx, j=j: (idx[0] + 1) * m + j)) for j in range(m)]
  slots += [(("tail", j), (), (lambda idx, j=j: num_groups * m + j))
            for j in range(n - 1 - num_groups * m)]
  slots.append((("last",), (), (lambda idx: n - 1)))
  out = []
  for prefix, lead, layer_of in slots:
    i = layer_of((0,) * len(lead))
    for row in _layer_table(cfg, layout, types[i], i < cfg.num_dense_layers):
      rel, suffix, kind = row[:3]
      n_in = row[3] if len(row) > 3 else 1
      hf_shape = row[4] if len(row) > 4 else None
      expert = len(row) > 5 and row[5]
      out.append(Source(prefix + rel, lead + ((cfg.num_experts,) if expert else ()),
                        _names_fn(p, layer_of, suffix, expert, kind), kind, n_in, hf_shape))
  glob = [(("embed", "embedding"), "model.embed_tokens.weight", "reshape"),
          (("final_norm", "scale"), "model.norm.weight", "reshape"),
          (("lm_head",), "lm_head.weight", "linear")]
  for path, name, kind in glob:
    out.append(Source(path, (), (lambda idx, nm=p + name: (nm,)), kind))
  if cfg.residual == "attnres_block":
    out.append(Source(("final_query",), (),
                      lambda idx: (p + "model.output_attn_res_norm.weight",
                                   p + "model.output_attn_res_proj.weight"), "query"))
  return out
