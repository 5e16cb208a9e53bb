"""Multi-host start-up: `maybe_initialize()` calls `jax.distributed.initialize()` when the
process is one of several (TPU pod / multislice, Slurm, explicit coordinator), else nothing.

Call it first thing in an experiment's `main`, before any other JAX call. It sits on the
bottom floor (no sparse_lm imports) so that experiments/ and launch/ both use it without
importing each other.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping


def detect(env: Mapping[str, str] | None = None,
           tpu_vm: bool | None = None) -> tuple[str | None, dict]:
  """(cluster kind or None, kwargs for jax.distributed.initialize) from the environment.

  Kinds, in order of precedence:
    "explicit": JAX_COORDINATOR_ADDRESS (+ JAX_NUM_PROCESSES, JAX_PROCESS_ID) are set.
    "slurm":    SLURM_NTASKS > 1 (one process per GPU via srun); JAX reads SLURM_* itself.
    "tpu":      a multi-host TPU slice (TPU_WORKER_HOSTNAMES lists > 1 host: GKE) or
                multislice (MEGASCALE_NUM_SLICES > 1); JAX reads the TPU metadata itself.
    "mpi":      OMPI_COMM_WORLD_SIZE > 1 (mpirun).
    "tpu":      (last) a Cloud TPU VM (`tpu_vm`): on GCE (queued resources, `launch.tpu`)
                nothing in the environment names the slice's hosts (libtpu and JAX read them
                from the metadata server), so every TPU VM initialises and JAX finds how many
                processes the slice has (one on a single-host VM). Without it a multi-host slice
                ran without the distributed client, and orbax's checkpoint barriers need it.

  `tpu_vm`: whether this is a Cloud TPU VM; None probes this machine's PCI devices for TPU
  chips when `env` is None (the real environment), else takes it as False.
  """
  if tpu_vm is None:
    tpu_vm = env is None and _tpu_chips() > 0
  env = os.environ if env is None else env
  if env.get("JAX_COORDINATOR_ADDRESS"):
    return "explicit", _explicit(env, tpu_vm)
  if _int(env, "SLURM_NTASKS", 1) > 1:
    return "slurm", {}
  slices = _int(env, "MEGASCALE_NUM_SLICES", 1)
  # libtpu, failing its metadata query on a non-TPU machine, puts a "WARNING: could not
  # determine TPU worker hostnames ..." sentence here: only space-free names are hosts.
  hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",")
           if h.strip() and " " not in h.strip()]
  if len(hosts) > 1 or slices > 1:
    return "tpu", {}
  if _int(env, "OMPI_COMM_WORLD_SIZE", 1) > 1:
    return "mpi", {}
  if tpu_vm and not env.get("TPU_SKIP_MDS_QUERY"):
    return "tpu", {}
  return None, {}


def _int(env: Mapping[str, str], var: str, default: int) -> int:
  value = env.get(var, "")
  if not value.strip():
    return default
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"{var}={value!r}: expected a whole number") from None


def _explicit(env: Mapping[str, str], tpu_vm: bool) -> dict:
  """jax.distributed.initialize's arguments from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES
  and JAX_PROCESS_ID, checked here so that an error names the variable and its fix (JAX said
  "The process id of the current process must be defined." or failed with an IndexError)."""
  address = env["JAX_COORDINATOR_ADDRESS"]
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"JAX_COORDINATOR_ADDRESS={address!r}: expected host:port of process 0 "
                     "(e.g. JAX_COORDINATOR_ADDRESS=10.0.0.2:1234)")
  kw: dict = {"coordinator_address": address}
  for var, key in (("JAX_NUM_PROCESSES", "num_processes"), ("JAX_PROCESS_ID", "process_id")):
    if env.get(var, "").strip():
      kw[key] = _int(env, var, 0)
  # Slurm, Open MPI, Kubernetes and TPU pods tell JAX the count and this process's id.
  cluster = (tpu_vm or _int(env, "SLURM_NTASKS", 1) > 1 or
             _int(env, "OMPI_COMM_WORLD_SIZE", 1) > 1 or
             any(env.get(v) for v in ("TPU_WORKER_HOSTNAMES", "MEGASCALE_NUM_SLICES",
                                      "KUBERNETES_SERVICE_HOST")))
  missing = [v for v, k in (("JAX_NUM_PROCESSES", "num_processes"),
                            ("JAX_PROCESS_ID", "process_id")) if k not in kw]
  if missing and not cluster:
    raise ValueError(f"JAX_COORDINATOR_ADDRESS is set but {' and '.join(missing)} "
                     f"{'is' if len(missing) == 1 else 'are'} not: set JAX_NUM_PROCESSES (the "
                     "job's process count) and JAX_PROCESS_ID (0..count-1, a different one on "
                     "each process) on every process, or unset JAX_COORDINATOR_ADDRESS")
  if "num_processes" in kw and kw["num_processes"] < 1:
    raise ValueError(f"JAX_NUM_PROCESSES={kw['num_processes']}: expected >= 1")
  if "num_processes" in kw and "process_id" in kw and not (
      0 <= kw["process_id"] < kw["num_processes"]):
    raise ValueError(f"JAX_PROCESS_ID={kw['process_id']} is not in 0..{kw['num_processes'] - 1} "
                     f"(JAX_NUM_PROCESSES={kw['num_processes']})")
  return kw


def _tpu_chips() -> int:
  """TPU chips on this machine's PCI bus (what JAX checks before it probes a Cloud TPU VM)."""
  try:
    from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
    return int(hardware_utils.num_available_tpu_chips_and_device_id()[0])
  except Exception:  # pylint: disable=broad-except  (a private module: absent means no probe)
    return 0


_DONE = False


def maybe_initialize(env: Mapping[str, str] | None = None) -> bool:
  """Initialise the JAX distributed runtime if this is a multi-process job.

  Returns True if `jax.distributed.initialize` was called (now or before), False for a
  single-process run. Idempotent.

  A process of the job that dies of an uncaught exception exits at once (`_exit_on_error`)
  rather than wait at JAX's shutdown barrier for the others, which wait for it in the next
  collective: both stood still for the barrier's 300 s before failing. The others then stop
  when the coordination service misses its heartbeats: after SPARSE_LM_HEARTBEAT_TIMEOUT
  seconds (default 100, JAX's).
  """
  global _DONE
  if _DONE:
    return True
  kind, kw = detect(env)
  if kind is None:
    return False
  import jax
  heartbeat = (os.environ if env is None else env).get("SPARSE_LM_HEARTBEAT_TIMEOUT")
  if heartbeat:
    try:
      kw["heartbeat_timeout_seconds"] = int(heartbeat)
    except ValueError:
      raise ValueError(f"SPARSE_LM_HEARTBEAT_TIMEOUT={heartbeat!r}: expected whole seconds, "
                       "e.g. SPARSE_LM_HEARTBEAT_TIMEOUT=100") from None
  jax.distributed.initialize(**kw)
  _DONE = True
  if jax.process_count() > 1:
    sys.excepthook = _exit_on_error(sys.excepthook)
  if jax.process_index() == 0:
    print(f"[distributed] {kind}: {jax.process_count()} processes, "
          f"{jax.device_count()} devices ({jax.local_device_count()} local)", flush=True)
  return True


def failed(rc: int = 1) -> int:
  """The exit status of an entry point that caught and reported an error: `rc` itself, for
  `raise SystemExit(main())`, except in a job of several processes, where this process leaves
  at once (stdout / stderr flushed, then `os._exit(rc)`): the interpreter's normal exit would
  wait at jax.distributed's shutdown barrier (300 s) for processes that wait for this one in a
  collective. The others stop when they miss its heartbeat (SPARSE_LM_HEARTBEAT_TIMEOUT).

  Example: `except ValueError as e: print(e, file=sys.stderr); return failed(1)`.
  """
  if rc and _DONE:
    import jax  # pylint: disable=g-import-not-at-top
    if jax.process_count() > 1:
      print(f"[distributed] this process stops (exit status {rc}); exiting without the "
            "shutdown barrier, the other processes stop when they miss its heartbeat",
            file=sys.stderr)
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(rc)
  return rc


def _exit_on_error(hook):
  """sys.excepthook of a multi-process job: print the traceback as `hook` does, then leave
  without the interpreter's exit (whose jax.distributed shutdown barrier waits for processes
  that wait for this one)."""
  def excepthook(kind, value, tb):
    try:
      hook(kind, value, tb)
      print(f"[distributed] this process failed ({kind.__name__}); exiting without the "
            "shutdown barrier, the other processes stop when they miss its heartbeat",
            file=sys.stderr)
      sys.stdout.flush()
      sys.stderr.flush()
    finally:
      os._exit(1)
  return excepthook
