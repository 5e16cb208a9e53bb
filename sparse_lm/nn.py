"""Shared building blocks of model/, moe/ and vision/ (the bottom floor, beside config.py):
parameters with logical axes and their initialisers, projections, RMSNorm / L2 norm,
embeddings, remat policies and layer stacking.

Every parameter is born with its logical axis names (MaxText style) stored as the
`out_sharding` metadata of the `nnx.Param`; `sparse_lm.sharding` maps those names to mesh axes
(`nnx.get_partition_spec(state)` then resolves them). Layers stacked with `nnx.vmap` get the
leading `layers` axis through `transform_metadata`.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from sparse_lm import sharding
from sparse_lm.config import ModelConfig

Initializer = Callable[[jax.Array, tuple[int, ...]], jax.Array]


def _concrete(key) -> bool:
  return not isinstance(key, jax.core.Tracer)


def numpy_rng(key: jax.Array) -> np.random.Generator:
  """A NumPy generator seeded by a concrete jax key.

  Eager `jax.random.normal` compiles one program per parameter shape, which made building the
  tiny model take ~20 s of CPU; NumPy sampling costs nothing to compile. Under tracing
  (`nnx.eval_shape`, `nnx.jit`) the initialisers use `jax.random` instead.
  """
  data = np.asarray(jax.random.key_data(key)).astype(np.uint64).ravel()
  return np.random.default_rng([int(d) for d in data])


def normal_init(std: float) -> Initializer:
  """normal(0, std) as fp32 of `shape`: NumPy's generator seeded by the key's data for a
  concrete key (fast eager init), `jax.random.normal` under a trace."""
  def init(key, shape):
    if _concrete(key):
      return jnp.asarray(std * numpy_rng(key).standard_normal(shape, np.float32))
    return std * jax.random.normal(key, shape, jnp.float32)
  return init


def jax_normal_init(std: float) -> Initializer:
  """normal(0, std) drawn by `jax.random` even for concrete keys (the MoE weights' initialiser:
  kept so that a seed gives the same experts and routers as before `normal_init` went NumPy)."""
  def init(key, shape):
    return std * jax.random.normal(key, shape, jnp.float32)
  return init


def uniform_init(lo: float, hi: float) -> Initializer:
  """uniform[lo, hi) as fp32 of `shape`, drawn like `normal_init` (NumPy for a concrete key)."""
  def init(key, shape):
    if _concrete(key):
      return jnp.asarray(numpy_rng(key).uniform(lo, hi, shape).astype(np.float32))
    return jax.random.uniform(key, shape, jnp.float32, lo, hi)
  return init


def zeros_init(key, shape):
  """fp32 zeros of `shape` (`key` unused)."""
  del key
  return jnp.zeros(shape, jnp.float32)


def ones_init(key, shape):
  """fp32 ones of `shape` (`key` unused)."""
  del key
  return jnp.ones(shape, jnp.float32)


def param(rngs: nnx.Rngs, shape: Sequence[int], names: Sequence[str | None], *,
          init: Initializer, dtype=jnp.float32, variable=nnx.Param) -> nnx.Variable:
  """A parameter of `shape` created by `init` (fp32) and cast to `dtype`.

  Args:
    rngs: source of the `params` key.
    shape: parameter shape.
    names: one logical axis name per dimension (`embed`, `heads`, `kv`, ...).
    init: `init(key, shape) -> fp32 array`.
    dtype: storage dtype (cfg.param_dtype for weights; fp32 for gates/norms/pseudo-queries).
    variable: the Variable class (nnx.Param by default).

  Raises:
    ValueError: len(names) != len(shape).
  """
  shape = tuple(int(s) for s in shape)
  if len(names) != len(shape):
    raise ValueError(f"param shape {shape} needs {len(shape)} axis names, got {tuple(names)}")
  value = init(rngs.params(), shape).astype(dtype)
  return variable(value, out_sharding=tuple(names), eager_sharding=False)


def dense_param(rngs: nnx.Rngs, in_shape: Sequence[int], out_shape: Sequence[int],
                names: Sequence[str | None], cfg: ModelConfig, *, std: float | None = None):
  """A projection kernel [*in_shape, *out_shape], normal(0, std) with std = cfg.init_std."""
  std = cfg.init_std if std is None else std
  return param(rngs, (*in_shape, *out_shape), names, init=normal_init(std),
               dtype=jnp.dtype(cfg.param_dtype))


def project(x: jax.Array, kernel: jax.Array, n_in: int = 1, *, dtype=None,
            out_dtype=None) -> jax.Array:
  """Contract the last `n_in` dims of x with the first `n_in` dims of kernel.

  x [..., *in] @ kernel [*in, *out] -> [..., *out], computed in `dtype` (default x.dtype)
  with fp32 accumulation; returned in `out_dtype` (default `dtype`).

  Backward: with a 16-bit float `dtype` and `out_dtype == dtype`, the cotangent of the output
  is a 16-bit array, and the two backward products take it as one (`_project_lowp`): autodiff
  of the plain product would hand them an fp32 copy of it, which XLA:GPU runs as an fp32
  (TF32) GEMM at half the bf16 rate (on an H200 the `small` step's TF32 GEMMs went from about
  122 to 69 ms, the step from 1,409 to 1,346 ms: docs/benchmarks.md). The products are the
  same: the cotangent and both operands are exact in either type and the accumulation stays
  fp32; results differ only in summation order. An fp32 `out_dtype` (the LM head's logits,
  the sigmoid gates, the vision encoder's residual projections) keeps the plain product, whose
  cotangent is genuinely fp32.

  Limits of the 16-bit path (a custom VJP): no forward-mode autodiff (`jax.jvp`, `jacfwd`);
  inside a `shard_map` with `check_vma=True` and operands that vary over different mesh axes
  its cotangents raise a type error (every `shard_map` here runs with `check_vma=False`); the
  remat policies save its bf16 output by name (`remat_policy`).
  """
  dtype = jnp.dtype(x.dtype if dtype is None else dtype)
  out_dtype = dtype if out_dtype is None else jnp.dtype(out_dtype)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2 and out_dtype == dtype:
    return _project_lowp(x, kernel, n_in, dtype)
  return _product(x.astype(dtype), kernel.astype(dtype), n_in).astype(out_dtype)


def _product(xc, kc, n_in):
  """fp32 xc [..., *in] @ kc [*in, *out] over the last n_in dims of xc."""
  nx = xc.ndim
  return jax.lax.dot_general(xc, kc, ((tuple(range(nx - n_in, nx)), tuple(range(n_in))), ((), ())),
                             preferred_element_type=jnp.float32)


def _project_lowp(x, kernel, n_in, dtype):
  """`project` with a 16-bit dtype and output; backward products on 16-bit operands."""
  return _project_lowp_vjp(x, kernel, n_in, dtype, x.dtype, kernel.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _project_lowp_vjp(x, kernel, n_in, dtype, x_dtype, k_dtype):
  del x_dtype, k_dtype  # the cotangents' dtypes (the backward's)
  return checkpoint_name(_product(x.astype(dtype), kernel.astype(dtype), n_in).astype(dtype),
                         PROJECT_NAME)


def _project_lowp_fwd(x, kernel, n_in, dtype, x_dtype, k_dtype):
  del x_dtype, k_dtype
  xc, kc = x.astype(dtype), kernel.astype(dtype)  # what autodiff of the plain product keeps
  return checkpoint_name(_product(xc, kc, n_in).astype(dtype), PROJECT_NAME), (xc, kc)


def _project_lowp_bwd(n_in, dtype, x_dtype, k_dtype, res, ct):
  xc, kc = res
  ct = ct.astype(dtype)  # exact: the output's cotangent has the output's dtype
  nb = xc.ndim - n_in  # batch dims of x
  n_out = kc.ndim - n_in
  # dx [..., *in] = ct [..., *out] . kernel [*in, *out] over *out
  dx = jax.lax.dot_general(ct, kc, ((tuple(range(nb, nb + n_out)),
                                     tuple(range(n_in, n_in + n_out))), ((), ())),
                           preferred_element_type=jnp.float32)
  # dkernel [*in, *out] = x [..., *in] . ct [..., *out] over the batch dims
  dk = jax.lax.dot_general(xc, ct, ((tuple(range(nb)), tuple(range(nb))), ((), ())),
                           preferred_element_type=jnp.float32)
  # through `dtype`, as autodiff of the casts in the plain product rounds them
  return dx.astype(dtype).astype(x_dtype), dk.astype(dtype).astype(k_dtype)


_project_lowp_vjp.defvjp(_project_lowp_fwd, _project_lowp_bwd)

# The name `project` gives its 16-bit outputs (`checkpoint_name`): a custom VJP hides its
# product from the dot-based remat policies, which save it by this name instead (`remat_policy`).
PROJECT_NAME = "project"


def rms_norm(x: jax.Array, scale: jax.Array | None = None, eps: float = 1e-6, *,
             square: bool = False) -> jax.Array:
  """RMSNorm over the last axis in fp32: x / sqrt(mean(x^2) + eps) * scale.

  x^2 is `x * x`, or `jnp.square(x)` when `square` (the LatentMoE latent norm's form since it
  was written). Same forward; the gradients round differently (x g + g x, which XLA CPU may
  contract into an FMA, against 2 x g), so each caller keeps its own form and its numbers.

  Returns fp32 (callers cast to their compute dtype).
  """
  x = x.astype(jnp.float32)
  x2 = jnp.square(x) if square else x * x
  y = x * jax.lax.rsqrt(jnp.mean(x2, axis=-1, keepdims=True) + eps)
  if scale is not None:
    y = y * scale.astype(jnp.float32)
  return y


def l2_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / sqrt(sum(x^2) + eps) over the last axis, in fp32 (Kimi Linear's q/k L2Norm)."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
  """RMSNorm with a learned per-channel scale (init 1, fp32, axis name `norm`)."""

  def __init__(self, dim: int, *, cfg: ModelConfig, rngs: nnx.Rngs, eps: float | None = None):
    self.eps = cfg.norm_eps if eps is None else eps
    self.scale = param(rngs, (dim,), ("norm",), init=ones_init, dtype=jnp.float32)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., dim] -> fp32 [..., dim]."""
    return rms_norm(x, self.scale[...], self.eps)


class Embed(nnx.Module):
  """Token embedding table [vocab, embed] (axes `vocab`, `embed`), normal(0, 1) init.

  Unit-variance embeddings so that the residual sources of AttnRes start at RMS ~1 (the sources
  are RMS-normalised for the logits only, so the scale matters for the mixed values).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.embedding = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                           init=normal_init(1.0), dtype=jnp.dtype(cfg.param_dtype))

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] int32 -> [B, T, D] fp32 (`embedding_lookup`)."""
    return embedding_lookup(self.embedding[...], tokens).astype(jnp.float32)


def embedding_lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
  """table[tokens]: table [V, D], tokens [...] int -> [..., D] in table.dtype.

  The forward is `jnp.take` on the table as it is sharded (decode gathers no weight). The
  backward is the usual scatter-add of the cotangent rows, laid out explicitly under a mesh:
  into a gradient buffer gathered over the table's ZeRO axes (d_model whole, the vocabulary
  split as the rules say), each batch shard adding its own rows, then summed over them. Left
  to the partitioner, jax 0.11.2 moved the [B, T, D] cotangent from the batch split to the
  table's d_model split as an "involuntary full rematerialization"
  (tests/vision/test_vision_multidevice.py). Without a mesh the constraint is the identity.
  Memory under a mesh: the gradient buffer, vocab / tensor x d_model, in the backward pass.
  """
  return _lookup(table, tokens)


@jax.custom_vjp
def _lookup(table, tokens):
  return jnp.take(table, tokens, axis=0)


def _lookup_fwd(table, tokens):
  # The residual carries the table's row count and dtype as a [V, 0] array (no data).
  return _lookup(table, tokens), (tokens, jnp.zeros((table.shape[0], 0), table.dtype))


def _lookup_bwd(res, ct):
  tokens, rows = res
  grad = jnp.zeros((rows.shape[0], ct.shape[-1]), ct.dtype)
  grad = sharding.constrain(grad, ("vocab", None))
  return grad.at[tokens].add(ct).astype(rows.dtype), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def assign(variable: nnx.Variable, value) -> None:
  """`variable[...] = value` for a whole-array replacement, cast to the variable's dtype.

  Same result as flax's `variable[...] = value` when the shapes match, without its check of
  `value.sharding`: under a trace that check raises and catches an error whose message walks
  the whole trace (about 0.2 s per assignment in the tiny train step, 6 of its 8 s of tracing;
  measured 2026-12-01 with flax 0.12.8).

  Raises:
    ValueError: value's shape differs from the variable's.
  """
  old = variable[...]
  value = jnp.asarray(value)
  if value.shape != old.shape:
    raise ValueError(f"assign: value of shape {value.shape} for a variable of shape "
                     f"{old.shape}")
  variable.set_value(value.astype(old.dtype))


# `jax.ad_checkpoint.checkpoint_name`s of the hand-written kernels' work, saved by the remat
# policies "save_kda" and "save_kda_experts". KDA_OPERATOR_NAME is the string of
# `pallas_kernels.kda.tiles.SAVE_NAME` (pallas_kernels imports nothing of sparse_lm; a test
# checks the two agree); EXPERT_MATMUL_NAME names the routed experts' grouped-matmul outputs
# (sparse_lm.moe.latent_moe.sorted_dispatch, expert_parallel.expert_ffn_local).
KDA_OPERATOR_NAME = "kda_operator"
EXPERT_MATMUL_NAME = "moe_expert_matmul"


def remat_policy(name: str):
  """The `jax.checkpoint` policy for cfg.remat_policy, or None for "none" (no remat).

  "full": save nothing, recompute the whole layer group in the backward pass.
  "save_dots": save every matmul output (including batched ones such as attention scores).
  "minimal": save matmuls without batch dims (the projections), recompute the rest.
  "save_qkv_proj": save only the outputs tagged `query_proj`, `key_proj`, `value_proj`,
    `out_proj` with `jax.ad_checkpoint.checkpoint_name`.
  "save_kda": as "full", but keep what the KDA Pallas backends' forward makes for their
    backward (KDA_OPERATOR_NAME: the output, the intra-chunk outputs and
    residuals, the chunk states), so the recompute skips the operator's forward kernels.
    Costs about 2.7 KB per token and head per KDA layer with pallas_gpu's bf16 storage
    (K = V = 128, chunk 64: W, U, Q ⊙ Γ, Kd, V', o: 6 · 128 bf16; H_n: K·V / 64 bf16; A_qk:
    64 bf16; X, S_k: 2 · 64 fp32), 1.4 GB per layer of the `small` preset at 8 x 8,192
    tokens. With the "xla" backend only the output is named and the policy saves little.
  "save_kda_experts": "save_kda", and the routed experts' three grouped-matmul outputs
    (EXPERT_MATMUL_NAME; the SiTU activation is recomputed from two of them):
    (2 F + L) values per assignment, 1.3 GB per MoE layer of `small` at 8 x 8,192 tokens.

  Raises:
    ValueError: unknown policy name.
  """
  cp = jax.checkpoint_policies
  if name == "none":
    return None
  if name == "full":
    return cp.nothing_saveable
  # `project`'s 16-bit products sit inside a custom VJP, out of the dot policies' sight: they
  # are saved by name, as their 16-bit outputs (the plain product's saved output was fp32)
  if name == "save_dots":
    return cp.save_from_both_policies(cp.checkpoint_dots, cp.save_only_these_names(PROJECT_NAME))
  if name == "minimal":
    return cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable,
                                      cp.save_only_these_names(PROJECT_NAME))
  if name == "save_qkv_proj":
    return cp.save_only_these_names("query_proj", "key_proj", "value_proj", "out_proj")
  if name == "save_kda":
    return cp.save_only_these_names(KDA_OPERATOR_NAME)
  if name == "save_kda_experts":
    return cp.save_only_these_names(KDA_OPERATOR_NAME, EXPERT_MATMUL_NAME)
  raise ValueError(f"unknown remat_policy {name!r}")


def fan_in_std(fan_in: int) -> float:
  """1 / sqrt(fan_in): the std of a weight that keeps unit-variance inputs at unit variance."""
  return 1.0 / math.sqrt(fan_in)


def stack_modules(modules: Sequence[nnx.Module]) -> nnx.Module:
  """Identical modules -> one module whose every variable has a leading `layers` axis.

  The variables' logical axis names get "layers" prepended (what `nnx.vmap(transform_metadata=
  ...)` does), so `sharding.state_shardings` sees the stacked axis. Used for the scanned layer
  groups of the decoder and the vision encoder's blocks.
  """
  graphdef, _ = nnx.split(modules[0])
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.split(m)[1] for m in modules])
  out = nnx.merge(graphdef, stacked)
  for _, node in nnx.iter_graph(out):
    if isinstance(node, nnx.Variable):
      names = node.get_metadata().get("out_sharding")
      if names is not None:
        node.set_metadata(out_sharding=("layers", *names))
  return out
