"""Greedy generation through the inference engine equals transformers' greedy `generate` on
the transformers-written Kimi-Linear fixture (prompt and continuation stored by
tests/data/hf/make_kimi_linear_fixture.py)."""

import numpy as np

from sparse_lm.inference import Engine, SamplingParams
from sparse_lm.interop.hf import load_pretrained
from tests.interop.hf_testlib import KIMI_LINEAR, KIMI_LINEAR_REF


def test_greedy_generation_equals_transformers():
  ref = np.load(KIMI_LINEAR_REF)
  prompt = [int(t) for t in ref["generate_prompt"][0]]
  want = [int(t) for t in ref["generate_out"][0, len(prompt):]]
  model, _ = load_pretrained(KIMI_LINEAR, remat_policy="none", kda_chunk_size=16)
  engine = Engine(model, max_length=32, max_batch=1)
  out = engine.generate([prompt], max_new_tokens=len(want),
                        sampling=SamplingParams(temperature=0.0), seed=0)
  print("engine", out[0].tokens, "transformers", want)
  assert list(out[0].tokens) == want
