"""Audit test for the Block AttnRes stream (ARCHITECTURE.md §4, sparse_lm/model/attnres.py).

A whole block sequence (embedding, sub-layer outputs, a block commit, reads with learned,
non-zero pseudo-queries, the final read) against a float64 NumPy model of §4:
    h_l = Σ_j α_j s_j,   α = softmax_j( w_l · s_j / sqrt(mean_d s_j² + eps) ),
sources b_0, the committed block sums and the current block's partial sum. The stack stores
committed sources in cfg.attnres_stack_dtype (bf16 here, by design: rounding a source when it is
committed is part of the contract), while the running partial sum and all mixing stay fp32.

Mutation this test kills (it survived tests/model/test_layers.py's stream tests and
test_independent_references.py, whose configs are fp32 throughout): the partial block sum
accumulated in the stack dtype (bf16) instead of fp32.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import jax.numpy as jnp

from sparse_lm.config import get_preset
from sparse_lm.model import attnres

EPS = 1e-6


def _bf16(x):
  return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32),
                    np.float64)


def _np_mix(sources, w):
  s = np.stack([np.asarray(x, np.float64) for x in sources])  # [N, B, T, D]
  r = 1.0 / np.sqrt(np.mean(s * s, axis=-1) + EPS)
  logits = r * np.einsum("nbtd,d->nbt", s, np.asarray(w, np.float64))
  a = np.exp(logits - logits.max(0))
  a /= a.sum(0)
  return np.einsum("nbt,nbtd->btd", a, s)


def _rel(ref, out):
  ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
  return float(np.linalg.norm(ref - out) / np.linalg.norm(ref))


def test_block_stream_with_queries_bf16_stack_fp32_partial():
  cfg = dataclasses.replace(get_preset("tiny"), residual="attnres_block", attnres_block_layers=4,
                            attnres_stack_dtype="bfloat16")
  rng = np.random.default_rng(11)
  B, T, D = 2, 3, 16
  emb = rng.normal(size=(B, T, D)).astype(np.float32)
  ys = [rng.normal(size=(B, T, D)).astype(np.float32) for _ in range(6)]
  ws = [rng.normal(size=D).astype(np.float32) for _ in range(5)]

  st = attnres.init_stream(cfg, jnp.asarray(emb))
  st = attnres.open_block(cfg, st, True)  # layer 0 opens block 0: nothing to commit
  stack = [_bf16(emb)]  # b_0, stored in the stack dtype
  got = attnres.sublayer_input(cfg, st, jnp.asarray(ws[0]))
  assert _rel(_np_mix(stack, ws[0]), got) <= 1e-5

  partial = np.zeros((B, T, D))
  for y in ys[:4]:  # layers 0-1: four sub-layer outputs in block 0
    st = attnres.add_output(cfg, st, jnp.asarray(y))
    partial = partial + y.astype(np.float64)
  got = attnres.sublayer_input(cfg, st, jnp.asarray(ws[1]))
  # The running partial sum is a fp32 source: no bf16 rounding of the 4-term sum.
  assert _rel(_np_mix(stack + [partial], ws[1]), got) <= 1e-5, _rel(
      _np_mix(stack + [partial], ws[1]), got)

  st = attnres.open_block(cfg, st, True)  # layer 2 opens block 1: commit b_1 (bf16 in the stack)
  stack.append(_bf16(partial))
  got = attnres.sublayer_input(cfg, st, jnp.asarray(ws[2]))
  assert _rel(_np_mix(stack, ws[2]), got) <= 1e-5

  partial = np.zeros((B, T, D))
  for y in ys[4:]:
    st = attnres.add_output(cfg, st, jnp.asarray(y))
    partial = partial + y.astype(np.float64)
  got = attnres.sublayer_input(cfg, st, jnp.asarray(ws[3]))
  assert _rel(_np_mix(stack + [partial], ws[3]), got) <= 1e-5
  final = attnres.final_output(cfg, st, jnp.asarray(ws[4]))
  assert _rel(_np_mix(stack + [partial], ws[4]), final) <= 1e-5
  # The queries matter: a uniform average is far from these reads.
  assert _rel(_np_mix(stack + [partial], np.zeros(D)), final) > 1e-2
