"""Write a tiny synthetic Kimi-K3 checkpoint (kimi_k3_tiny/) from the public config keys.

No reference implementation of K3 is installed anywhere here, so this checkpoint tests the
*naming* only: the composite config (text_config, quantization_config), the `language_model.`
prefix, the AttnRes norm/proj pairs, the full-rank KDA gate `g_proj`, A_log [H], q-LoRA MLA
with output gate, the latent MoE projections, MXFP4 routed experts (weight_packed /
weight_scale) and a vision tensor the text import skips. Names and shapes are written here
from HF_FORMATS.md, independently of sparse_lm.interop. Random values, seed 0:

    python tests/data/hf/make_k3_synthetic.py tests/data/hf/kimi_k3_tiny
"""

import json
import os
import sys

import numpy as np
from safetensors.numpy import save_file

D, V, N, H, K, E, LAT, F, DENSE = 32, 64, 5, 2, 16, 4, 32, 32, 64
QL, KVL, NOPE, ROPE, VH = 32, 16, 16, 8, 16
FULL = [2, 4, 5]  # 1-based MLA layers


def config():
  text = {
      "model_type": "kimi_linear", "vocab_size": V, "hidden_size": D, "num_hidden_layers": N,
      "num_attention_heads": H, "num_key_value_heads": H, "intermediate_size": DENSE,
      "moe_intermediate_size": F, "num_experts": E, "num_experts_per_token": 2,
      "num_shared_experts": 1, "first_k_dense_replace": 1, "routed_expert_hidden_size": LAT,
      "latent_moe_use_norm": True, "hidden_act": "situ", "activation_situ_beta": 4.0,
      "activation_situ_linear_beta": 25.0, "topk_method": "noaux_tc",
      "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
      "routed_scaling_factor": 1.0, "num_expert_group": 1, "topk_group": 1,
      "q_lora_rank": QL, "kv_lora_rank": KVL, "qk_nope_head_dim": NOPE,
      "qk_rope_head_dim": ROPE, "v_head_dim": VH, "mla_use_nope": True,
      "mla_use_output_gate": True, "attn_res_block_size": 2, "rms_norm_eps": 1e-5,
      "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
      "torch_dtype": "float32",
      "linear_attn_config": {"num_heads": H, "head_dim": K, "short_conv_kernel_size": 4,
                             "use_full_rank_gate": True, "gate_lower_bound": -5.0,
                             "full_attn_layers": FULL,
                             "kda_layers": [i for i in range(1, N + 1) if i not in FULL]}}
  return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
          "text_config": text,
          "quantization_config": {"quant_method": "compressed-tensors",
                                  "format": "mxfp4-pack-quantized",
                                  "config_groups": {"group_0": {
                                      "format": "mxfp4-pack-quantized",
                                      "weights": {"num_bits": 4, "group_size": 32}}}}}


def tensors(rng):
  t = {}
  w = lambda *s: (0.1 * rng.standard_normal(s)).astype(np.float32)
  one = lambda *s: (1.0 + 0.2 * rng.standard_normal(s)).astype(np.float32)
  p = "language_model.model."
  t["language_model.lm_head.weight"] = w(V, D)
  t[p + "embed_tokens.weight"] = w(V, D)
  t[p + "norm.weight"] = one(D)
  t[p + "output_attn_res_norm.weight"] = one(D)
  t[p + "output_attn_res_proj.weight"] = w(1, D)
  for i in range(N):
    q = f"{p}layers.{i}."
    for site in ("self_attention_res", "mlp_res"):
      t[q + site + "_norm.weight"] = one(D)
      t[q + site + "_proj.weight"] = w(1, D)
    t[q + "input_layernorm.weight"] = one(D)
    t[q + "post_attention_layernorm.weight"] = one(D)
    a = q + "self_attn."
    if i + 1 in FULL:
      t[a + "q_a_proj.weight"] = w(QL, D)
      t[a + "q_a_layernorm.weight"] = one(QL)
      t[a + "q_b_proj.weight"] = w(H * (NOPE + ROPE), QL)
      t[a + "kv_a_proj_with_mqa.weight"] = w(KVL + ROPE, D)
      t[a + "kv_a_layernorm.weight"] = one(KVL)
      t[a + "kv_b_proj.weight"] = w(H * (NOPE + VH), KVL)
      t[a + "g_proj.weight"] = w(H * VH, D)
      t[a + "o_proj.weight"] = w(D, H * VH)
    else:
      for x in "qkv":
        t[a + f"{x}_proj.weight"] = w(H * K, D)
        t[a + f"{x}_conv1d.weight"] = w(H * K, 1, 4)
      t[a + "f_a_proj.weight"] = w(K, D)
      t[a + "f_b_proj.weight"] = w(H * K, K)
      t[a + "A_log"] = w(H)
      t[a + "dt_bias"] = w(H * K)
      t[a + "b_proj.weight"] = w(H, D)
      t[a + "g_proj.weight"] = w(H * K, D)
      t[a + "o_norm.weight"] = one(K)
      t[a + "o_proj.weight"] = w(D, H * K)
    if i == 0:
      t[q + "mlp.gate_proj.weight"] = w(DENSE, D)
      t[q + "mlp.up_proj.weight"] = w(DENSE, D)
      t[q + "mlp.down_proj.weight"] = w(D, DENSE)
      continue
    m = q + "block_sparse_moe."
    t[m + "gate.weight"] = w(E, D)
    t[m + "gate.e_score_correction_bias"] = w(E)
    t[m + "routed_expert_down_proj.weight"] = w(LAT, D)
    t[m + "routed_expert_norm.weight"] = one(LAT)
    t[m + "routed_expert_up_proj.weight"] = w(D, LAT)
    for e in range(E):
      for name, (o, n) in (("w1", (F, LAT)), ("w3", (F, LAT)), ("w2", (LAT, F))):
        t[m + f"experts.{e}.{name}.weight_packed"] = rng.integers(0, 256, (o, n // 2), np.uint8)
        t[m + f"experts.{e}.{name}.weight_scale"] = rng.integers(118, 126, (o, n // 32), np.uint8)
    for x, (o, n) in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
      t[m + f"shared_experts.{x}_proj.weight"] = w(o, n)
  t["vision_tower.patch_embed.weight"] = w(4, 4)
  return t


def main(out):
  os.makedirs(out, exist_ok=True)
  t = tensors(np.random.default_rng(0))
  names = sorted(t)
  half = len(names) // 2
  shards = {"model-00001-of-00002.safetensors": names[:half],
            "model-00002-of-00002.safetensors": names[half:]}
  for fn, ns in shards.items():
    save_file({n: t[n] for n in ns}, os.path.join(out, fn), metadata={"format": "pt"})
  index = {"metadata": {"total_size": sum(v.nbytes for v in t.values())},
           "weight_map": {n: fn for fn, ns in shards.items() for n in ns}}
  with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
    json.dump(index, f, indent=2)
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(config(), f, indent=2)


if __name__ == "__main__":
  main(sys.argv[1])
