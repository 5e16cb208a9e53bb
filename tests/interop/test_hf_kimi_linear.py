"""Kimi-Linear import against transformers' own KimiLinearForCausalLM (tests/data/hf).

The fixture was written once by transformers 5.23 (make_kimi_linear_fixture.py, fp32, CPU,
eager attention, its pure-torch KDA): 5 layers (KDA, MLA, KDA, MLA, MLA), layer 0 dense,
8 routed experts top-2 plus 1 shared, randomised norm weights and correction biases.
"""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_lm.interop import hf_config
from sparse_lm.interop.hf import load_pretrained, save_pretrained
from tests.interop.hf_testlib import (KIMI_LINEAR, KIMI_LINEAR_REF, TAIL, TAIL_REF, flat_state,
                                      read_all)


@pytest.fixture(scope="module")
def imported():
  # kda_chunk_size 16: the 40 tokens span three chunks of the chunked KDA.
  return load_pretrained(KIMI_LINEAR, remat_policy="none", kda_chunk_size=16)


def test_logits_match_transformers(imported):
  model, cfg = imported
  ref = np.load(KIMI_LINEAR_REF)
  got = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(ref["tokens"])))
  err = float(np.max(np.abs(got - ref["logits"])))
  print(f"max |logits - transformers| = {err:.3g} (logit scale {np.abs(ref['logits']).max():.3g})")
  assert got.shape == ref["logits"].shape
  assert err < 1e-4


def test_config_maps_every_kimi_linear_variant(imported):
  _, cfg = imported
  assert cfg.layer_types == ("kda", "mla", "kda", "mla", "mla") and cfg.mla_every == 2
  assert cfg.num_dense_layers == 1 and cfg.dense_hidden == 128
  assert (cfg.ffn_activation, cfg.moe_latent, cfg.residual) == ("swiglu", False, "standard")
  assert (cfg.q_lora_rank, cfg.mla_output_gate) == (0, False)
  assert (cfg.kda_output_gate_rank, cfg.kda_gate_lower_bound) == (16, None)
  assert (cfg.norm_eps, cfg.mla_norm_eps, cfg.l2_norm_eps) == (1e-5, 1e-6, 1e-6)
  assert (cfg.num_experts, cfg.experts_per_token, cfg.num_shared_experts) == (8, 2, 1)
  assert cfg.route_scale == 2.446 and cfg.expert_hidden == cfg.shared_expert_hidden == 16


def _canonical(name):  # transformers saves the dense FFN under block_sparse_moe.
  return re.sub(r"(layers\.\d+\.)block_sparse_moe\.((gate|up|down)_proj)", r"\1mlp.\2", name)


def test_export_writes_the_same_tensors_and_reloads_bit_exact(imported, tmp_path):
  model, cfg = imported
  files = save_pretrained(model, cfg, tmp_path, layout="kimi_linear", max_shard_bytes=200_000)
  assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
  original = {_canonical(k): v for k, v in read_all(KIMI_LINEAR).items()}
  written = read_all(tmp_path)
  assert set(written) == set(original)
  for k, v in original.items():
    assert written[k].dtype == v.dtype and written[k].shape == v.shape, k
    assert np.array_equal(written[k], v), k
  back, cfg2 = load_pretrained(tmp_path, remat_policy="none", kda_chunk_size=16)
  assert cfg2 == cfg
  a, b = flat_state(model), flat_state(back)
  assert a.keys() == b.keys()
  for p in a:
    assert a[p].dtype == b[p].dtype and np.array_equal(a[p], b[p]), p


def test_config_round_trip(imported):
  _, cfg = imported
  back, layout = hf_config.config_from_hf(hf_config.config_to_hf(cfg, "kimi_linear"))
  assert layout == "kimi_linear"
  assert back == dataclasses.replace(cfg, remat_policy="full", kda_chunk_size=64)


def test_overrides_cannot_change_the_architecture():
  with pytest.raises(ValueError, match="num_experts"):
    load_pretrained(KIMI_LINEAR, num_experts=4)


def test_bfloat16_import(tmp_path):
  model, cfg = load_pretrained(KIMI_LINEAR, dtype="bfloat16")
  assert cfg.dtype == cfg.param_dtype == "bfloat16"
  w = model.head.layers[0].mixer.w_q[...]
  assert w.dtype == jnp.bfloat16
  router = model.last.ffn.router[...]
  assert router.dtype == jnp.float32  # routing precision is kept


def test_tail_layout_of_kimi_linear_48b():
  """Kimi-Linear-48B's pattern in miniature (transformers fixture, 7 layers, 1-based MLA
  layers [4, 7]): two KDA layers after the last whole group sit in `Transformer.tail`."""
  model, cfg = load_pretrained(TAIL, remat_policy="none", kda_chunk_size=16)
  assert cfg.layer_types == ("kda",) * 3 + ("mla",) + ("kda",) * 2 + ("mla",)
  assert cfg.mla_every == 4 and len(model.tail) == 2 and model.groups is None
  ref = np.load(TAIL_REF)
  got = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(ref["tokens"])))
  err = float(np.max(np.abs(got - ref["logits"])))
  print(f"max |logits - transformers| = {err:.3g}")
  assert err < 1e-4
