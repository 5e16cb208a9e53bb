"""The fused decode kernels (pallas_kernels.decode through sparse_lm.inference.fused) against
the pure-JAX decode path of forward.py, on fresh random inputs, caches and weights (never
zeros). On CPU the kernels run in Pallas interpret mode; on a GPU (JAX_PLATFORMS=cuda) the
same tests run the compiled Triton kernels. fp32 at 1e-5 (ARCHITECTURE.md: much tighter than
the bf16 contract); one bf16 case at the bf16 contract (relative RMSE <= 5e-3).

Reference for each kernel: the path the engine takes without it (`kda_cached`,
`attnres.sublayer_input` + the pre-norm, `gathered_experts`), itself checked against the
model's full forward pass in test_engine.py / test_moe_decode.py. The whole decode step
through the kernels: test_decode_padding.py."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels.decode import kda_step, moe_experts, moe_experts_routed
from sparse_lm import nn
from sparse_lm.config import get_preset
from sparse_lm.inference import cache as cache_lib, forward as forward_lib, fused
from sparse_lm.model import attnres
from sparse_lm.model.kda import KDA
from sparse_lm.moe import router as router_lib

SEED = 11
TOL = dict(rtol=1e-5, atol=1e-5)
INTERPRET = jax.default_backend() != "gpu"


def _randomize(tree, seed, scale=0.5):
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [(scale * jax.random.normal(k, a.shape, jnp.float32)
                                       ).astype(a.dtype) for k, a in zip(keys, leaves)])


def _rel_rmse(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / np.linalg.norm(want)


def _kda_setup(cfg):
  mixer = KDA(cfg, rngs=nnx.Rngs(SEED))
  for name in ("A_log", "dt_bias", "o_norm"):  # away from their constant initial values
    var = getattr(mixer, name)
    var[...] = var[...] + 0.3 * jax.random.normal(jax.random.key(SEED + 1), var[...].shape)
  return nnx.split(mixer)


def _kda_paths(cfg, x, cache, n_valid, kernel=True):
  """(fused kernel path or None, pure-JAX path) of one KDA decode token."""
  graphdef, state = _kda_setup(cfg)
  want = jax.jit(lambda s, x, c: forward_lib.kda_cached(nnx.merge(graphdef, s), x, c, n_valid))(
      state, x, cache)
  got = jax.jit(lambda s, x, c: fused.kda_step_fused(
      nnx.merge(graphdef, s), x, c, n_valid, pad=forward_lib.pad_rows,
      rows=forward_lib.DECODE_MIN_ROWS, interpret=INTERPRET))(state, x, cache) if kernel else None
  return got, want


@pytest.mark.parametrize("gate_up", [True, False], ids=["gate_up_in_kernel", "gate_up_gemm"])
@pytest.mark.parametrize("variant", ["unbounded_lowrank", "bf16", "k64"])
def test_kda_step_kernel_equals_kda_cached(variant, gate_up, monkeypatch):
  """One token for 3 rows (row 1 idle: an identity step) from a random state and conv tails:
  output, state and tails against forward.kda_cached (recurrent_step + kda_projections +
  kda_output). bf16: the kernel path against the fp32 path on the same inputs, at the bf16
  contract of ARCHITECTURE.md §2.5 (relative RMSE <= 5e-3 for the output, state and tails;
  the pure-JAX bf16 path's error is printed beside it); k64: K = V = 64. gate_up: the gate's W_g_up product
  inside the kernel (FUSE["gate_up"], the default) or as an XLA GEMM handing it z. The bounded
  gate with the full-rank output gate in fp32: test_decode_padding.py (the whole step)."""
  print(f"seed {SEED} variant {variant} gate_up {gate_up}")
  monkeypatch.setitem(fused.FUSE, "gate_up", gate_up)
  over = {"unbounded_lowrank": dict(kda_gate_lower_bound=None, kda_output_gate_rank=8),
          "bf16": dict(dtype="bfloat16"),
          # K = 64: the in-kernel W_g_up product in two blocks of 32 rows
          "k64": dict(kda_head_dim=64, kda_value_dim=64)}[variant]
  cfg = get_preset("tiny", **over)
  B = 3
  cache = _randomize(cache_lib.init_cache(cfg, B, 16)[0], SEED + 2)
  x = jax.random.normal(jax.random.key(SEED + 3), (B, 1, cfg.d_model)).astype(cfg.dtype)
  n_valid = jnp.array([1, 0, 1], jnp.int32)
  got, want = _kda_paths(cfg, x, cache, n_valid)
  assert float(jnp.std(want[0][0].astype(jnp.float32))) > 1e-3
  if variant == "bf16":
    f32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)
    truth = _kda_paths(get_preset("tiny", dtype="float32"), f32(x), f32(cache), n_valid,
                       kernel=False)[1]
    for g, w, t in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(truth)):
      err_kernel, err_xla = _rel_rmse(g, t), _rel_rmse(w, t)
      print(f"bf16 rel RMSE vs fp32: kernel {err_kernel:.2e}, pure-JAX {err_xla:.2e}")
      assert err_kernel <= 5e-3
  else:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)
  # the idle row's state and tails are exactly its old ones
  np.testing.assert_array_equal(np.asarray(got[1]["S"][1]), np.asarray(cache["S"][1]))
  for name in ("q", "k", "v"):
    np.testing.assert_array_equal(np.asarray(got[1]["conv"][name][1]),
                                  np.asarray(cache["conv"][name][1]))


def test_attnres_mix_kernel_equals_stream_read():
  """A Block-AttnRes read (3 of 4 slots filled, a partial block sum) + pre-norm, after adding
  a sub-layer output, against attnres.add_output + sublayer_input + RMSNorm (the reads
  without the add run in test_decode_padding.py (the whole step))."""
  print(f"seed {SEED}")
  cfg = get_preset("tiny")
  B, D, N = 2, cfg.d_model, 4
  k = jax.random.split(jax.random.key(SEED + 4), 5)
  stream = {"stack": jax.random.normal(k[0], (N, B, 1, D)).at[3].set(0.0) * 2.0,
            "count": jnp.int32(3), "partial": jax.random.normal(k[1], (B, 1, D)),
            "has_partial": jnp.bool_(True)}
  query = jax.random.normal(k[2], (D,))
  norm = types.SimpleNamespace(scale=1.0 + 0.3 * jax.random.normal(k[3], (D,)),
                               eps=cfg.norm_eps)  # an nn.RMSNorm's fields
  y = jax.random.normal(k[4], (B, 1, D))
  ref_stream = attnres.add_output(cfg, stream, y)
  want = nn.rms_norm(attnres.sublayer_input(cfg, ref_stream, query), norm.scale,
                     cfg.norm_eps)
  got, got_stream = fused.stream_read(cfg, stream, query, norm, y=y, interpret=INTERPRET)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)
  np.testing.assert_allclose(np.asarray(got_stream["partial"]),
                             np.asarray(ref_stream["partial"]), **TOL)
  # with the next GEMMs' padding rows written by the kernel: the same rows, then zeros
  padded, padded_stream = fused.stream_read(cfg, stream, query, norm, y=y, interpret=INTERPRET,
                                            rows=B + 2)
  assert padded.shape == (B + 2, 1, D)
  np.testing.assert_array_equal(np.asarray(padded[:B]), np.asarray(got))
  np.testing.assert_array_equal(np.asarray(padded[B:]), np.zeros((2, 1, D)))
  np.testing.assert_array_equal(np.asarray(padded_stream["partial"]),
                                np.asarray(got_stream["partial"]))


@pytest.mark.parametrize("activation", ["swiglu", "situ_bf16_dot"])
def test_moe_experts_kernel_equals_gathered_experts(activation):
  """Routed experts read in place (ids with the sentinel E: no expert) against
  forward.gathered_experts (fp32 at 1e-5; bf16 weights through the tensor-core dot against the
  same path in bf16, relative RMSE <= 5e-3). SiTU in fp32:
  test_decode_padding.py (the whole step)."""
  print(f"seed {SEED} {activation}")
  E, L, F, N, k = 6, 32, 64, 3, 2
  keys = jax.random.split(jax.random.key(SEED + 5), 6)
  params = {"w_gate": jax.random.normal(keys[0], (E, L, F)) / 4,
            "w_up": jax.random.normal(keys[1], (E, L, F)) / 4,
            "w_down": jax.random.normal(keys[2], (E, F, L)) / 8}
  z = jax.random.normal(keys[3], (N, L))
  ids = jax.random.randint(keys[4], (N, k), 0, E + 1).at[0, 1].set(E)
  gates = jax.random.uniform(keys[5], (N, k))
  betas = (None, None) if activation == "swiglu" else (4.0, 25.0)  # SwiGLU / SiTU
  want = forward_lib.gathered_experts(z, ids, gates, params, beta1=betas[0], beta2=betas[1])
  assert float(jnp.std(want)) > 1e-2
  if activation == "situ_bf16_dot":  # against the pure-JAX path on the same bf16 inputs
    bf = lambda a: a.astype(jnp.bfloat16)
    want = forward_lib.gathered_experts(bf(z), ids, gates, jax.tree.map(bf, params), beta1=4.0,
                                        beta2=25.0)
    got = moe_experts(bf(z), ids, gates, jax.tree.map(bf, params), beta1=4.0, beta2=25.0,
                      block_f=16, use_dot=True, interpret=INTERPRET)
    assert _rel_rmse(got, want) <= 5e-3
    return
  got = moe_experts(z, ids, gates, params, beta1=betas[0], beta2=betas[1], block_f=16,
                    interpret=INTERPRET)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def _routed_reference(z, logits, bias, valid, params, k, route_scale, betas, E):
  """s = sigmoid(clip(logits)) (router.router_scores' formula), router.route (top-k of s + b,
  normalised gates), then gathered_experts, invalid tokens given the sentinel id E: the XLA
  path of forward.moe_decode."""
  bound = router_lib.ROUTER_LOGIT_BOUND
  routing = router_lib.route(jax.nn.sigmoid(jnp.clip(logits, -bound, bound)), bias, k,
                             route_scale)
  ids = jnp.where(valid[:, None], routing.expert_ids, E)
  return forward_lib.gathered_experts(z, ids, routing.gates, params, beta1=betas[0],
                                      beta2=betas[1])


@pytest.mark.parametrize("activation", ["situ", "situ_bf16_dot"])
def test_moe_experts_routed_equals_route_then_gathered_experts(activation):
  """The kernel that routes (s = sigmoid(logits), top k of s + b, gates s / sum s x
  route_scale, an invalid token's gates 0) and runs the experts, reading the latent from
  columns of a wider fp32 array, against router.route + gathered_experts on random logits,
  biases and weights; plus rows with exact ties in s + b at the k-th place and among the top,
  where jax.lax.top_k takes the lowest index (a wrong tie rule picks another expert's
  weights). fp32 at 1e-5; bf16 at the bf16 contract (relative RMSE <= 5e-3)."""
  print(f"seed {SEED} {activation}")
  E, L, F, N, k, D = 16, 32, 64, 5, 3, 24
  keys = jax.random.split(jax.random.key(SEED + 9), 8)
  params = {"w_gate": jax.random.normal(keys[0], (E, L, F)) / 4,
            "w_up": jax.random.normal(keys[1], (E, L, F)) / 4,
            "w_down": jax.random.normal(keys[2], (E, F, L)) / 8}
  # the latent in columns [16, 48) of a [N + 2, 80] fp32 array (two padding rows, not read)
  wide = jax.random.normal(keys[3], (N + 2, 80))
  z, z_col = wide[:, 16:16 + L], 16
  x, w_router = jax.random.normal(keys[4], (N, D)), jax.random.normal(keys[6], (D, E)) / 3
  logits = router_lib.router_logits(x, w_router)
  bias = 0.1 * jax.random.normal(keys[5], (E,))
  bias = bias.at[jnp.array([2, 5, 9, 7, 12])].set(0.05)
  # row 3: experts 2, 5, 9 tie for places 2-4 (k = 3: 2 and 5 win); row 4: 7 and 12 tie first
  logits = logits.at[3].set(jnp.full((E,), -2.0).at[0].set(3.0).at[jnp.array([2, 5, 9])]
                            .set(0.5)).at[4].set(
      jnp.full((E,), -1.0).at[jnp.array([7, 12])].set(2.0).at[1].set(1.0))
  valid = jnp.array([True, False, True, True, True])
  betas = (4.0, 25.0)
  np.testing.assert_array_equal(  # the reference's scores are the model router's
      np.asarray(router_lib.router_scores(x, w_router)[:3]),
      np.asarray(jax.nn.sigmoid(jnp.clip(logits[:3], -40, 40))))
  want = _routed_reference(z[:N], logits, bias, valid, params, k, 2.5, betas, E)
  assert float(jnp.std(want)) > 1e-2 and not np.any(np.asarray(want[1]))
  kw = dict(k=k, route_scale=2.5, logit_bound=router_lib.ROUTER_LOGIT_BOUND, beta1=4.0,
            beta2=25.0, z_col=z_col, block_f=16, interpret=INTERPRET)
  if activation == "situ_bf16_dot":  # fp32 columns rounded to bf16 in the kernel
    bf = lambda a: a.astype(jnp.bfloat16)
    want = _routed_reference(bf(z[:N]), logits, bias, valid, jax.tree.map(bf, params), k, 2.5,
                             betas, E)
    got = moe_experts_routed(wide, logits, bias, valid, jax.tree.map(bf, params),
                             dtype=jnp.bfloat16, use_dot=True, **kw)
    assert _rel_rmse(got, want) <= 5e-3
    return
  got = moe_experts_routed(wide, logits, bias, valid, params, **kw)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)
  # the tie rule matters: with expert 9 in place of 5 in row 3, row 3 would differ
  s3 = jax.nn.sigmoid(logits[3:4])
  ref3 = router_lib.route(s3, bias, k, 2.5)
  assert sorted(np.asarray(ref3.expert_ids[0]).tolist()) == [0, 2, 5]
  other = forward_lib.gathered_experts(z[3:4], jnp.array([[0, 2, 9]]), ref3.gates, params,
                                       beta1=4.0, beta2=25.0)
  assert float(jnp.max(jnp.abs(other - got[3:4]))) > 1e-2


def test_moe_experts_routed_refuses_bad_shapes():
  E, L, F = 16, 32, 64
  params = {"w_gate": jnp.ones((E, L, F)), "w_up": jnp.ones((E, L, F)),
            "w_down": jnp.ones((E, F, L))}
  z, s, b, v = jnp.ones((2, L)), jnp.ones((2, E)), jnp.ones((E,)), jnp.ones((2,), bool)
  kw = dict(route_scale=1.0, logit_bound=40.0, beta1=None, beta2=None, interpret=True)
  with pytest.raises(ValueError, match="k=17 experts per token must be in"):
    moe_experts_routed(z, s, b, v, params, k=17, **kw)
  with pytest.raises(ValueError, match=r"logits \(2, 8\).*must be \[N, E\]"):
    moe_experts_routed(z, s[:, :8], b, v, params, k=2, **kw)
  with pytest.raises(ValueError, match=r"latent in columns \[z_col=8, z_col \+ L=40\)"):
    moe_experts_routed(z, s, b, v, params, k=2, z_col=8, **kw)


def test_decode_backend_is_validated_and_auto_is_xla_on_cpu():
  with pytest.raises(ValueError, match="decode_backend='triton' must be one of"):
    get_preset("tiny", decode_backend="triton")
  if INTERPRET:
    assert fused.decode_kernels(get_preset("tiny")) == (False, False)
  assert fused.decode_kernels(get_preset("tiny", decode_backend="xla")) == (False, False)


def test_kda_input_matrix_layout_and_bad_offsets_are_refused():
  """The concatenated input projections hold each weight's columns where kda_input_cols says
  (checked against the weights themselves), and the kernel and the step refuse offsets or a
  matrix that do not fit, naming the argument."""
  cfg = get_preset("tiny", kda_output_gate_rank=8)
  graphdef, state = _kda_setup(cfg)
  mixer = nnx.merge(graphdef, state)
  p = mixer.arrays()
  w_in = fused.kda_input_matrix(p, jnp.float32)
  cols = fused.kda_input_cols(p)
  assert list(cols) == ["w_q", "w_k", "w_v", "w_og_down", "w_beta", "w_g_down"]
  assert w_in.shape == (cfg.d_model, sum(w for _, w in cols.values()))
  for name, (at, width) in cols.items():
    np.testing.assert_array_equal(np.asarray(w_in[:, at:at + width]),
                                  np.asarray(p[name].reshape(cfg.d_model, -1)))
  B = 1
  cache = _randomize(cache_lib.init_cache(cfg, B, 16)[0], SEED + 2)
  x = jax.random.normal(jax.random.key(SEED + 3), (B, 1, cfg.d_model))
  with pytest.raises(ValueError, match="w_in .* is not this layer's kda_input_matrix"):
    fused.kda_step_fused(mixer, x, cache, jnp.ones((B,), jnp.int32), pad=forward_lib.pad_rows,
                         rows=2, interpret=True, w_in=w_in[:, :-1])
  H, K = cache["S"].shape[1:3]
  xw = jnp.zeros((2, w_in.shape[1]), jnp.float32)
  bad = {"q": 0, "k": 0, "v": 0, "beta": w_in.shape[1] - H + 1}
  with pytest.raises(ValueError, match=r"cols\['beta'\]=.* is outside xw"):
    kda_step(cache["S"], xw, bad, cache["conv"], {n: cache["conv"][n][:1] for n in "qkv"},
             jnp.zeros((2, H * K)), p["A_log"], p["dt_bias"], xw, p["o_norm"],
             jnp.ones((B,), jnp.int32), dtype=jnp.float32, scale=1.0, gate_lower_bound=None,
             l2_eps=1e-6, norm_eps=1e-6, interpret=True)
  good = {"q": 0, "k": 0, "v": 0, "beta": 0, "g_down": 0}
  step = lambda z, w_g_up, cols=good: kda_step(
      cache["S"], xw, cols, cache["conv"], {n: cache["conv"][n][:1] for n in "qkv"}, z,
      p["A_log"], p["dt_bias"], xw, p["o_norm"], jnp.ones((B,), jnp.int32), dtype=jnp.float32,
      w_g_up=w_g_up, scale=1.0, gate_lower_bound=None, l2_eps=1e-6, norm_eps=1e-6,
      interpret=True)
  for z, w_g_up in ((None, None), (jnp.zeros((2, H * K)), p["w_g_up"])):
    with pytest.raises(ValueError, match="not both or neither"):
      step(z, w_g_up)
  with pytest.raises(ValueError, match=r"w_g_up .* must be \[K, H, K\]"):
    step(None, p["w_g_up"][:, :1])
  with pytest.raises(ValueError, match=r"cols\['g_down'\]=.* is outside xw"):
    step(None, p["w_g_up"], dict(good, g_down=w_in.shape[1] - K + 1))


def test_mla_input_matrix_columns_and_a_foreign_matrix_refused():
  """The MLA layer's input projections side by side in `mla_input_names`' order (the decode
  step's one GEMM; its values through the whole step: test_decode_padding.py), and a matrix of
  another shape refused by name before anything runs."""
  from sparse_lm.model.mla import MLA  # pylint: disable=g-import-not-at-top
  cfg = get_preset("tiny")
  mixer = MLA(cfg, rngs=nnx.Rngs(SEED))
  w_in = fused.mla_input_matrix(mixer, jnp.float32)
  cols = fused.mla_input_cols(mixer)
  assert list(cols) == ["w_dq", "w_dkv", "w_gate"]
  for name, (at, width) in cols.items():
    np.testing.assert_array_equal(np.asarray(w_in[:, at:at + width]),
                                  np.asarray(getattr(mixer, name)[...].reshape(cfg.d_model, -1)))
  cache = {"c_kv": jnp.zeros((1, 16, cfg.kv_lora_rank)),
           "k_rope": jnp.zeros((1, 16, cfg.qk_rope_head_dim))}
  x = jax.random.normal(jax.random.key(SEED), (1, 1, cfg.d_model))
  with pytest.raises(ValueError, match="w_in .* is not this layer's mla_input_matrix"):
    forward_lib.mla_cached(mixer, x, cache, jnp.zeros((1,), jnp.int32), kv_block=16,
                           w_in=w_in[:, :-1])
