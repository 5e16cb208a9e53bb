"""Multi-host start-up: `maybe_initialize()` calls `jax.distributed.initialize()` when the
process is one of several (TPU pod / multislice, Slurm, explicit coordinator), else nothing.

Call it first thing in an experiment's `main`, before any other JAX call. It sits on the
bottom floor (no sparse_lm imports) so that experiments/ and launch/ both use it without
importing each other.
"""

from __future__ import annotations

import os
from typing import Mapping


def detect(env: Mapping[str, str] | None = None) -> tuple[str | None, dict]:
  """(cluster kind or None, kwargs for jax.distributed.initialize) from the environment.

  Kinds, in order of precedence:
    "explicit": JAX_COORDINATOR_ADDRESS (+ JAX_NUM_PROCESSES, JAX_PROCESS_ID) are set.
    "slurm":    SLURM_NTASKS > 1 (one process per GPU via srun); JAX reads SLURM_* itself.
    "tpu":      a multi-host TPU slice (TPU_WORKER_HOSTNAMES lists > 1 host) or multislice
                (MEGASCALE_NUM_SLICES > 1); JAX reads the TPU metadata itself.
    "mpi":      OMPI_COMM_WORLD_SIZE > 1 (mpirun).
  """
  env = os.environ if env is None else env
  if env.get("JAX_COORDINATOR_ADDRESS"):
    kw = {"coordinator_address": env["JAX_COORDINATOR_ADDRESS"]}
    if env.get("JAX_NUM_PROCESSES"):
      kw["num_processes"] = int(env["JAX_NUM_PROCESSES"])
    if env.get("JAX_PROCESS_ID"):
      kw["process_id"] = int(env["JAX_PROCESS_ID"])
    return "explicit", kw
  if int(env.get("SLURM_NTASKS", "1") or 1) > 1:
    return "slurm", {}
  # libtpu, failing its metadata query on a non-TPU machine, puts a "WARNING: could not
  # determine TPU worker hostnames ..." sentence here: only space-free names are hosts.
  hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",")
           if h.strip() and " " not in h.strip()]
  if len(hosts) > 1 or int(env.get("MEGASCALE_NUM_SLICES", "1") or 1) > 1:
    return "tpu", {}
  if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
    return "mpi", {}
  return None, {}


_DONE = False


def maybe_initialize(env: Mapping[str, str] | None = None) -> bool:
  """Initialise the JAX distributed runtime if this is a multi-process job.

  Returns True if `jax.distributed.initialize` was called (now or before), False for a
  single-process run. Idempotent.
  """
  global _DONE
  if _DONE:
    return True
  kind, kw = detect(env)
  if kind is None:
    return False
  import jax
  jax.distributed.initialize(**kw)
  _DONE = True
  if jax.process_index() == 0:
    print(f"[distributed] {kind}: {jax.process_count()} processes, "
          f"{jax.device_count()} devices ({jax.local_device_count()} local)", flush=True)
  return True
