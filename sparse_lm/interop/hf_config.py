"""config.json of a Hugging Face Kimi-Linear / Kimi-K3 checkpoint <-> ModelConfig.

Two layouts (HF_FORMATS.md):
  "kimi_linear"  model_type kimi_linear at the top level (Kimi-Linear-48B-A3B and what
                 transformers' KimiLinearForCausalLM.save_pretrained writes);
  "kimi_k3"      a composite config whose `text_config` is the text model (model_type
                 kimi_linear with AttnRes, SiTU, latent MoE, q-LoRA, gated MLA) and whose text
                 tensors carry the `language_model.` prefix.

Both spellings of each key are read: the checkpoint's own (`num_experts`,
`linear_attn_config`, `first_k_dense_replace`, ...) and transformers' (`num_local_experts`,
`layer_types`, `mlp_layer_types`, `linear_head_dim`, ...). A key whose value our model cannot
reproduce, and any key we do not know, raises ValueError naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

from sparse_lm.config import ModelConfig

LAYOUTS = ("kimi_linear", "kimi_k3")
# What the HF side fixes (no config key): the KDA q/k L2-norm eps (inside the square root, as
# the reference's kernels) and the eps of transformers' Kimi-Linear MLA latent norms.
HF_L2_NORM_EPS = 1e-6
HF_MLA_NORM_EPS = 1e-6
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")

# Keys that do not change the text model's math.
_IGNORED = {
    "architectures", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id", "dtype",
    "torch_dtype", "transformers_version", "use_cache", "initializer_range", "model_type",
    "max_position_embeddings", "model_max_length", "attention_dropout", "output_router_logits",
    "pretraining_tp", "head_dim", "qk_head_dim", "rope_theta", "rope_scaling", "tokenizer_class",
    "_name_or_path", "keys_to_ignore_at_inference", "quantization_config", "mla_use_nope",
    "num_key_value_heads", "attention_bias", "tie_word_embeddings", "moe_renormalize",
    "norm_topk_prob", "hidden_act", "moe_router_activation_func", "topk_method", "topk_group",
    "num_expert_group", "n_group", "moe_layer_freq", "num_nextn_predict_layers",
    "latent_moe_use_norm", "layer_types", "mlp_layer_types", "linear_attn_config",
    "first_k_dense_replace", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim",
    "activation_situ_beta", "activation_situ_linear_beta", "routed_expert_hidden_size",
    "attn_res_block_size", "mla_use_output_gate", "generation_config", "q_lora_rank",
    "num_experts", "num_experts_per_token", "num_shared_experts",
}
_ALIASES = {  # our reading name -> other spellings
    "num_experts": ("num_local_experts",), "num_experts_per_token": ("num_experts_per_tok",),
    "num_shared_experts": ("n_shared_experts",), "num_expert_group": ("n_group",),
    "moe_renormalize": ("norm_topk_prob",),
}
_DIRECT = {  # HF key -> ModelConfig field
    "vocab_size": "vocab_size", "hidden_size": "d_model", "num_hidden_layers": "num_layers",
    "num_attention_heads": "mla_num_heads", "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim", "intermediate_size": "dense_hidden",
    "moe_intermediate_size": "expert_hidden", "rms_norm_eps": "norm_eps",
    "routed_scaling_factor": "route_scale",
}


def read_config_json(hf_dir: str | os.PathLike) -> dict[str, Any]:
  """The parsed config.json of HF checkpoint directory `hf_dir`.

  Raises:
    FileNotFoundError: no config.json.
    ValueError: it is not valid JSON or not a JSON object, naming the file (json's message
      alone, "Expecting property name enclosed in double quotes: line 1 column 2", did not).
  """
  path = pathlib.Path(hf_dir) / "config.json"
  try:
    raw = json.loads(path.read_text(encoding="utf-8"))
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
    raise ValueError(f"{path}: not valid JSON: {e}") from None
  if not isinstance(raw, dict):
    raise ValueError(f"{path}: not a JSON object (a model config is {{\"key\": value, ...}})")
  return raw


def _get(c: dict, key: str, default=None):
  for k in (key, *_ALIASES.get(key, ())):
    if k in c:
      return c[k]
  return default


def _refuse(key: str, value, why: str):
  raise ValueError(f"config.json: {key}={value!r} cannot be imported: {why}")


def _layer_types(c: dict, n: int) -> list[str]:
  """'kda' / 'mla' per layer from layer_types or linear_attn_config (1-based lists)."""
  if c.get("layer_types"):
    lt = c["layer_types"]
    if len(lt) != n:
      _refuse("layer_types", lt, f"has {len(lt)} entries for num_hidden_layers={n}")
    return ["kda" if t == "linear_attention" else "mla" for t in lt]
  lac = c.get("linear_attn_config") or {}
  if "full_attn_layers" not in lac:
    _refuse("linear_attn_config", lac, "needs full_attn_layers (or give layer_types)")
  full = set(lac["full_attn_layers"])
  kda = set(lac.get("kda_layers", set(range(1, n + 1)) - full))
  if full & kda or (full | kda) != set(range(1, n + 1)):
    _refuse("linear_attn_config.full_attn_layers", sorted(full),
            "full_attn_layers and kda_layers must partition layers 1..num_hidden_layers")
  return ["mla" if i + 1 in full else "kda" for i in range(n)]


def _mla_every(types: list[str]) -> int:
  """The ModelConfig.mla_every that reproduces `types`, or raise naming the layer list."""
  m = types.index("mla") + 1 if "mla" in types else 0
  rule = ["mla" if m and ((i + 1) % m == 0 or i == len(types) - 1) else "kda"
          for i in range(len(types))]
  if not m or rule != types:
    _refuse("linear_attn_config.full_attn_layers",
            [i + 1 for i, t in enumerate(types) if t == "mla"],
            "sparse_lm places MLA at every mla_every-th layer and the last layer")
  return m


# ModelConfig fields that config_from_hf sets from config.json.
MAPPED_FIELDS = frozenset(set(_DIRECT.values()) | {
    "mla_every", "num_dense_layers", "kda_num_heads", "kda_head_dim", "kda_value_dim",
    "kda_conv_size", "kda_gate_lower_bound", "kda_output_gate_rank", "q_lora_rank",
    "mla_output_gate", "mla_norm_eps", "num_experts", "experts_per_token", "num_shared_experts",
    "shared_expert_hidden", "moe_latent", "moe_latent_dim", "ffn_activation", "situ_beta1",
    "situ_beta2", "residual", "attnres_block_layers", "dtype", "param_dtype"})


def config_from_hf(raw: dict[str, Any], *, dtype: str | None = None,
                   ignore_keys: tuple[str, ...] = ()) -> tuple[ModelConfig, str]:
  """Map a config.json dict to (ModelConfig, layout).

  Args:
    raw: the parsed config.json (top level; a composite K3 config nests `text_config`).
    dtype: "float32" / "bfloat16" for both compute and parameter dtype; None reads the
      config's `dtype` / `torch_dtype` (float32 unless it says bfloat16).
    ignore_keys: unknown keys to accept without mapping (you assert they do not matter).

  Raises:
    ValueError: naming the key, for an unknown key or a value sparse_lm cannot reproduce
      (e.g. num_expert_group > 1, tie_word_embeddings true, a non-sigmoid router).
  """
  layout = "kimi_k3" if "text_config" in raw else "kimi_linear"
  c = raw["text_config"] if layout == "kimi_k3" else raw
  unknown = sorted(set(c) - _IGNORED - set(_DIRECT) - set(ignore_keys)
                   - {a for al in _ALIASES.values() for a in al} - set(_ALIASES))
  if unknown:
    raise ValueError(f"config.json: unknown key(s) {unknown}: sparse_lm does not know what they "
                     f"do; if they do not change the model, pass ignore_keys={tuple(unknown)!r} "
                     f"(the import CLI: --ignore-keys {','.join(unknown)})")
  for key, ok in (("num_expert_group", 1), ("topk_group", 1), ("moe_layer_freq", 1),
                  ("num_nextn_predict_layers", 0)):
    v = _get(c, key, ok)
    if v not in (ok, None):
      _refuse(key, v, f"only {ok} is supported (no grouped routing / MTP / interleaved MoE)")
  checks = [("moe_router_activation_func", "sigmoid", "the router is sigmoid"),
            ("topk_method", "noaux_tc", "top-k on score + e_score_correction_bias"),
            ("moe_renormalize", True, "gates are renormalised over the top-k"),
            ("tie_word_embeddings", False, "the LM head is untied"),
            ("attention_bias", False, "projections have no bias"),
            ("mla_use_nope", True, "MLA has no rotary embedding")]
  for key, ok, why in checks:
    v = _get(c, key, ok)
    if v != ok:
      _refuse(key, v, f"sparse_lm requires {ok!r} ({why})")
  if _get(c, "num_key_value_heads", c["num_attention_heads"]) != c["num_attention_heads"]:
    _refuse("num_key_value_heads", c["num_key_value_heads"], "must equal num_attention_heads")
  act = c.get("hidden_act", "silu")
  if act not in ("silu", "situ"):
    _refuse("hidden_act", act, "use silu (SwiGLU) or situ (SiTU-GLU)")

  f: dict[str, Any] = {ours: c[k] for k, ours in _DIRECT.items() if k in c}
  n = c["num_hidden_layers"]
  types = _layer_types(c, n)
  f["mla_every"] = _mla_every(types)
  mlp = c.get("mlp_layer_types")
  if mlp:
    dense = next((i for i, t in enumerate(mlp) if t != "dense"), len(mlp))
    if any(t != "sparse" for t in mlp[dense:]):
      _refuse("mlp_layer_types", mlp, "dense layers must come first")
  else:
    dense = c.get("first_k_dense_replace", 1)
  f["num_dense_layers"] = dense
  lac = c.get("linear_attn_config") or {}
  f["kda_num_heads"] = lac.get("num_heads", c.get("linear_num_heads", 32))
  f["kda_head_dim"] = f["kda_value_dim"] = lac.get("head_dim", c.get("linear_head_dim", 128))
  f["kda_conv_size"] = lac.get("short_conv_kernel_size", c.get("linear_conv_kernel_dim", 4))
  f["kda_gate_lower_bound"] = lac.get("gate_lower_bound")
  f["kda_output_gate_rank"] = 0 if lac.get("use_full_rank_gate") else f["kda_head_dim"]
  f["q_lora_rank"] = c.get("q_lora_rank") or 0
  f["mla_output_gate"] = bool(c.get("mla_use_output_gate", False))
  f["mla_norm_eps"] = HF_MLA_NORM_EPS if layout == "kimi_linear" else None  # transformers' eps
  f["num_experts"] = _get(c, "num_experts")
  f["experts_per_token"] = _get(c, "num_experts_per_token")
  f["num_shared_experts"] = _get(c, "num_shared_experts", 0)
  f["shared_expert_hidden"] = c["moe_intermediate_size"]
  latent = c.get("routed_expert_hidden_size")
  if latent and not c.get("latent_moe_use_norm", True):
    _refuse("latent_moe_use_norm", False, "the latent MoE always normalises its output")
  f["moe_latent"] = bool(latent)
  f["moe_latent_dim"] = latent or c["hidden_size"]
  if act == "situ":
    f["ffn_activation"] = "situ"
    f["situ_beta1"] = c.get("activation_situ_beta", 4.0)
    f["situ_beta2"] = c.get("activation_situ_linear_beta", 25.0)
  else:
    f["ffn_activation"] = "swiglu"
  block = c.get("attn_res_block_size")
  f["residual"] = "attnres_block" if block else "standard"
  if block:
    f["attnres_block_layers"] = block
  if dtype is None:
    dtype = "bfloat16" if str(c.get("dtype") or c.get("torch_dtype")) == "bfloat16" else "float32"
  f["dtype"] = f["param_dtype"] = dtype
  return ModelConfig(name=layout, **f), layout


def kimi_linear_cannot_express(cfg: ModelConfig) -> list[str]:
  """The fields of `cfg` that transformers' KimiLinearForCausalLM has no module for (the
  Kimi-K3 features of the presets); empty when the `kimi_linear` layout can hold cfg."""
  out = []
  if cfg.ffn_activation != "swiglu":
    out.append(f"ffn_activation={cfg.ffn_activation!r} (Kimi-Linear: swiglu)")
  if cfg.moe_latent:
    out.append("moe_latent=True (Kimi-Linear: experts on the full width)")
  if cfg.mla_output_gate:
    out.append("mla_output_gate=True (Kimi-Linear: no MLA output gate)")
  if cfg.residual != "standard":
    out.append(f"residual={cfg.residual!r} (Kimi-Linear: the plain residual stream)")
  return out


def default_layout(cfg: ModelConfig) -> str:
  """`kimi_linear` when transformers' KimiLinearForCausalLM can hold cfg, else `kimi_k3`."""
  return "kimi_k3" if kimi_linear_cannot_express(cfg) else "kimi_linear"


def config_to_hf(cfg: ModelConfig, layout: str, *, quantized: bool = False,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
  """The config.json for `cfg` in `layout` (the inverse of `config_from_hf`).

  `extra` keys (e.g. `token_ids(raw)` of the imported config: bos/eos/pad ids) are added to
  the text config; token ids default to None (transformers then uses no padding index).

  Raises:
    ValueError: unknown layout, `quantized` with a layout other than kimi_k3 or with expert
      input dims that are not multiples of 32, or a cfg the layout cannot express (named
      field), including eps values that `config_from_hf` would not give back (l2_norm_eps,
      mla_norm_eps): an export never changes the model's math silently.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")
  if quantized and layout != "kimi_k3":
    raise ValueError("quantize_experts=True needs layout='kimi_k3' (Kimi-Linear is bf16)")
  if layout == "kimi_linear" and kimi_linear_cannot_express(cfg):
    raise ValueError("layout='kimi_linear' (transformers' KimiLinearForCausalLM) cannot hold "
                     f"{'; '.join(kimi_linear_cannot_express(cfg))}: use layout='kimi_k3'")
  if cfg.kda_output_gate_rank not in (0, cfg.kda_head_dim):
    raise ValueError(f"kda_output_gate_rank={cfg.kda_output_gate_rank}: HF stores the low-rank "
                     f"gate with rank = head_dim ({cfg.kda_head_dim}) or full rank (0)")
  if cfg.kda_head_dim != cfg.kda_value_dim:
    raise ValueError("kda_head_dim != kda_value_dim has no HF spelling (one head_dim)")
  if cfg.shared_expert_hidden != cfg.expert_hidden and cfg.num_shared_experts:
    raise ValueError("shared_expert_hidden must equal expert_hidden (HF: moe_intermediate_size)")
  if cfg.l2_norm_eps != HF_L2_NORM_EPS:
    raise ValueError(f"l2_norm_eps={cfg.l2_norm_eps} has no HF spelling: Kimi-Linear / K3 fix "
                     f"the KDA q/k L2-norm eps at {HF_L2_NORM_EPS} (import would give "
                     f"{HF_L2_NORM_EPS} back): set l2_norm_eps={HF_L2_NORM_EPS}")
  mla_eps = cfg.norm_eps if cfg.mla_norm_eps is None else cfg.mla_norm_eps
  want = HF_MLA_NORM_EPS if layout == "kimi_linear" else cfg.norm_eps
  if mla_eps != want:
    where = ("transformers' KimiLinearForCausalLM builds q_a_layernorm / kv_a_layernorm with "
             f"eps {HF_MLA_NORM_EPS}" if layout == "kimi_linear" else
             f"the kimi_k3 config has one rms_norm_eps (norm_eps={cfg.norm_eps}) for every norm")
    raise ValueError(f"mla_norm_eps={cfg.mla_norm_eps} (MLA latent norms at eps {mla_eps}) has "
                     f"no spelling in layout={layout!r}: {where}; import would give eps {want} "
                     f"back (set mla_norm_eps={want}"
                     + (", or use layout='kimi_linear'" if layout == "kimi_k3"
                        and mla_eps == HF_MLA_NORM_EPS and not kimi_linear_cannot_express(cfg)
                        else "") + ")")
  if quantized:
    width = "moe_latent_dim" if cfg.moe_latent else "d_model"  # w1 / w3 input; w2: hidden
    ins = {width: getattr(cfg, width), "expert_hidden": cfg.expert_hidden}
    bad = {k: v for k, v in ins.items() if v % 32}
    if bad:
      raise ValueError(f"quantize_experts=True: MXFP4 packs the routed experts' input columns in "
                       f"blocks of 32, and {', '.join(f'{k}={v}' for k, v in bad.items())} "
                       "is not a multiple of 32 (export without quantize_experts / --quantize)")
  types = cfg.layer_types
  full = [i + 1 for i, t in enumerate(types) if t == "mla"]
  lac = {"full_attn_layers": full, "kda_layers": [i + 1 for i, t in enumerate(types) if t == "kda"],
         "num_heads": cfg.kda_num_heads, "head_dim": cfg.kda_head_dim,
         "short_conv_kernel_size": cfg.kda_conv_size}
  if cfg.kda_gate_lower_bound is not None:
    lac["gate_lower_bound"] = cfg.kda_gate_lower_bound
  if cfg.kda_output_gate_rank == 0:
    lac["use_full_rank_gate"] = True
  c: dict[str, Any] = {hf: getattr(cfg, ours) for hf, ours in _DIRECT.items()}
  c.update(
      model_type="kimi_linear", num_key_value_heads=cfg.mla_num_heads,
      q_lora_rank=cfg.q_lora_rank or None, num_experts=cfg.num_experts,
      num_experts_per_token=cfg.experts_per_token, num_shared_experts=cfg.num_shared_experts,
      num_expert_group=1, topk_group=1, moe_renormalize=True, moe_router_activation_func="sigmoid",
      first_k_dense_replace=cfg.num_dense_layers, tie_word_embeddings=False,
      attention_bias=False, mla_use_nope=True, linear_attn_config=lac,
      layer_types=["linear_attention" if t == "kda" else "full_attention" for t in types],
      mlp_layer_types=["dense" if i < cfg.num_dense_layers else "sparse"
                       for i in range(cfg.num_layers)],
      linear_head_dim=cfg.kda_head_dim, linear_num_heads=cfg.kda_num_heads,
      linear_conv_kernel_dim=cfg.kda_conv_size, dtype=cfg.param_dtype,
      hidden_act="situ" if cfg.ffn_activation == "situ" else "silu")
  if cfg.ffn_activation == "situ":
    c.update(activation_situ_beta=cfg.situ_beta1, activation_situ_linear_beta=cfg.situ_beta2)
  if cfg.mla_output_gate:
    c["mla_use_output_gate"] = True
  if cfg.moe_latent:
    c.update(routed_expert_hidden_size=cfg.moe_latent_dim, latent_moe_use_norm=True)
  if cfg.residual == "attnres_block":
    c["attn_res_block_size"] = cfg.attnres_block_layers
  elif cfg.residual != "standard":
    raise ValueError(f"residual={cfg.residual!r} has no HF spelling (attnres_block or standard)")
  c.update({k: None for k in TOKEN_KEYS})
  c.update(extra or {})
  if layout == "kimi_linear":
    c["architectures"] = ["KimiLinearForCausalLM"]
    return c
  c["topk_method"] = "noaux_tc"
  out = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
         "text_config": c}
  if quantized:
    out["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {"format": "mxfp4-pack-quantized",
                                      "weights": {"num_bits": 4, "group_size": 32},
                                      "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"]}}}
  return out


def token_ids(raw: dict[str, Any]) -> dict[str, Any]:
  """The bos / eos / pad token ids of a config.json (text config for K3), for `extra`."""
  c = raw.get("text_config", raw)
  return {k: c[k] for k in TOKEN_KEYS if k in c}


def mapped_fields(cfg: ModelConfig) -> dict[str, Any]:
  """The ModelConfig fields a config.json determines (for round-trip checks)."""
  skip = {"name"}
  return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in skip}
