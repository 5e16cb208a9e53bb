"""Kimi-K3 layout: the synthetic checkpoint of tests/data/hf/make_k3_synthetic.py (names from
HF_FORMATS.md, MXFP4 experts, AttnRes pairs, a vision tensor) lands in the right places, and
export -> import is bit-exact with and without MXFP4 experts."""

import json

import numpy as np
import pytest

from sparse_lm.interop.hf import load_pretrained, save_pretrained
from tests.interop.hf_testlib import K3, flat_state, read_all

# Independent E2M1 decode (OCP MX v1.0 table 5): sign bit 3, exponent bits 2-1, mantissa bit 0.
def _e2m1(code):
  sign = -1.0 if code & 8 else 1.0
  e, m = (code >> 1) & 3, code & 1
  return sign * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


def _decode(packed, scale):
  codes = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
  codes[..., 0::2], codes[..., 1::2] = packed & 15, packed >> 4
  vals = np.vectorize(_e2m1)(codes).astype(np.float32)
  return vals * np.repeat(2.0 ** (scale.astype(np.float32) - 127), 32, axis=-1)


@pytest.fixture(scope="module")
def imported():
  return load_pretrained(K3)


def test_config(imported):
  _, cfg = imported
  assert cfg.name == "kimi_k3" and cfg.layer_types == ("kda", "mla", "kda", "mla", "mla")
  assert (cfg.residual, cfg.attnres_block_layers) == ("attnres_block", 2)
  assert (cfg.ffn_activation, cfg.moe_latent, cfg.moe_latent_dim) == ("situ", True, 32)
  assert (cfg.q_lora_rank, cfg.mla_output_gate, cfg.kda_output_gate_rank) == (32, True, 0)
  assert cfg.kda_gate_lower_bound == -5.0 and cfg.mla_norm_eps is None


def test_tensors_land_where_hf_formats_says(imported):
  model, _ = imported
  t = read_all(K3)
  p = "language_model.model."
  got = lambda v: np.asarray(v[...])
  np.testing.assert_array_equal(
      got(model.final_query),
      t[p + "output_attn_res_norm.weight"] * t[p + "output_attn_res_proj.weight"][0])
  # layer 3 = groups[0] position 1 (mla_every = 2): its FFN pseudo-query and MLA q-LoRA
  q = f"{p}layers.3."
  grp = model.groups.layers[1]
  np.testing.assert_array_equal(got(grp.ffn_query)[0],
                                t[q + "mlp_res_norm.weight"] * t[q + "mlp_res_proj.weight"][0])
  np.testing.assert_array_equal(got(grp.mixer.w_uq)[0].reshape(32, -1),
                                t[q + "self_attn.q_b_proj.weight"].T)
  np.testing.assert_array_equal(got(grp.mixer.w_gate)[0].reshape(32, -1),
                                t[q + "self_attn.g_proj.weight"].T)
  # layer 0 (head, KDA): full-rank output gate, A_log [H], the conv taps
  k = f"{p}layers.0.self_attn."
  kda = model.head.layers[0].mixer
  np.testing.assert_array_equal(got(kda.A_log), t[k + "A_log"])
  np.testing.assert_array_equal(got(kda.w_og).reshape(32, -1), t[k + "g_proj.weight"].T)
  np.testing.assert_array_equal(got(kda.conv_k).reshape(4, -1), t[k + "k_conv1d.weight"][:, 0].T)
  # last layer: MXFP4 expert 3 gate / down, latent projections, correction bias
  m = f"{p}layers.4.block_sparse_moe."
  ffn = model.last.ffn
  w1 = _decode(t[m + "experts.3.w1.weight_packed"], t[m + "experts.3.w1.weight_scale"])
  w2 = _decode(t[m + "experts.3.w2.weight_packed"], t[m + "experts.3.w2.weight_scale"])
  np.testing.assert_array_equal(got(ffn.expert_gate)[3], w1.T)
  np.testing.assert_array_equal(got(ffn.expert_down)[3], w2.T)
  np.testing.assert_array_equal(got(ffn.w_down), t[m + "routed_expert_down_proj.weight"].T)
  np.testing.assert_array_equal(got(ffn.latent_norm), t[m + "routed_expert_norm.weight"])
  np.testing.assert_array_equal(got(ffn.balancer_bias), t[m + "gate.e_score_correction_bias"])
  np.testing.assert_array_equal(got(model.lm_head), t["language_model.lm_head.weight"].T)


@pytest.mark.parametrize("quantize", [False, True])
def test_export_import_bit_exact(imported, tmp_path, quantize):
  model, cfg = imported
  save_pretrained(model, cfg, tmp_path, layout="kimi_k3", quantize_experts=quantize,
                  max_shard_bytes=100_000)
  conf = json.loads((tmp_path / "config.json").read_text())
  assert conf["text_config"]["model_type"] == "kimi_linear"
  assert ("quantization_config" in conf) == quantize
  names = set(read_all(tmp_path))
  assert all(n.startswith("language_model.") for n in names)
  if quantize:  # the same tensor names as the release-style input, vision left out
    assert names == {n for n in read_all(K3) if not n.startswith("vision_tower.")}
  back, cfg2 = load_pretrained(tmp_path)
  assert cfg2 == cfg
  a, b = flat_state(model), flat_state(back)
  for path in a:
    assert np.array_equal(a[path], b[path]), path
