"""Grouped matrix multiply over contiguous expert groups, one entry point per backend.

`gmm(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]`: rows lhs[start_g : start_g +
group_sizes[g]] are multiplied by rhs[g]; rows past sum(group_sizes) give zeros. Backends
(cfg.gmm_backend, ARCHITECTURE §5):
  "ragged_dot": jax.lax.ragged_dot (plain XLA; runs everywhere; the CPU default).
  "tokamax":    tokamax's ragged-dot kernel (Mosaic GPU / TPU; on CPU its XLA fallback). On
                GPU and CPU it runs the forward and the input gradient, with our tiles on
                Hopper (SM90_TILES), and `grouped_weight_grad` (XLA batched matmuls) the weight
                gradient: tokamax 0.0.17's own weight-gradient kernel was measured wrong on an
                H200 (see there). On a TPU host tokamax's own VJP.
                Measured on an H200: 170-320 TFLOP/s versus 5-33 for jax.lax.ragged_dot.
  "megablox":   the Pallas TPU megablox gmm (TPU; interpret mode elsewhere, tests only).
  "blocked":    `blocked_gmm`: groups padded to row blocks, one batched matmul of the blocks
                (plain XLA gathers + einsum). For CPU runs with many small experts, where
                XLA's ragged_dot works densely over the groups: measured 2026-11-30 on one
                CPU core, M=4096 K=32 N=64 G=64, forward + backward 130 ms (ragged_dot) vs
                2.2 ms (`python -m benchmarks.gmm_cpu`; docs/ablations/SIZING.md). Never
                "auto".
  "auto":       ragged_dot on CPU, tokamax on GPU (ragged_dot where tokamax is not installed),
                megablox on TPU.
The backend is resolved for the platform the program is compiled for (`platform`, default the
host's `jax.default_backend()`): an ahead-of-time compile for TPU from a CPU host
(`launch/aot_plan.py`) passes "tpu", and gets the megablox kernel, not XLA's ragged_dot, which
the TPU compiler may expand densely over the groups (72.9 TB of temporaries per chip for the
full model, docs/scaling.md). On TPU, "tokamax" also means megablox when the host is not a TPU
(tokamax picks its kernel from the host's backend), and shapes that Mosaic cannot tile (K or
N not a multiple of 128) use ragged_dot. Under a mesh, Mosaic kernels must run inside a
`shard_map` (`moe/expert_parallel.py` calls `gmm` there).
The "dense" reference (every expert on every token) lives in `latent_moe.dense_reference`,
because it is not a grouped matmul.
"""

from __future__ import annotations

import importlib.util
import math

import jax
import jax.numpy as jnp

from pallas_kernels.attention.tokamax import tokamax_flags
from pallas_kernels.platform import compute_capability

GMM_IMPLS = ("ragged_dot", "tokamax", "megablox", "blocked")


def resolve_backend(backend: str, platform: str | None = None, *, k: int = 128,
                    n: int = 128) -> str:
  """Concrete backend for `backend` on `platform` ("cpu", "gpu"/"cuda", "tpu"; default the
  host's), for a [., k] x [G, k, n] product (see the module docstring)."""
  host = jax.default_backend()
  platform = platform or host
  if platform == "tpu":
    if backend in ("auto", "megablox") or (backend == "tokamax" and host != "tpu"):
      return "megablox" if k % 128 == 0 and n % 128 == 0 else "ragged_dot"
    return backend
  if backend == "auto":
    return "tokamax" if platform != "cpu" and have_tokamax() else "ragged_dot"
  return backend


def have_tokamax() -> bool:
  """Whether tokamax is installed (a GPU image may lack it: `benchmarks/gpu_setup.sh`)."""
  return importlib.util.find_spec("tokamax") is not None


def _live_rows(m: int, group_sizes: jax.Array) -> jax.Array:
  """[m, 1] bool: the rows a grouped matmul covers (row < sum(group_sizes))."""
  return jnp.arange(m, dtype=jnp.int32)[:, None] < jnp.sum(group_sizes)


def _keep_live(x: jax.Array, live: jax.Array) -> jax.Array:
  """x with the rows past the groups set to 0 by a `where` (a multiply would keep a NaN)."""
  return jnp.where(live, x, jnp.zeros((), x.dtype))


# Tiles for tokamax's Mosaic GPU grouped-matmul kernel on Hopper (sm90), in place of the
# tokamax 0.0.17 sm90 heuristic (block_m 64, block_n 64, block_k 128, 2 stages), which it uses
# on an H200 (its autotuning cache has H100 entries only). They serve the forward and the
# backward's d_lhs (a forward of the transposed weight). Chosen at the `small` preset's expert
# shapes on an H200 (`python -m benchmarks.gmm_configs`; docs/benchmarks.md, "tokamax's
# grouped-matmul tiles"). None: tokamax chooses (its cache or heuristic).
SM90_TILES: dict[str, int | bool | str] | None = dict(
    block_m=128, block_n=64, block_k=64, num_stages=3, persistent=False, grid_minor_dim="M",
    grid_tile_width=4)


def _use_sm90_tiles(lhs: jax.Array, rhs: jax.Array) -> bool:
  """SM90_TILES apply: a Hopper GPU, bf16 operands, K and N multiples of 128 and 64 (other
  shapes and dtypes keep tokamax's own choice)."""
  if SM90_TILES is None or jax.default_backend() != "gpu":
    return False
  cc = compute_capability(jax.devices()[0])
  return (9.0 <= cc < 10.0 and lhs.dtype == jnp.bfloat16 and rhs.dtype == jnp.bfloat16
          and lhs.shape[1] % 128 == 0 and rhs.shape[-1] % 64 == 0)


def _tokamax_forward(lhs, rhs, group_sizes):
  """tokamax's ragged-dot kernel, forward only: SM90_TILES where they fit, else tokamax's own
  choice (on the CPU its XLA fallback)."""
  # tokamax reads its config from absl flags and, when the host program never parsed them
  # (pytest, argparse scripts), parses sys.argv itself and fails on foreign options: the flag
  # defaults are used then (programs run through absl.app keep their parsed flags). Also one
  # autotuning-cache-miss warning per op instead of one per call site.
  tokamax_flags()
  if _use_sm90_tiles(lhs, rhs):
    # tokamax.ops.gpu exports this class but imports jax_triton for its Triton ops, which the
    # GPU image lacks: the Mosaic GPU module is imported directly
    # pylint: disable-next=g-import-not-at-top
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as pmg
    tiles = dict(SM90_TILES, grid_minor_dim=pmg.common.MatmulDimension[
        SM90_TILES["grid_minor_dim"]])
    op = pmg.PallasMosaicGpuRaggedDot(config=pmg.Config(split_k=1, **tiles))
    return op(lhs, rhs, group_sizes=group_sizes, preferred_element_type=lhs.dtype)
  import tokamax  # pylint: disable=g-import-not-at-top
  impl = "xla" if jax.default_backend() == "cpu" else None
  return tokamax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype,
                            implementation=impl)


@jax.custom_vjp
def _tokamax_kernel(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N] on tokamax's kernel,
  with our VJP: d_lhs = ragged_dot(d_out, rhsᵀ) on the same kernel, d_rhs from
  `grouped_weight_grad` (XLA batched matmuls), not tokamax's weight-gradient kernel (why:
  see there). Rows past sum(group_sizes) of the output and of d_lhs are not written by the
  kernel: callers clear them (`_tokamax_ragged_dot`) or cover them (`gmm(rows_covered=True)`).
  Under `shard_map(check_vma=True)`, lhs and rhs must vary over the same mesh axes (the VJP
  returns each cotangent with its input's type; `expert_parallel` runs with check_vma=False).
  d_rhs is accumulated in fp32 and returned in rhs's dtype (bf16 under `gmm`, as XLA's
  ragged_dot gradient is).
  """
  return _tokamax_forward(lhs, rhs, group_sizes)


def _tokamax_fwd(lhs, rhs, group_sizes):
  return _tokamax_forward(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _tokamax_bwd(res, dout):
  lhs, rhs, group_sizes = res
  dout = dout.astype(lhs.dtype)
  dlhs = _tokamax_forward(dout, jnp.swapaxes(rhs, 1, 2), group_sizes)
  drhs = grouped_weight_grad(lhs, dout, group_sizes, out_dtype=rhs.dtype)
  return dlhs, drhs, None


_tokamax_kernel.defvjp(_tokamax_fwd, _tokamax_bwd)


def _tokamax_dot(lhs, rhs, group_sizes):
  """`_tokamax_kernel` (our VJP) on GPU and CPU; on a TPU host tokamax's own ragged dot with
  its own VJP: the wrong weight gradient was measured on an H200 (the TPU kernels were not
  checked here), and `grouped_weight_grad`'s segment sum would be a scatter, which the TPU
  compiler implements as a sort."""
  if jax.default_backend() == "tpu":
    return _tokamax_forward(lhs, rhs, group_sizes)
  return _tokamax_kernel(lhs, rhs, group_sizes)


def _tokamax_ragged_dot(lhs, rhs, group_sizes):
  """tokamax's ragged_dot with rows past sum(group_sizes) set to zero, in value and gradient.

  Its Mosaic GPU kernel writes each group's rows and nothing else: the rows past the sum (the
  padding tokens' sentinel rows, an expert-parallel receive buffer's unused tail) are whatever
  the output buffer held. Multiplying them by a zero gate does not clear a NaN there, so a
  `where` on both sides (the output, and the input, whose `where` also clears the gradient
  kernel's unwritten rows) keeps them out. Without it the `small` train step on real batches
  (rows with padding) gave a NaN loss on the H200 while synthetic rows (no padding) did not.
  """
  live = _live_rows(lhs.shape[0], group_sizes)
  return _keep_live(_tokamax_dot(_keep_live(lhs, live), rhs, group_sizes), live)


def _tile(dim: int, prefs=(512, 256, 128)) -> int:
  return next((t for t in prefs if dim % t == 0), dim)


def _megablox_gmm(lhs, rhs, group_sizes, interpret: bool, mask: bool = True):
  """Pallas megablox gmm (compiled for TPU; Pallas interpret mode elsewhere, tests only).

  megablox needs M divisible by the row tile, so rows are padded; rows past sum(group_sizes)
  are not written by the kernel and are zeroed here (`mask`; False when the groups cover all
  M rows: then only the padding rows are unwritten, and they are sliced off).
  """
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm
  m, k = lhs.shape
  n = rhs.shape[-1]
  tm = 512 if m >= 512 else 128 if m >= 128 else -(-m // 8) * 8
  m_pad = -(-m // tm) * tm
  # Mask on both sides: the forward kernel leaves rows past sum(group_sizes) unwritten, and so
  # does its lhs-gradient kernel; a `where` (not a multiply) keeps that garbage out of both.
  live = _live_rows(m, group_sizes)
  lhs_p = jnp.pad(_keep_live(lhs, live) if mask else lhs, ((0, m_pad - m), (0, 0)))
  out = megablox_gmm(lhs_p, rhs, group_sizes, preferred_element_type=lhs.dtype,
                     tiling=(tm, _tile(k), _tile(n)),
                     interpret=interpret)[:m]
  return _keep_live(out, live) if mask else out


def _group_blocks(group_sizes: jax.Array, m: int, block: int):
  """Each group's rows padded to a multiple of `block`: (nb, slot_group [nb·block], valid,
  src, pad_starts [G], starts [G]). Slot p holds row src[p] of group slot_group[p] when
  valid[p]; nb = ceil(m / block) + G is a static bound on the blocks needed."""
  g = group_sizes.shape[0]
  nb = -(-m // block) + g  # static bound on sum_g ceil(size_g / block)
  sizes = group_sizes.astype(jnp.int32)
  starts = jnp.cumsum(sizes) - sizes
  padded = -(-sizes // block) * block
  pad_ends = jnp.cumsum(padded)
  pad_starts = pad_ends - padded
  # padded slot p -> its group, its source row and whether it holds a row
  slot = jnp.arange(nb * block, dtype=jnp.int32)
  slot_group = jnp.minimum(jnp.searchsorted(pad_ends, slot, side="right"), g - 1)
  pos = slot - pad_starts[slot_group]
  valid = (pos < sizes[slot_group]) & (slot < pad_ends[-1])
  src = jnp.where(valid, starts[slot_group] + pos, 0)
  return nb, slot_group, valid, src, pad_starts, starts


def grouped_weight_grad(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, *,
                        block: int = 1024, out_dtype=None, max_bytes: int = 1 << 30
                        ) -> jax.Array:
  """The weight gradient of a grouped matmul: out[g] = lhs_gᵀ dout_g, [G, K, N].

  lhs_g, dout_g are the rows start_g .. start_g + group_sizes[g] of lhs [M, K] and dout
  [M, N] (rows sorted by group; rows past sum(group_sizes) are ignored even if they hold
  NaN). Each group's rows are gathered into blocks of `block` rows (zero-padded, one group
  per block), every block's product is one batched matmul with fp32 accumulation, and the
  blocks of a group are summed (a sorted segment sum). Work about (M + G·block)·K·N (the
  passes below add at most one block per pass); memory: the block products in fp32, nb·K·N
  for nb = ceil(M / block) + G blocks, taken in equal passes of at most `max_bytes` (a scan
  when one pass does not hold them all), each pass's gathered rows, per_pass·block·(K + N) in
  lhs's dtype, and the [G, K, N] fp32 sum. dout is cast to lhs's dtype before the products.
  On a GPU the segment sum is a scatter-add, which XLA may run with atomics: not bit for bit
  reproducible between runs unless `--xla_gpu_deterministic_ops`.

  Why not tokamax's `ragged_contracting_dim_dot` kernel (what `tokamax.ragged_dot`'s VJP
  runs): in tokamax 0.0.17 on an H200, at the `small` preset's shapes, its sm90 kernel gave
  weight gradients up to 8% (of the largest entry) away from an exact fp32 reference, in
  most groups, at its own heuristic tiles, and 1e17 away with block_k = 64, while XLA's
  `ragged_dot_general` agreed with the reference to 1e-5 (docs/benchmarks.md, "tokamax's
  grouped-matmul tiles").

  Args:
    lhs: [M, K]; dout: [M, N]; group_sizes: [G] integer, sum <= M.
    block: rows per block (>= 1; capped at M rounded up to 8).
    out_dtype: result dtype (default lhs's).
    max_bytes: bound on the fp32 block products held at once (at least one block's).

  Returns:
    [G, K, N] in out_dtype; a group without rows gets zeros.

  Raises:
    ValueError: lhs or dout not 2-D, their M differ, group_sizes not 1-D, block < 1 or
      max_bytes < 1.
  """
  if max_bytes < 1:
    raise ValueError(f"grouped_weight_grad: max_bytes must be >= 1, got {max_bytes}")
  if lhs.ndim != 2 or dout.ndim != 2 or lhs.shape[0] != dout.shape[0]:
    raise ValueError(f"grouped_weight_grad: lhs [M, K] and dout [M, N] with the same M; got "
                     f"lhs {lhs.shape}, dout {dout.shape}")
  if group_sizes.ndim != 1:
    raise ValueError(f"grouped_weight_grad: group_sizes must be [G], got {group_sizes.shape}")
  if block < 1:
    raise ValueError(f"grouped_weight_grad: block must be >= 1, got {block}")
  m, k = lhs.shape
  n = dout.shape[1]
  g = group_sizes.shape[0]
  if 0 in (m, k, n, g):
    return jnp.zeros((g, k, n), out_dtype or lhs.dtype)
  block = min(block, -(-m // 8) * 8)
  nb, slot_group, valid, src, _, _ = _group_blocks(group_sizes, m, block)
  # blocks per pass: their fp32 products stay under max_bytes (one pass at the `small` preset)
  passes = -(-nb // max(1, min(nb, max_bytes // (4 * k * n))))
  per_pass = -(-nb // passes)  # equal passes: the last one pads fewer than `passes` blocks
  pad = passes * per_pass - nb  # empty blocks (all invalid) in the last group
  valid = jnp.pad(valid, (0, pad * block)).reshape(passes, per_pass * block)
  src = jnp.pad(src, (0, pad * block)).reshape(passes, per_pass * block)
  block_group = jnp.pad(slot_group[::block], (0, pad), constant_values=g - 1).reshape(
      passes, per_pass)

  def one_pass(acc, xs):
    ok, rows, groups = xs
    x = jnp.where(ok[:, None], lhs[rows], 0).reshape(per_pass, block, k)
    d = jnp.where(ok[:, None], dout[rows].astype(lhs.dtype), 0).reshape(per_pass, block, n)
    p = jnp.einsum("bck,bcn->bkn", x, d, preferred_element_type=jnp.float32)
    return acc + jax.ops.segment_sum(p, groups, num_segments=g, indices_are_sorted=True), None

  acc = jnp.zeros((g, k, n), jnp.float32)
  if passes == 1:
    acc, _ = one_pass(acc, (valid[0], src[0], block_group[0]))
  else:
    acc, _ = jax.lax.scan(one_pass, acc, (valid, src, block_group))
  return acc.astype(out_dtype or lhs.dtype)


def blocked_gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                block: int | None = None) -> jax.Array:
  """`gmm` as one batched matmul over row blocks that each belong to one group.

  Each group's rows are padded to a multiple of `block` (zeros); block β, of group g(β),
  is multiplied by rhs[g(β)]. Work ~ (M + G·block)·K·N instead of ragged_dot's dense M·G·K·N on
  CPU. Exact (same products, fp32 accumulation); differentiable through its gathers.

  Args:
    lhs: [M, K]; rhs: [G, K, N]; group_sizes: [G] int32 with sum <= M (rows past the sum -> 0).
    block: rows per block (default: a power of two near M / (2 G), in [8, 128]).

  Returns:
    [M, N] in lhs's dtype.

  Raises:
    ValueError: lhs not 2-D, rhs not 3-D, their K differ, group_sizes not [G], or block < 1.
  """
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
    raise ValueError(f"blocked_gmm: lhs must be [M, K] and rhs [G, K, N] with the same K; got "
                     f"lhs {lhs.shape}, rhs {rhs.shape}")
  if group_sizes.shape != (rhs.shape[0],):
    raise ValueError(f"blocked_gmm: group_sizes must be [G] = [{rhs.shape[0]}], got "
                     f"{group_sizes.shape}")
  if block is not None and block < 1:
    raise ValueError(f"blocked_gmm: block must be >= 1, got {block}")
  m, k = lhs.shape
  g, _, n = rhs.shape
  if block is None:
    block = int(min(128, max(8, 2 ** round(math.log2(max(m / (2 * g), 1))))))
  nb, slot_group, valid, src, pad_starts, starts = _group_blocks(group_sizes, m, block)
  sizes = group_sizes.astype(jnp.int32)
  x = jnp.where(valid[:, None], lhs[src], 0).reshape(nb, block, k)
  w = rhs[slot_group[::block]]  # [nb, K, N]
  y = jnp.einsum("bck,bkn->bcn", x, w, preferred_element_type=jnp.float32).reshape(nb * block, n)
  # row i -> its padded slot
  row = jnp.arange(m, dtype=jnp.int32)
  row_group = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), row, side="right"), g - 1)
  dest = pad_starts[row_group] + row - starts[row_group]
  live = row < jnp.sum(sizes)
  return jnp.where(live[:, None], y[jnp.where(live, dest, 0)], 0).astype(lhs.dtype)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
        backend: str = "auto", platform: str | None = None,
        rows_covered: bool = False) -> jax.Array:
  """Grouped matmul; see the module docstring.

  Args:
    lhs: [M, K] rows sorted by group; rhs: [G, K, N] (cast to lhs's dtype);
    group_sizes: [G] int32 with sum <= M.
    backend: "auto", "ragged_dot", "tokamax", "megablox" or "blocked".
    platform: the platform the program is compiled for (e.g. a mesh's
      `devices.flat[0].platform`); default the host's `jax.default_backend()`.
    rows_covered: the caller guarantees sum(group_sizes) == M (every row in a group): the
      tokamax and megablox paths then skip the `where` masks that clear the rows past the
      sum (two passes over lhs and out, forward and backward). With rows left over, those
      rows would be whatever the kernel's buffers held.

  Returns:
    [M, N] in lhs's dtype (accumulated in fp32 by every backend).

  Raises:
    ValueError: unknown backend.
  """
  platform = platform or jax.default_backend()
  backend = resolve_backend(backend, platform, k=lhs.shape[1], n=rhs.shape[-1])
  rhs = rhs.astype(lhs.dtype)
  group_sizes = group_sizes.astype(jnp.int32)
  if backend == "ragged_dot":
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype)
  if backend == "tokamax":
    if rows_covered:
      return _tokamax_dot(lhs, rhs, group_sizes)
    return _tokamax_ragged_dot(lhs, rhs, group_sizes)
  if backend == "blocked":
    return blocked_gmm(lhs, rhs, group_sizes)
  if backend == "megablox":
    return _megablox_gmm(lhs, rhs, group_sizes, interpret=platform != "tpu",
                         mask=not rows_covered)
  raise ValueError(f"unknown gmm backend {backend!r}; choose one of {('auto',) + GMM_IMPLS}")
