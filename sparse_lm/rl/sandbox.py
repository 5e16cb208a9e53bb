"""Run model-written Python in an isolated process (ARCHITECTURE.md §10).

`run_python(code)` never evaluates model text in the trainer's process. Each call starts a fresh
interpreter (the base Python, `-I -S`: no site-packages, no PYTHON* variables) under these
protections, all from the Linux kernel through the standard library (`ctypes`):

  identity      a fresh, unused uid/gid outside (a random one in [SANDBOX_UID_BASE, +2^29)),
                so the files of the run (owned by the trainer's user) are "other" to it and
                RLIMIT_NPROC counts only its own processes;
  namespaces    user + mount + network + PID + IPC + UTS (`unshare(2)`): the network namespace
                holds only a down loopback, so neither the internet nor a socket listening on
                the parent's localhost is reachable; the parent is outside the PID namespace,
                so it cannot be signalled, and when the namespace's init dies the kernel kills
                every process in it;
  file system   `pivot_root` into a size-capped tmpfs holding read-only binds of /usr (and the
                interpreter's prefix) and /dev/{null,zero,urandom}; the old root is detached,
                so the workdir, checkpoints, /tmp, /proc and the user's home do not exist;
                the working directory is `/sandbox` in that tmpfs (private, gone afterwards);
  capabilities  the bounding, ambient and effective sets are emptied and no_new_privs is set
                before the code runs;
  rlimits       CPU seconds, address space (`memory_mb`), processes, file size, open files,
                no core dumps;
  wall clock    the parent kills the whole process group after `timeout_s` (the namespace's
                init carries PR_SET_PDEATHSIG, so the namespace goes with it);
  environment   empty (`env={}`); stdout/stderr go to parent-owned files capped by RLIMIT_FSIZE.

`sandbox_support()` probes this once per process. Where the host cannot create the namespaces
(no user namespaces, not root for the uid switch), `run_python` raises `SandboxUnavailableError`
naming what is missing, unless the caller passes `allow_unsafe=True`; then only the rlimits, the
empty environment, the private temp directory and the wall clock apply.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time

SANDBOX_UID_BASE = 1 << 20
MAX_OUTPUT_BYTES = 1 << 16  # RLIMIT_FSIZE of the stdout/stderr files; output is cut there
SETUP_FAILED = 125  # exit status of the bootstrap when it cannot build the sandbox


@dataclasses.dataclass(frozen=True)
class ToolResult:
  """The outcome of one tool call: `ok`, its text `output` (stdout for python), `error` (None
  when ok; otherwise what went wrong, e.g. the traceback's last lines or 'timed out')."""

  ok: bool
  output: str
  error: str | None = None


class SandboxUnavailableError(RuntimeError):
  """The host cannot isolate model-written code; pass allow_unsafe=True to run it anyway."""


# The bootstrap: runs as the fresh uid, builds the namespaces and the file-system view, drops
# capabilities, sets the rlimits and execs the interpreter on the model's code (read from stdin).
# It is a string because it must run in a new interpreter, never in the trainer's process.
_BOOTSTRAP = r'''
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
code = sys.stdin.buffer.read()
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
def fail(what):
  e = ctypes.get_errno()
  sys.stderr.write(f"sandbox setup failed: {what}: {os.strerror(e)}\n"); sys.stderr.flush()
  os._exit(125)
def _excepthook(tp, value, tb):
  sys.stderr.write(f"sandbox setup failed: {tp.__name__}: {value}\n"); sys.stderr.flush()
  os._exit(125)
sys.excepthook = _excepthook
def mount(src, dst, fstype, flags, data=None):
  enc = lambda s: None if s is None else s.encode()
  if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
    fail(f"mount {src} -> {dst}")
def limits():
  mb = cfg["memory_mb"] << 20
  for res, val in ((resource.RLIMIT_AS, mb), (resource.RLIMIT_CPU, cfg["cpu_s"]),
                   (resource.RLIMIT_NPROC, cfg["nproc"]), (resource.RLIMIT_FSIZE, cfg["fsize"]),
                   (resource.RLIMIT_NOFILE, cfg["nofile"]), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(res, (val, val))
if not cfg["isolate"]:  # allow_unsafe on a host that cannot isolate: rlimits only
  os.chdir(cfg["workdir"])
  with open("main.py", "wb") as f:
    f.write(code)
  limits()
  os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-B", "main.py"], {})
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
# 1. As the parent's user, in a private mount namespace: the new root is a tmpfs at /tmp with
#    read-only binds of the interpreter and its libraries (paths the fresh uid may not reach).
if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
  fail("unshare(mount)")
mount(None, "/", None, MS_REC | MS_PRIVATE)
root = "/tmp"
mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['tmpfs_mb']}m,mode=755")
def bind(src, is_dir=True):
  path = root + src
  if is_dir:
    os.makedirs(path, exist_ok=True)
  else:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "w").close()
  mount(src, path, None, MS_BIND | MS_REC)
  keep = os.statvfs(path).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)
  mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | keep)
for src in cfg["dirs"]:
  bind(src)
for src in cfg["files"]:
  bind(src, is_dir=False)
for link, dest in cfg["links"]:
  os.symlink(dest, root + link)
for d in ("/sandbox", "/tmp", "/.old"):
  os.makedirs(root + d, exist_ok=True)
  os.chown(root + d, cfg["uid"], cfg["uid"])
with open(root + "/sandbox/main.py", "wb") as f:
  f.write(code)
# 2. The fresh uid, in new user, mount, network, PID, IPC and UTS namespaces (the mounts above
#    become locked: the sandbox cannot remount them writable or look under them).
os.setgroups([]); os.setgid(cfg["uid"]); os.setuid(cfg["uid"])
libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: a uid change hides /proc/self otherwise
uid, gid = os.getuid(), os.getgid()
CLONE = 0x00020000 | 0x10000000 | 0x40000000 | 0x20000000 | 0x08000000 | 0x04000000
if libc.unshare(CLONE) != 0:  # NEWNS | NEWUSER | NEWNET | NEWPID | NEWIPC | NEWUTS
  fail("unshare(user, mount, net, pid, ipc, uts)")
for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
  with open(f"/proc/self/{name}", "w") as f:
    f.write(text)
pid = os.fork()
if pid:
  signal.signal(signal.SIGTERM, signal.SIG_DFL)
  _, status = os.waitpid(pid, 0)
  os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status)
           else 128 + os.WTERMSIG(status))
# 3. PID 1 of the new namespace: pivot into the tmpfs, detach the old root, drop everything.
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_CAP_AMBIENT = 1, 38, 24, 47
libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
# The tmpfs came from the more privileged namespace, so it is locked here and pivot_root
# refuses it; a recursive bind of it onto itself is a mount of this namespace.
mount(root, root, None, MS_BIND | MS_REC)
os.chdir(root)
if libc.syscall(cfg["sys_pivot_root"], b".", b".old") != 0:
  fail("pivot_root")
os.chdir("/")
if libc.umount2(b"/.old", 2) != 0:  # MNT_DETACH
  fail("umount old root")
# /.old stays, empty (the tmpfs root belongs to the parent's user).
os.chdir("/sandbox")
libc.prctl(PR_CAP_AMBIENT, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
for cap in range(64):
  libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
  fail("no_new_privs")
hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)
data = (ctypes.c_uint32 * 6)()
if libc.capset(hdr, data) != 0:
  fail("capset")
limits()
libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-B", "/sandbox/main.py"], {})
'''

_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}


def _base_python() -> tuple[str, str]:
  """(interpreter path, its prefix): the base installation, not the project's venv."""
  prefix = os.path.realpath(sys.base_prefix)
  ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
  for cand in (os.path.join(prefix, "bin", ver), os.path.realpath(sys.executable)):
    if os.path.exists(cand):
      return os.path.realpath(cand), prefix
  raise SandboxUnavailableError(f"cannot find the base interpreter under {prefix}")


def _launch(code: str, *, timeout_s: float, memory_mb: int, isolate: bool, nproc: int = 16,
            nofile: int = 64, tmpfs_mb: int = 64) -> ToolResult:
  python, prefix = _base_python()
  uid = SANDBOX_UID_BASE + secrets.randbelow(1 << 29)
  cfg = dict(python=python, memory_mb=int(memory_mb), cpu_s=max(1, int(timeout_s) + 1),
             nproc=nproc, fsize=MAX_OUTPUT_BYTES, nofile=nofile, tmpfs_mb=tmpfs_mb,
             isolate=isolate, sys_pivot_root=_SYS_PIVOT_ROOT.get(os.uname().machine, -1))
  if isolate:
    cfg.update(dirs=["/usr"] + ([prefix] if not prefix.startswith("/usr/") else []),
               files=["/dev/null", "/dev/zero", "/dev/urandom"],
               links=[(d, "usr" + d) for d in ("/bin", "/lib", "/lib64", "/sbin")
                      if os.path.islink(d)])
  with tempfile.TemporaryDirectory(prefix="sandbox_") as private:
    cfg.update(uid=uid, workdir=private)
    out_path, err_path = os.path.join(private, "stdout"), os.path.join(private, "stderr")
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
      proc = subprocess.Popen(
          [python, "-I", "-S", "-c", _BOOTSTRAP, json.dumps(cfg)], stdin=subprocess.PIPE,
          stdout=out, stderr=err, env={}, cwd="/", start_new_session=True)
      timed_out = False
      try:
        proc.stdin.write(code.encode("utf-8", "replace"))
        proc.stdin.close()
      except BrokenPipeError:
        pass
      try:
        proc.wait(timeout=timeout_s + 0.5)  # + the bootstrap's own start-up
      except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    with open(out_path, "rb") as f:
      output = f.read(MAX_OUTPUT_BYTES).decode("utf-8", "replace")
    with open(err_path, "rb") as f:
      stderr = f.read(MAX_OUTPUT_BYTES).decode("utf-8", "replace")
  rc = proc.returncode
  if timed_out:
    return ToolResult(False, output, f"timed out after {timeout_s:g} s (killed)")
  if rc == 0:
    return ToolResult(True, output, None)
  if rc == SETUP_FAILED and "sandbox setup failed" in stderr:
    raise SandboxUnavailableError(stderr.strip())
  lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
  tail = "\n".join(lines[-3:])
  if rc > 128 or rc < 0:
    sig = rc - 128 if rc > 128 else -rc
    name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
    why = {"SIGXCPU": " (CPU time limit)", "SIGXFSZ": " (output/file size limit)",
           "SIGKILL": " (killed: memory, process or time limit)"}.get(name, "")
    return ToolResult(False, output, f"killed by {name}{why}" + (f"\n{tail}" if tail else ""))
  return ToolResult(False, output, tail or f"exit status {rc}")


@dataclasses.dataclass(frozen=True)
class SandboxSupport:
  """What this host gives: `isolated` when every protection of the module docstring holds;
  `missing` names the ones that do not; `startup_s` is one trivial run's wall time."""

  isolated: bool
  missing: tuple[str, ...]
  startup_s: float


@functools.lru_cache(maxsize=None)
def sandbox_support() -> SandboxSupport:
  """Probe once whether the isolated sandbox can be built here (runs `print(1)` in it)."""
  missing = []
  if sys.platform != "linux":
    missing.append(f"Linux namespaces (platform is {sys.platform})")
  elif os.uname().machine not in _SYS_PIVOT_ROOT:
    missing.append(f"pivot_root syscall number for {os.uname().machine}")
  elif os.getuid() != 0:
    missing.append("a fresh uid per run (needs root to switch uid)")
  if missing:
    return SandboxSupport(False, tuple(missing), 0.0)
  start = time.perf_counter()
  try:
    res = _launch("print(1)", timeout_s=10.0, memory_mb=256, isolate=True)
  except (SandboxUnavailableError, OSError) as e:
    return SandboxSupport(False, (f"namespaces/pivot_root ({e})",), 0.0)
  if not res.ok or res.output.strip() != "1":
    return SandboxSupport(False, (f"a working isolated interpreter ({res.error})",), 0.0)
  return SandboxSupport(True, (), time.perf_counter() - start)


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512,
               allow_unsafe: bool = False) -> ToolResult:
  """Run `code` (Python source) in the sandbox; its stdout is the result.

  Args:
    code: the program; it runs as `/sandbox/main.py` with the standard library only.
    timeout_s: wall-clock limit in seconds (the CPU limit is the next whole second above).
    memory_mb: address-space limit in MiB (RLIMIT_AS).
    allow_unsafe: run with rlimits only when the host cannot isolate (see the module doc).

  Returns:
    ToolResult: ok when the program exits 0 in time; `output` is its stdout (at most
    MAX_OUTPUT_BYTES); `error` the last lines of stderr, 'timed out ...' or 'killed by ...'.

  Raises:
    SandboxUnavailableError: the host cannot isolate and allow_unsafe is False (names what is
      missing).
    ValueError: timeout_s or memory_mb not positive.
  """
  if not timeout_s > 0:
    raise ValueError(f"run_python: timeout_s={timeout_s} must be > 0")
  if not memory_mb > 0:
    raise ValueError(f"run_python: memory_mb={memory_mb} must be > 0")
  support = sandbox_support()
  if not support.isolated and not allow_unsafe:
    raise SandboxUnavailableError(
        "refusing to run model-written code: this host lacks " + "; ".join(support.missing) +
        ". Pass allow_unsafe=True to run with rlimits and an empty environment only.")
  return _launch(code, timeout_s=timeout_s, memory_mb=memory_mb, isolate=support.isolated)
