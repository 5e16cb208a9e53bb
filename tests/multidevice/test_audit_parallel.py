"""Audit tests of expert and context parallelism on 8 fake CPU devices, against NumPy written
from the definitions (never the code under test for the expected values).

Each test runs its check in a fresh interpreter (as the other files of tests/multidevice do via
`_subproc.run_script`): XLA_FLAGS must hold the device count before jax is imported, and
pytest's process has imported jax already (conftest).

- The "ragged" exchange of `ep_dispatch_and_compute`. XLA:CPU has no ragged_all_to_all, so no
  CPU test ran this path (ep_check.py runs it only on two real GPUs). Here
  `jax.lax.ragged_all_to_all` is replaced by an emulation written from its documented
  semantics (all-gather of the operands; sender i's rows input_offsets_i[me] + t, t <
  send_sizes_i[me], land at output_offsets_i[me] + t on receiver me; rows not written keep
  `output`; a receiver whose recv_sizes disagree with what its senders send gets NaN). The
  outputs, the drop counts and the receive-row metrics are compared with NumPy, with and
  without the receive cap, and the "dense" exchange is held to the same metrics.
- Context-parallel KDA (`cp_chunk_kda`, both folds) on packed rows where a shard starts with
  padding right after a document (padding is an identity step that carries the state; it must
  not reset it) and where a document starts exactly on a shard boundary, against the naive
  recurrence of ARCHITECTURE §2.1 in float64 NumPy: outputs and final state.
- `make_mesh` of a multislice layout on devices without slice ids (CPU): slices are
  consecutive device blocks and each mesh axis is (dcn major, ici minor).
- The logical-axis rules (abstract meshes, in-process): a mesh axis used once per spec (first
  claim wins), mesh-axis names mapping to themselves, the expert weights' latent dim over
  fsdp x context from the table alone, and `MeshLayout.parse` giving "the rest" to the axis
  set to -1 (fsdp then 1).
"""

import os
import pathlib
import subprocess
import sys
import textwrap

from tests._xla_flags import with_devices

ROOT = pathlib.Path(__file__).resolve().parents[2]

_PRELUDE = """
import os
os.environ["XLA_FLAGS"] = {flags!r}
os.environ["JAX_PLATFORMS"] = "cpu"
import math
import jax
import jax.numpy as jnp
import numpy as np
"""


def _run(body: str, timeout: int = 300) -> str:
  code = _PRELUDE.format(flags=with_devices(8)) + textwrap.dedent(body)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=with_devices(8))
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout)
  out = proc.stdout + proc.stderr
  print(proc.stdout)
  assert proc.returncode == 0, out[-6000:]
  return proc.stdout


EP_BODY = """
from sparse_lm import sharding as shd
from sparse_lm.moe import expert_parallel as ep
from tests.multidevice.scripts.ep_rule import virtual_keep  # the cap rule, numpy loops


def fake_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                           recv_sizes, *, axis_name, axis_index_groups=None):
  assert axis_index_groups is None
  P = jax.lax.axis_size(axis_name)
  me = jax.lax.axis_index(axis_name)
  ops = jax.lax.all_gather(operand, axis_name)  # [P_sender, n, ...]
  in_off = jax.lax.all_gather(input_offsets, axis_name)  # [P_sender, P_dest]
  sizes = jax.lax.all_gather(send_sizes, axis_name)
  out_off = jax.lax.all_gather(output_offsets, axis_name)
  n, R = operand.shape[0], output.shape[0]
  t = jnp.arange(n)
  out = output
  for i in range(P):
    ok = t < sizes[i, me]
    src = jnp.clip(in_off[i, me] + t, 0, n - 1)
    dst = jnp.where(ok, out_off[i, me] + t, R)  # rows past the buffer are lost
    out = out.at[dst].set(ops[i][src], mode="drop")
  agree = jnp.all(sizes[:, me] == recv_sizes)
  bad = jnp.nan if jnp.issubdtype(out.dtype, jnp.floating) else jnp.iinfo(out.dtype).min
  return jnp.where(agree, out, bad)


jax.lax.ragged_all_to_all = fake_ragged_all_to_all


def np_situ(x, wg, wu, wd, b1=4.0, b2=25.0):
  g, u = x @ wg, x @ wu
  return ((b1 * np.tanh(g / b1) / (1 + np.exp(-g))) * (b2 * np.tanh(u / b2))) @ wd


def case(name, layout, impl, *, N=64, L=6, F=8, E=16, k=2, T=16, cap=None, hot=None, seed=0):
  sizes = dict(shd.MeshLayout.parse(layout).ici)
  mesh = shd.make_mesh(shd.MeshLayout.parse(layout))
  rng = np.random.default_rng(seed)
  z = rng.normal(size=(N, L))
  scores = rng.random((N, E))
  if hot is not None:
    scores[:, hot] += 2.0
  ids = np.argsort(-scores, axis=1)[:, :k]
  ids = np.where(rng.random(ids.shape) < 0.2, E, ids)  # sentinel: padding / dropped
  gates = rng.random((N, k)) + 0.1
  margin = rng.random((N, k))
  positions = np.arange(N) % T
  wg = rng.normal(size=(E, L, F)) * 0.4
  wu = rng.normal(size=(E, L, F)) * 0.4
  wd = rng.normal(size=(E, F, L)) * 0.4
  params = {kk: jnp.asarray(v, jnp.float32) for kk, v in
            dict(w_gate=wg, w_up=wu, w_down=wd).items()}
  real = ids < E
  keep = real if cap is None else virtual_keep(ids, positions, margin, sizes=sizes,
                                                num_experts=E, cap=cap)
  want = np.zeros((N, L))
  for t in range(N):
    for s in range(k):
      if keep[t, s]:
        e = ids[t, s]
        want[t] += gates[t, s] * np_situ(z[t], wg[e], wu[e], wd[e])
  # rows each receiver of a group would get without the cap
  axes = [a for a in ("data", "fsdp", "expert", "context") if sizes[a] > 1]
  dims = [sizes[a] for a in axes]
  blocks = math.prod(dims)
  n, P, el = N // blocks, sizes["expert"], E // sizes["expert"]
  groups = {}
  for b in range(blocks):
    coord = dict(zip(axes, np.unravel_index(b, dims)))
    coord.pop("expert", None)
    groups.setdefault(tuple(int(c) for c in coord.values()), []).append(b)
  wanted = []
  for members in groups.values():
    rows = np.concatenate([np.arange(b * n, (b + 1) * n) for b in members])
    sub = ids[rows][real[rows]]
    wanted.append(np.bincount(sub // el, minlength=P))
  wanted = np.asarray(wanted)

  @jax.jit
  def run(z, gates):
    return ep.ep_dispatch_and_compute(
        z, jnp.asarray(ids, jnp.int32), gates, params, mesh=mesh, impl=impl, recv_cap=cap,
        positions=jnp.asarray(positions, jnp.int32), num_positions=T,
        margin=jnp.asarray(margin, jnp.float32))

  u, m = run(jnp.asarray(z, jnp.float32), jnp.asarray(gates, jnp.float32))
  u = np.asarray(u)
  err = float(np.max(np.abs(u - want)))
  got = [float(m[x]) for x in ("dropped", "assigned", "recv_rows_max", "recv_rows_mean",
                               "recv_buffer_rows")]
  exp = [float(real.sum() - keep.sum()), float(real.sum()), float(wanted.max()),
         float(wanted.mean()), float(cap if cap is not None else P * n * k)]
  ok = (np.isfinite(u).all() and err < 1e-4 and np.abs(want).max() > 0.1 and got == exp
        and (cap is None or keep.sum() < real.sum()))
  print(("OK " if ok else "FAIL ") + f"{name} {impl} err={err:.2e} got={got} want={exp}",
        flush=True)


for impl in ("ragged", "dense"):
  case("ep4_fsdp2", "expert=4,fsdp=2", impl, seed=1)
  case("ep8_cap_hot", "expert=8", impl, cap=11, hot=5, seed=2)
  case("ep4_tensor2_cap", "expert=4,tensor=2", impl, cap=20, hot=1, seed=3)
"""


def test_ragged_exchange_and_drop_metrics_match_numpy():
  out = _run(EP_BODY)
  lines = [l for l in out.splitlines() if l.startswith(("OK", "FAIL"))]
  assert len(lines) == 6 and all(l.startswith("OK") for l in lines), out


CP_BODY = """
from sparse_lm import sharding as shd
from sparse_lm.model import context_parallel as cp


def np_kda(q, k, v, g, beta, seg):
  # ARCHITECTURE 2.1 per (batch, head), float64; resets at t > 0 where seg changes to a
  # non-zero id; padding (id 0) is an identity step with zero output.
  B, T, H, K = q.shape
  V = v.shape[-1]
  o = np.zeros((B, T, H, V))
  S_fin = np.zeros((B, H, K, V))
  for b in range(B):
    for h in range(H):
      S = np.zeros((K, V))
      for t in range(T):
        if t > 0 and seg[b, t] != seg[b, t - 1] and seg[b, t] != 0:
          S = np.zeros((K, V))
        if seg[b, t] == 0:
          continue
        St = np.exp(g[b, t, h])[:, None] * S
        kt = k[b, t, h]
        S = St + beta[b, t, h] * np.outer(kt, v[b, t, h] - St.T @ kt)
        o[b, t, h] = S.T @ (q[b, t, h] * K ** -0.5)
      S_fin[b, h] = S
  return o, S_fin


rng = np.random.default_rng(11)
B, T, H, K, V = 2, 32, 2, 8, 4
unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
q = unit(rng.normal(size=(B, T, H, K)))
k = unit(rng.normal(size=(B, T, H, K)))
v = rng.normal(size=(B, T, H, V))
g = -rng.uniform(0.01, 0.3, size=(B, T, H, K))
beta = rng.uniform(0.2, 0.9, size=(B, T, H))
seg = np.zeros((B, T), np.int64)
seg[0, :16] = 1  # shards of 8: shards 2 and 3 are padding after a document -> final state
seg[1, :10] = 1
seg[1, 10:24] = 2  # crosses the boundary at 16
seg[1, 24:] = 3  # starts exactly on the last shard's boundary
o_ref, S_ref = np_kda(q, k, v, g, beta, seg)
args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)]
for layout in ("context=4,fsdp=2", "context=8"):
  mesh = shd.make_mesh(shd.MeshLayout.parse(layout))
  for fold in ("gather", "prefix"):
    f = jax.jit(lambda *a: cp.cp_chunk_kda(*a, mesh=mesh, segment_ids=jnp.asarray(seg, jnp.int32),
                                            output_final_state=True, chunk_size=16,
                                            backend="xla", fold=fold))
    with shd.use_mesh(None):
      o, S = f(*args)
    eo = float(np.max(np.abs(np.asarray(o) - o_ref)))
    es = float(np.max(np.abs(np.asarray(S) - S_ref)))
    ok = eo < 1e-4 and es < 1e-4 and np.abs(S_ref[0]).max() > 0.1
    print(("OK " if ok else "FAIL ") + f"{layout} fold={fold} o_err={eo:.2e} S_err={es:.2e}",
          flush=True)
"""


def test_context_parallel_kda_padding_and_boundaries_match_numpy():
  out = _run(CP_BODY)
  lines = [l for l in out.splitlines() if l.startswith(("OK", "FAIL"))]
  assert len(lines) == 4 and all(l.startswith("OK") for l in lines), out


MESH_BODY = """
from sparse_lm import sharding as shd

# Multislice on devices without slice ids: slices are consecutive blocks of jax.devices(), and
# mesh axis a = (dcn_a major, ici_a minor). fsdp = 2 slices x 2 chips, expert = 2 chips.
mesh = shd.make_mesh(shd.MeshLayout.parse("fsdp=2,dcn_fsdp=2,expert=2"))
assert dict(mesh.shape) == dict(data=1, fsdp=4, expert=2, tensor=1, context=1), mesh.shape
ids = np.vectorize(lambda d: d.id)(mesh.devices)[0, :, :, 0, 0]
base = min(d.id for d in jax.devices())
want = np.array([[d * 4 + i * 2 + e for e in range(2)] for d in range(2) for i in range(2)])
print(("OK " if np.array_equal(ids - base, want) else "FAIL ") + f"hybrid {ids.tolist()}")
"""


def test_multislice_mesh_on_devices_without_slice_ids_keeps_slices_contiguous():
  out = _run(MESH_BODY)
  lines = [l for l in out.splitlines() if l.startswith(("OK", "FAIL"))]
  assert lines and all(l.startswith("OK") for l in lines), out


# ------------------------------------------------ the rules table (abstract meshes, in-process)


def _abstract(data=1, fsdp=1, expert=1, tensor=1, context=1):
  from jax.sharding import AbstractMesh
  from sparse_lm import sharding as shd
  return AbstractMesh((data, fsdp, expert, tensor, context), shd.MESH_AXES)


def test_a_mesh_axis_is_used_once_per_spec_first_claim_wins():
  from jax.sharding import PartitionSpec as P
  from sparse_lm import sharding as shd
  mesh = _abstract(fsdp=2, expert=4, tensor=2)
  # activation_batch -> (data, fsdp, expert) and activation_exp -> expert both claim `expert`
  assert shd.logical_to_spec(("activation_batch", "activation_exp"), mesh=mesh) == P(
      ("fsdp", "expert"), None)
  assert shd.logical_to_spec(("activation_exp", "activation_batch"), mesh=mesh) == P(
      "expert", "fsdp")
  assert shd.logical_to_spec(("mlp", "heads", "embed"), mesh=mesh) == P(
      "tensor", None, ("fsdp", "expert"))


def test_mesh_axis_names_map_to_themselves_and_unknown_names_replicate():
  from jax.sharding import PartitionSpec as P
  from sparse_lm import sharding as shd
  mesh = _abstract(fsdp=2, context=2, tensor=2)
  assert shd.logical_to_spec(("context", "fsdp", "no_such_axis", None), mesh=mesh) == P(
      "context", "fsdp", None, None)
  assert shd.mesh_axes("tensor", mesh) == ("tensor",)


def test_expert_weight_latent_dim_is_split_over_fsdp_and_context_by_the_rules_alone():
  """Small expert weights (below the ZeRO size, no dropped-axis placement): [exp, latent,
  expert_mlp] -> expert, (fsdp, context), tensor straight from the table."""
  from jax.sharding import PartitionSpec as P
  from sparse_lm import sharding as shd
  mesh = _abstract(fsdp=2, expert=2, tensor=2, context=2)
  names, shape = ("exp", "latent", "expert_mlp"), (8, 16, 32)
  assert shd.logical_to_spec(names, mesh=mesh, shape=shape) == P(
      "expert", ("fsdp", "context"), "tensor")


def test_parse_puts_the_rest_on_the_axis_given_minus_one_not_on_fsdp():
  from sparse_lm import sharding as shd
  ici, dcn = shd.MeshLayout.parse("expert=-1,tensor=2").resolve(8)
  assert (ici["fsdp"], ici["expert"], ici["tensor"]) == (1, 4, 2)
  assert all(v == 1 for v in dcn.values())
  ici, _ = shd.MeshLayout.parse("expert=2").resolve(8)
  assert (ici["fsdp"], ici["expert"]) == (4, 2)
