"""Write the tiny Kimi-Linear fixture with transformers' own KimiLinearForCausalLM (run once).

Needs torch and transformers >= 5.23 (the version that has `models/kimi_linear`); run where
they are installed (the GPU machine's image, with a transformers wheel carried):

    python make_kimi_linear_fixture.py --out DIR            # write DIR/kimi_linear_tiny + reference
    python make_kimi_linear_fixture.py --out DIR --variant tail   # kimi_linear_tail (7 layers)
    python make_kimi_linear_fixture.py --check EXPORTED --reference DIR/kimi_linear_tiny_reference.npz

The model is fp32 on the CPU (no TF32, eager attention, transformers' pure-torch KDA fallback):
5 layers (1-based full_attn_layers [2, 4, 5], kda_layers [1, 3]), layer 1 dense
(first_k_dense_replace 1), 8 routed experts (top 2) and 1 shared expert. Norm weights and the
router's e_score_correction_bias are randomised so that their mapping is tested too. The
reference holds random token ids [2, 40], transformers' logits [2, 40, 256] and a greedy
`generate` continuation (for the inference engine's test).

--variant tail: the 48B's layer pattern in miniature, 7 layers with 1-based full_attn_layers
[4, 7] (KDA x3, MLA, KDA x2, MLA: two KDA layers after the last whole group), narrower
(hidden 32, vocab 128, 4 experts) to keep the files small.
"""

import argparse
import json
import os

import numpy as np
import torch
import transformers
from transformers import KimiLinearConfig, KimiLinearForCausalLM

SEED = 1234


# What the two fixtures share: MLA without q-LoRA, one shared expert, top-2 of the routed ones.
COMMON = dict(
    moe_intermediate_size=16, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
    routed_scaling_factor=2.446, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
    v_head_dim=16, qk_nope_head_dim=16, n_group=1, topk_group=1, num_experts_per_tok=2,
    norm_topk_prob=True, hidden_act="silu", initializer_range=0.1, rms_norm_eps=1e-5,
    tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    linear_head_dim=16, linear_num_heads=2, linear_conv_kernel_dim=4)


def tail_config() -> KimiLinearConfig:
  k, f = "linear_attention", "full_attention"
  return KimiLinearConfig(
      vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=7,
      num_local_experts=4, layer_types=[k, k, k, f, k, k, f],
      mlp_layer_types=["dense"] + ["sparse"] * 6, **COMMON)


def tiny_config() -> KimiLinearConfig:
  k, f = "linear_attention", "full_attention"
  return KimiLinearConfig(
      vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
      num_local_experts=8, layer_types=[k, f, k, f, f],
      mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"], **COMMON)


def build(variant: str) -> KimiLinearForCausalLM:
  torch.manual_seed(SEED)
  cfg = tail_config() if variant == "tail" else tiny_config()
  cfg._attn_implementation = "eager"
  model = KimiLinearForCausalLM(cfg).float().eval()
  g = torch.Generator().manual_seed(SEED + 1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(0.05 * torch.randn(b.shape, generator=g))
  return model


def logits_of(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(tokens).long(), use_cache=False)
  return out.logits.float().numpy()


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out")
  ap.add_argument("--check")
  ap.add_argument("--reference")
  ap.add_argument("--variant", choices=("tiny", "tail"), default="tiny")
  args = ap.parse_args()
  torch.backends.cuda.matmul.allow_tf32 = False
  print("transformers", transformers.__version__, "torch", torch.__version__)
  if args.check:
    ref = np.load(args.reference)
    model = KimiLinearForCausalLM.from_pretrained(args.check, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    got = logits_of(model, ref["tokens"])
    err = float(np.max(np.abs(got - ref["logits"])))
    print(f"exported checkpoint {args.check}: max |logits - reference| = {err:.3g}")
    return
  model = build(args.variant)
  name = "kimi_linear_" + args.variant
  d = os.path.join(args.out, name)
  model.save_pretrained(d, max_shard_size="400KB")
  rng = np.random.default_rng(SEED)
  tokens = rng.integers(3, model.config.vocab_size, size=(2, 40)).astype(np.int32)
  logits = logits_of(model, tokens)
  with torch.no_grad():
    gen = model.generate(torch.from_numpy(tokens[:1, :8]).long(), max_new_tokens=8,
                         do_sample=False, use_cache=True)
  np.savez(os.path.join(args.out, name + "_reference.npz"), tokens=tokens,
           logits=logits, generate_prompt=tokens[:1, :8], generate_out=gen.numpy())
  # Cross-check: the saved checkpoint reloads to the same logits.
  back = KimiLinearForCausalLM.from_pretrained(d, dtype=torch.float32,
                                               attn_implementation="eager").eval()
  print("reload max abs diff", float(np.max(np.abs(logits_of(back, tokens) - logits))))
  print("logits std", float(logits.std()), "greedy", gen.numpy().tolist())
  print(json.dumps(sorted(os.listdir(d))))


if __name__ == "__main__":
  main()
