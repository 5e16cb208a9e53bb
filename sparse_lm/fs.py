"""Filesystem errors the user must fix outside the program, as one line.

A full disk or quota, a read-only filesystem or a missing permission ends the stage CLI
(`experiments.base`) and the checkpoint interop CLI (`sparse_lm.interop.hf`) with one line
naming the path and the fix, not a traceback. Both use `write_failure`; it lives on the bottom
import floor so that the training and interop packages share it without importing each other.
"""

from __future__ import annotations

import errno
import os

# The errors of a write the user must fix outside the program (a full disk or quota, a read-only
# filesystem, no permission): reported as one line by the CLIs, not a traceback.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def write_failure(e: OSError, where: str | os.PathLike) -> str | None:
  """A one-line message for `e` when its errno is one of `WRITE_ERRNOS`, else None.

  Args:
    e: the OSError a write (or a read of a directory without permission) raised.
    where: the directory the command writes under (the workdir, the export directory), named
      when `e` carries no filename.

  Returns:
    "cannot write|access PATH: REASON (errno NAME); free space or fix the permissions ..." or
    None for any other error (an unexpected one: let it raise).
  """
  if e.errno not in WRITE_ERRNOS:
    return None
  what = f"{e.filename}" if e.filename else f"a file under {where}"
  verb = "access" if e.errno in (errno.EACCES, errno.EPERM) else "write"  # may be a read
  return (f"cannot {verb} {what}: {e.strerror or e} (errno {errno.errorcode.get(e.errno, e.errno)}"
          "); free space or fix the permissions and run the same command again, or give "
          "another directory")
