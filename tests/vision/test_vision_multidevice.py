"""A train step of a small multimodal model (KDA, MLA, dense FFN, LatentMoE, AttnRes, ViT)
on packed image rows on 8 CPU devices (fsdp=2, expert=2, tensor=2) equals one device, with
the shipped rules table only (`sharding.LOGICAL_AXIS_RULES`, which carries the vision axes).
Runs in a subprocess (XLA_FLAGS before jax)."""

import os
import subprocess
import sys
import textwrap

from tests._xla_flags import with_devices

SCRIPT = textwrap.dedent("""
    import os
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from sparse_lm import sharding as shd, vision
    from sparse_lm.data import images as image_data
    from sparse_lm.model.loss import loss_fn
    from sparse_lm.model.transformer import Transformer
    from sparse_lm.train.state import graphdef_of, make_init_fn
    from sparse_lm.train.step import make_train_step

    names = {n for n, _ in shd.LOGICAL_AXIS_RULES}
    assert {"vision_embed", "vision_mlp", "vision_merged", "vision_patch"} <= names, names
    CFG = vision.tiny_vision_config(num_layers=3, mla_every=2, attnres_block_layers=2,
        d_model=32, vocab_size=128, kda_head_dim=16, kda_value_dim=16, q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, dense_hidden=64,
        moe_latent_dim=16, expert_hidden=32, shared_expert_hidden=32, balancer_bins=64,
        loss_chunk_size=64, attention_chunk_size=16)
    B, T, L = 4, 40, 48
    seed = 7
    print("seed", seed)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(8, 128, (B, T)).astype(np.int32)
    seg = np.ones((B, T), np.int32)
    packed = [np.zeros((B, L, 588), np.uint8), np.zeros((B, L), np.int32),
              np.zeros((B, L, 2), np.int32)]
    for b in range(B):
      at, pos = 0, 2 + b
      for k, (h, w) in enumerate([(40, 60), (28, 28 + 20 * b)][:1 + b % 2]):
        im = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        p, c = image_data.image_patches(im, 14)
        packed[0][b, at:at + len(p)], packed[2][b, at:at + len(p)] = p, c
        packed[1][b, at:at + len(p)] = 1
        n = len(p) // 4
        tokens[b, pos:pos + n] = vision.IMAGE_TOKEN_ID
        at, pos = at + len(p), pos + n + 3
    data = {"tokens": tokens, "segment_ids": seg, "loss_mask": np.ones((B, T), np.float32),
            "image_patches": packed[0], "image_segment_ids": packed[1],
            "image_coords": packed[2]}
    factory = lambda s: Transformer(CFG, rngs=nnx.Rngs(s))
    tx = optax.sgd(1.0)
    init = make_init_fn(factory, tx, 0)
    step = make_train_step(graphdef_of(factory, 0), tx, lambda s: jnp.float32(1.0), loss_fn)
    state0 = jax.jit(init)()
    ref, m_ref = jax.jit(step)(state0, data)
    lay = shd.MeshLayout.parse("fsdp=2,expert=2,tensor=2")
    mesh = shd.make_mesh(lay)
    with shd.use_mesh(mesh, lay.rules):
      state_sh = shd.state_shardings(jax.eval_shape(init), mesh)
      bsh = shd.batch_shardings(data, mesh)
      s1, m = jax.jit(step, in_shardings=(state_sh, bsh),
                      out_shardings=(state_sh, NamedSharding(mesh, P())))(
                          jax.device_put(state0, state_sh), jax.device_put(data, bsh))
    w1 = state_sh.params["vision"]["blocks"]["w_1"].value.spec
    assert "tensor" in str(w1) and "fsdp" in str(w1), w1  # [layers, vision_embed, vision_mlp]
    g = lambda s: [np.asarray(a, np.float64) - np.asarray(b, np.float64) for a, b in
                   zip(jax.tree.leaves(state0.params), jax.tree.leaves(s.params))]
    g0, g1 = g(ref), g(jax.device_get(s1))
    gn = float(np.sqrt(sum(np.sum(x ** 2) for x in g0)))
    worst = max(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-4 * gn) for a, b in zip(g1, g0))
    vis = [np.abs(x).max() for x, (k, _) in zip(g0, jax.tree_util.tree_flatten_with_path(
        state0.params)[0]) if "vision" in jax.tree_util.keystr(k)]
    assert vis and max(vis) > 0, "no gradient reached the encoder"
    dl = abs(float(m["loss"]) - float(m_ref["loss"])) / abs(float(m_ref["loss"]))
    assert dl < 1e-5 and worst < 1e-4, (dl, worst)
    print("OK", dl, worst)
""")


def test_vision_train_step_sharded_matches_single_device_with_shipped_rules():
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
             XLA_FLAGS=with_devices(8))
  out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                       timeout=1800)
  assert out.returncode == 0 and "OK" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
  assert "Involuntary full rematerialization" not in out.stderr, out.stderr[-4000:]
