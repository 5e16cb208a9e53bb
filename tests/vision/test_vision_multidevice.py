"""VisionEncoder under an 8-device CPU mesh (fsdp=2, expert=2, tensor=2): params sharded by
their logical names (with the vision rules the lead is expected to add), images over the batch
axes; outputs equal the single-device ones. Runs in a subprocess (XLA_FLAGS before jax)."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np
    from flax import nnx
    from sparse_lm import sharding, vision

    rules = sharding.LOGICAL_AXIS_RULES + (
        ("vision_embed", "fsdp"), ("vision_mlp", "tensor"), ("vision_merged", "fsdp"),
        ("vision_patch", None))
    mesh = sharding.make_mesh(sharding.MeshLayout.parse("fsdp=2,expert=2,tensor=2"))
    cfg = vision.tiny_vision_config()
    rng = np.random.default_rng(0)
    sizes = [(56, 84), (28, 28), (30, 40), (50, 20)]
    batch = vision.pad_images([rng.uniform(-1, 1, (h, w, 3)).astype(np.float32)
                               for h, w in sizes], 14)
    encode = lambda e, b: e.encode(b)
    ref, ref_mask = nnx.jit(encode)(vision.VisionEncoder(cfg, rngs=nnx.Rngs(0)), batch)
    with sharding.use_mesh(mesh, rules):
      abstract = nnx.eval_shape(lambda: vision.VisionEncoder(cfg, rngs=nnx.Rngs(0)))
      shardings = sharding.state_shardings(nnx.state(abstract), mesh)
      graphdef, state = nnx.split(vision.VisionEncoder(cfg, rngs=nnx.Rngs(0)))
      state = jax.device_put(state, shardings)
      specs = {str(s.spec) for s in jax.tree.leaves(jax.tree.map(lambda a: a.sharding, state))}
      assert "P(None, 'fsdp', 'tensor')" in specs, specs  # stacked w_1
      e, mask = jax.jit(lambda s, b: nnx.merge(graphdef, s).encode(b))(state, batch)
    assert e.sharding.spec[0] == ("fsdp", "expert"), e.sharding
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(ref_mask))
    np.testing.assert_allclose(np.asarray(e), np.asarray(ref), rtol=1e-5, atol=1e-5)
    print("OK")
""")


def test_vision_encoder_sharded_matches_single_device():
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-4000:]
  assert "Involuntary full rematerialization" not in out.stderr, out.stderr[-4000:]
