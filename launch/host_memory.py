"""Host memory of this process: the resident set now, its peak, and the peak per phase.

    with RssSampler() as rss:
      with rss.phase("lower"):
        lowered = jitted.lower(...)
      with rss.phase("compile"):
        compiled = lowered.compile()
    print(rss.report())   # "lower 1.21 GB (+0.30), compile 9.80 GB (+8.59); peak 9.80 GB"

The peak of the whole process is the kernel's high-water mark (`VmHWM` in
/proc/self/status, which `resource.getrusage(RUSAGE_SELF).ru_maxrss` also reports, in KiB
on Linux); the peak of a phase comes from a background thread that reads `VmRSS` + `VmSwap`
every `interval` seconds, so it can miss a spike shorter than that (the kernel's high-water
mark cannot). On a host with swap the resident set alone understates what a process holds
(a compile whose pages went to disk): the sampled "resident + swapped" figure is the one to
read there (`in_use_bytes`); without swap the two are the same.
Units: bytes (GB = 1e9 bytes in the reports).

`bound_malloc()` makes glibc's allocator hand freed memory back: few malloc arenas (by default
glibc keeps up to 8 per core, one per compiler thread, whose freed blocks stay resident) and,
from the sampler thread, `malloc_trim` every `trim_every` seconds. The XLA/libtpu compiler
allocates and frees a lot from many threads: the tiny plan's compile peaks at 1.72 GB with
two arenas instead of 2.11 GB (docs/scaling.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import resource
import threading
import time

GB = 1000**3
_M_ARENA_MAX = -8  # mallopt parameters (glibc malloc.h)
_M_MMAP_THRESHOLD = -3


def _libc():
  name = ctypes.util.find_library("c")
  try:
    return ctypes.CDLL(name) if name else None
  except OSError:
    return None


def bound_malloc(arenas: int = 2, mmap_threshold: int | None = None) -> bool:
  """Limit glibc malloc to `arenas` arenas and, if given, serve blocks of `mmap_threshold`
  bytes or more by mmap (returned to the OS on free; glibc otherwise raises the threshold as
  large blocks are freed). Call before any thread starts (before importing jax). Returns False
  where the C library is not glibc (then nothing changes)."""
  libc = _libc()
  if libc is None or not hasattr(libc, "mallopt"):
    return False
  ok = bool(libc.mallopt(_M_ARENA_MAX, arenas))
  if mmap_threshold is not None:
    ok = ok and bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold))
  return ok


def trim_malloc() -> None:
  """Return free heap pages of every arena to the OS (glibc `malloc_trim(0)`; else nothing)."""
  libc = _libc()
  if libc is not None and hasattr(libc, "malloc_trim"):
    libc.malloc_trim(0)


def _status_bytes(key: str) -> int:
  """A `VmRSS` / `VmHWM` line of /proc/self/status in bytes (0 where /proc is missing)."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(key + ":"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0


def rss_bytes() -> int:
  """The resident set of this process now (bytes)."""
  return _status_bytes("VmRSS")


def in_use_bytes() -> int:
  """Host memory this process holds now (bytes): resident plus swapped out (VmRSS + VmSwap)."""
  return _status_bytes("VmRSS") + _status_bytes("VmSwap")


def peak_rss_bytes() -> int:
  """The peak resident set of this process so far (bytes): the larger of VmHWM and the current
  VmRSS (the kernel updates its high-water mark lazily). `ru_maxrss` is used only where /proc
  is missing: Linux keeps it across `execve`, so a planner started by a large parent (a test
  runner) would report the parent's peak as its own."""
  proc = max(_status_bytes("VmHWM"), _status_bytes("VmRSS"))
  return proc if proc else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class RssSampler:
  """Samples the resident set in a daemon thread; records the peak and seconds per phase."""

  def __init__(self, interval: float = 0.2, trim_every: float | None = None):
    self.interval = interval
    self.trim_every = trim_every
    self.phases: list[dict] = []  # {"name", "start_rss", "peak_rss", "seconds"}
    self._current: dict | None = None
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    last_trim = time.time()
    while not self._stop.wait(self.interval):
      if self.trim_every is not None and time.time() - last_trim >= self.trim_every:
        trim_malloc()
        last_trim = time.time()
      cur = self._current
      if cur is not None:
        cur["peak_rss"] = max(cur["peak_rss"], in_use_bytes())

  def __enter__(self) -> "RssSampler":
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()

  @contextlib.contextmanager
  def phase(self, name: str, *, echo: bool = True):
    """Record `name`: host memory in use (resident + swapped) at its start, its sampled peak
    and its wall time."""
    now = in_use_bytes()
    rec = {"name": name, "start_rss": now, "peak_rss": now, "seconds": 0.0}
    self.phases.append(rec)
    prev, self._current = self._current, rec
    t0 = time.time()
    try:
      yield rec
    finally:
      rec["seconds"] = time.time() - t0
      rec["peak_rss"] = max(rec["peak_rss"], in_use_bytes())
      self._current = prev
      if echo:
        print(f"[host memory] {name}: {rec['seconds']:.1f}s, RSS {rec['start_rss'] / GB:.2f} "
              f"-> peak {rec['peak_rss'] / GB:.2f} GB", flush=True)

  def report(self) -> str:
    """One line: each phase's peak (and its growth over its start), then the process peak."""
    parts = [f"{p['name']} {p['peak_rss'] / GB:.2f} GB (+{(p['peak_rss'] - p['start_rss']) / GB:.2f}, "
             f"{p['seconds']:.0f}s)" for p in self.phases]
    return ", ".join(parts) + f"; peak {self.peak() / GB:.2f} GB"

  def peak(self) -> int:
    """The process's peak host memory so far (bytes): the kernel's resident high-water mark or
    the largest sampled resident + swapped figure, whichever is larger."""
    return max([peak_rss_bytes()] + [p["peak_rss"] for p in self.phases])
