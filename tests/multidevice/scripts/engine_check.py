"""The inference engine on a mesh vs one device (fp32, random weights, non-zero balancing
biases): greedy tokens equal and log-probs within 1e-5, over a prefill piece, a decode call,
and a second turn continued from a returned state. The compiled prefill and
decode programs hold no array with every routed expert on one device (the expert weights stay
sharded over `expert`). Then the end-of-stage sample (`sparse_lm.train.sample.generate`, what
the training loop calls) on a mesh with the weights laid out as in training equals one device's.

Usage: engine_check.py   (8 fake CPU devices; run by tests/multidevice/test_engine_mesh.py)
Prints "OK <layout> ..." per check; exits 1 on failure.
"""
import dataclasses
import math
import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import re
import sys
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from sparse_lm import sharding as shd
from sparse_lm.config import get_preset
from sparse_lm.inference import Engine, SamplingParams
from sparse_lm.inference import calls as calls_lib
from sparse_lm.inference.forward import DecoderStack
from sparse_lm.model.transformer import Transformer
from sparse_lm.train.sample import generate
from tests.inference.engine_testlib import randomize_balancer_biases

SEED = 3
# 5 layers (dense layer 0, KDA, MLA, LatentMoE, AttnRes blocks), 12 experts top-2: 12 appears
# in no other array dimension, so a gathered [12, ...] expert array is recognisable.
CFG = get_preset("tiny", num_layers=5, d_model=32, vocab_size=128, dense_hidden=64,
                 moe_latent_dim=16, expert_hidden=32, shared_expert_hidden=32, num_experts=12,
                 balancer_bins=64, attention_chunk_size=16, kda_chunk_size=16)
E = CFG.num_experts
LAYOUT = "fsdp=2,expert=2,context=2"
PROMPT = [5, 17, 99, 3, 42, 8, 61, 7, 120, 33, 2, 40, 41, 42, 43, 44, 45]
NEW = 12
# The end-of-stage sample's engine (train/sample.py): max_length = prompt + NEW rounded up to
# LENGTH_MULTIPLE = 36, one slot, one 36-token prefill piece. 36 tokens do not divide over the
# mesh's 8 token shards, so the prefill's MoE takes the expert-sharded dense path, as a short
# sample prompt does on a full-scale mesh (2,048 token shards).
LENGTH_MULTIPLE = 12
ENGINE = dict(max_length=36, max_batch=1, prefill_chunk=36)


def model():
  m = Transformer(CFG, rngs=nnx.Rngs(SEED))
  randomize_balancer_biases(m, SEED + 1)
  return m


def run(engine):
  """The prompt, then a second turn continued from its returned state."""
  greedy = SamplingParams(temperature=0.0)
  out = engine.generate([PROMPT], max_new_tokens=NEW, sampling=greedy)[0]
  more = engine.generate([[11, 12, 13]], max_new_tokens=4, sampling=greedy,
                         states=[out.state])[0]
  return [(o.tokens, o.logprobs) for o in (out, more)]


def full_expert_shapes(hlo: str) -> list[str]:
  """Array shapes of rank >= 3 whose leading dimension is E (every expert on one device)."""
  return sorted({m.group(0) for m in re.finditer(r"\w+\[(\d+)(,\d+){2,}\]", hlo)
                 if int(m.group(1)) == E})


def main():
  print(f"seed {SEED}; {jax.device_count()} devices")
  t0 = time.perf_counter()
  m = model()
  ref = run(Engine(m, **ENGINE))
  layout = shd.MeshLayout.parse(LAYOUT)
  mesh = shd.make_mesh(layout)
  eng = Engine(m, mesh=mesh, **ENGINE)
  w = jax.tree.leaves(eng._weights)
  assert all(len(a.sharding.device_set) == 8 for a in w), "weights not on the mesh"
  got = run(eng)
  toks = all(a[0] == b[0] for a, b in zip(ref, got))
  err = max(float(np.max(np.abs(np.subtract(a[1], b[1])))) for a, b in zip(ref, got))
  ok_engine = toks and err <= 1e-5
  print(f"{'OK' if ok_engine else 'FAIL'} engine {LAYOUT}: tokens equal {toks} "
        f"({[a[0] for a in got]}), max |dlogp| {err:.2e} "
        f"({time.perf_counter() - t0:.0f} s)", flush=True)

  # The programs the engine ran (compiled on first use, kept): no [E, ...] array.
  gathered = {name: [full_expert_shapes(exe.as_text()) for exe in call.compiled.values()]
              for name, call in (("prefill", eng._calls.step), ("decode", eng._calls.decode))}
  # A decode step moves activations only: every all-gather in the decode program is at most
  # one row's width (no weight, dense or expert, is gathered).
  decode_hlo = next(iter(eng._calls.decode.compiled.values())).as_text()
  ag = [math.prod(int(d) for d in dims.split(",") if d) for dims in re.findall(
      r"= \w+\[([\d,]*)\]\{[^}]*\} all-gather\(", decode_hlo)]
  # The weights of a model with scanned layer groups (9 layers: each group's per-layer
  # slices) place on the mesh too (abstract: nothing compiled or allocated).
  stack9 = nnx.eval_shape(lambda: DecoderStack(Transformer(
      dataclasses.replace(CFG, num_layers=9), rngs=nnx.Rngs(0))))
  n9 = len(jax.tree.leaves(calls_lib.weight_shardings(nnx.state(stack9), mesh)))
  # control: the detector sees an expert weight gathered onto every device
  expert_w = [a for a in w if a.ndim == 3 and a.shape[0] == E][0]
  control = full_expert_shapes(jax.jit(lambda a: a * 2, out_shardings=NamedSharding(
      mesh, PartitionSpec())).lower(expert_w).compile().as_text())
  ok_hlo = (all(len(v) == 1 and not v[0] for v in gathered.values()) and bool(control)
            and n9 > 0 and max(ag, default=0) <= CFG.d_model)
  print(f"{'OK' if ok_hlo else 'FAIL'} compiled {LAYOUT}: full-expert arrays in prefill / "
        f"decode {gathered} (control, a gathered expert weight: {control}); decode "
        f"all-gathers: {len(ag)}, largest {max(ag, default=0)} elements; 9-layer stack placed: "
        f"{n9} weights "
        f"({time.perf_counter() - t0:.0f} s)", flush=True)

  # The training loop's final sample (train/sample.py): the weights laid out as the train
  # state's, the loop's mesh active.
  graphdef, params, model_vars = nnx.split(m, nnx.Param, ...)
  kw = dict(max_new_tokens=NEW, length_multiple=LENGTH_MULTIPLE)
  one = generate(graphdef, params, model_vars, PROMPT, **kw)
  with shd.use_mesh(mesh, layout.rules):
    p2 = jax.device_put(params, shd.state_shardings(params, mesh))
    v2 = jax.device_put(model_vars, shd.state_shardings(model_vars, mesh))
    on_mesh = generate(graphdef, p2, v2, PROMPT, **kw)
  ok_sample = on_mesh == one == got[0][0]
  print(f"{'OK' if ok_sample else 'FAIL'} sample {LAYOUT}: {on_mesh} vs one device {one} "
        f"({time.perf_counter() - t0:.0f} s)", flush=True)
  sys.exit(0 if ok_engine and ok_hlo and ok_sample else 1)


if __name__ == "__main__":
  main()
