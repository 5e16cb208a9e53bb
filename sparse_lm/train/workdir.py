"""One run per stage directory at a time: an advisory lock naming the process that holds it.

`<workdir>/<stage>/run.lock` is locked with `fcntl.flock` for the whole run (the primary process
only; the operating system releases it when the process ends, however it ends) and holds one
line saying who holds it: pid, host, UTC start time and command line. A second run of the same
stage in the same workdir stops at once with that line instead of appending to the same logs
and checkpoints.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import re
import socket
import sys
import time

LOCK_FILENAME = "run.lock"
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def local_workdir(path: str | os.PathLike, flag: str = "--workdir", *, existing: bool = False,
                  create: bool = False) -> pathlib.Path:
  """`path` as an absolute local path. sparse_lm writes a workdir (checkpoints, the run lock,
  metrics, the tokenizer) through the local filesystem, so a URL such as gs://bucket/runs is
  refused here, before anything is built, instead of becoming a local folder named "gs:" that
  fails at the first checkpoint.

  Raises:
    ValueError: path is a URL (scheme://...); the message names `flag` and the fix: a bucket
      mounted at the same path on every host (Cloud Storage FUSE) or a shared filesystem. Or
      path, or the nearest existing directory above it, is a file (the first write would fail
      with NotADirectoryError after the compiles). With `create`, the directory is made here
      and an OSError doing so (no permission, a read-only or virtual filesystem such as
      /proc) becomes a ValueError naming `flag`. `existing` only words the message for a
      directory that must exist already (an `--init_from`).
  """
  text = os.fspath(path)
  if _URL.match(text):
    raise ValueError(
        f"{flag}={text!r} is a URL; workdirs are local paths. Mount the bucket at the same path "
        "on every host (Cloud Storage FUSE, e.g. `gcsfuse --implicit-dirs BUCKET /gcs/BUCKET`) "
        f"and pass {flag}=/gcs/BUCKET/..., or use another filesystem every host shares "
        "(docs/launch.md)")
  p = pathlib.Path(text).absolute()
  for q in (p, *p.parents):
    if q.exists():
      if not q.is_dir():
        raise ValueError(f"{flag}={text}: " + ("is a file" if q == p else f"{q} is a file")
                         + ("; give an existing directory" if existing else
                            "; give a directory (new or existing)"))
      break
  if create:
    try:
      p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise ValueError(f"{flag}={text}: cannot create it ({type(e).__name__}: {e.strerror or e}); "
                       "give a directory you can write") from e
  return p


class WorkdirLockedError(RuntimeError):
  """Another process is running this stage in this workdir."""


class WorkdirLock:
  """Context manager: hold `<directory>/run.lock` (a no-op when `primary` is False).

  Raises (on entry):
    WorkdirLockedError: another process holds it; the message names the process.
  """

  def __init__(self, directory: str | os.PathLike, *, primary: bool = True):
    self.path = pathlib.Path(directory) / LOCK_FILENAME
    self.primary = primary
    self._fd: int | None = None

  def __enter__(self) -> WorkdirLock:
    if not self.primary:
      return self
    self.path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o664)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown process"
      os.close(fd)
      raise WorkdirLockedError(
          f"{self.path.parent} is in use by another run: {holder}. Wait for it to finish, "
          "stop it (kill <pid> on that host; it saves and exits), or use another "
          "--workdir.") from None
    os.ftruncate(fd, 0)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    os.pwrite(fd, (f"pid {os.getpid()} on host {socket.gethostname()}, started {started}: "
                   f"{' '.join(sys.argv)}\n").encode(), 0)
    self._fd = fd
    return self

  def __exit__(self, *exc) -> None:
    if self._fd is not None:
      os.ftruncate(self._fd, 0)
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None
