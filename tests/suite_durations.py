"""The test files' seconds in one recorded run of the suite (tests/suite_durations.txt), which
tests/conftest.py reads to start the longest files first: with `--dist=loadfile` a file runs
whole on one xdist worker, so a long file that started last would leave the other worker idle.

Refresh it from a whole-suite run (CI's command on an idle machine), then commit the file:

  python -m pytest -q tests --junitxml=/tmp/suite.xml
  python tests/suite_durations.py /tmp/suite.xml --source "bash .ci/run, main <commit>, <date>"

The input is pytest's JUnit XML (`--junitxml`: each test's setup, call and teardown, so a module
fixture counts for its file) or pytest's console output with `--durations=N` (only the N slowest
phases: files of faster tests are then missing or count low). Files missing from the record
start after the recorded ones, in collection order.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import textwrap
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "suite_durations.txt"
# A --durations line: "119.49s call     tests/multidevice/test_x.py::test_y[param]"
_PHASE = re.compile(r"^\s*([\d.]+)s (?:setup|call|teardown)\s+([^\s:]+\.py)::")


def _file_of(case: ET.Element) -> str:
  """A JUnit test case's file relative to the repo root: its `file` attribute (junit_family
  xunit1), else the longest prefix of its dotted classname that names a file (xunit2)."""
  if case.get("file"):
    return case.get("file")
  parts = case.get("classname", "").split(".")
  for n in range(len(parts), 0, -1):
    path = "/".join(parts[:n]) + ".py"
    if (ROOT / path).is_file():
      return path
  raise ValueError(f"suite_durations: no test file for the JUnit classname "
                   f"{case.get('classname')!r} (run from the run's checkout)")


def file_seconds(report: pathlib.Path) -> dict[str, float]:
  """Seconds per test file (summed over its tests' phases) in `report`: JUnit XML or pytest's
  console output with --durations=N.

  Raises:
    ValueError: `report` holds no test durations.
  """
  text = pathlib.Path(report).read_text()
  seconds: dict[str, float] = collections.defaultdict(float)
  if text.lstrip().startswith("<"):
    for case in ET.fromstring(text).iter("testcase"):
      seconds[_file_of(case)] += float(case.get("time", 0.0))
  else:
    for line in text.splitlines():
      m = _PHASE.match(line)
      if m:
        seconds[m.group(2)] += float(m.group(1))
  if not seconds:
    raise ValueError(f"suite_durations: {report} holds no test durations (pass pytest's "
                     "--junitxml file, or its console output with --durations=N)")
  return dict(seconds)


def write(seconds: dict[str, float], source: str, path: pathlib.Path = RECORD) -> None:
  """Write the record: a comment header naming `source`, then "seconds  file" lines, the
  longest first."""
  lines = ["# Seconds per test file in one run of the suite (its tests' phases summed). Read by",
           "# tests/conftest.py (the longest files start first); written by",
           "# tests/suite_durations.py, whose docstring says how to refresh it.",
           *textwrap.wrap(f"Source: {source}", 94, initial_indent="# ",
                          subsequent_indent="#   ")]
  rows = sorted((-round(s, 1), f) for f, s in seconds.items())  # rank_of's order
  lines += [f"{-s:8.1f}  {f}" for s, f in rows]
  pathlib.Path(path).write_text("\n".join(lines) + "\n")


def rank_of(path: pathlib.Path = RECORD):
  """A sort key over test files (paths relative to the repo root): the recorded files by their
  seconds, longest first (0, 1, ...), every other file after them (all equal: a stable sort
  keeps their order). No record: every file equal."""
  rows = []
  if pathlib.Path(path).is_file():
    for line in pathlib.Path(path).read_text().splitlines():
      if line.strip() and not line.startswith("#"):
        seconds, name = line.split()
        rows.append((-float(seconds), name))
  rank = {name: i for i, (_, name) in enumerate(sorted(rows))}
  return lambda file: rank.get(file, len(rank))


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("report", type=pathlib.Path,
                 help="pytest's --junitxml file, or its console output with --durations=N")
  p.add_argument("--source", required=True,
                 help="what run the report is of (command, commit, date, machine)")
  p.add_argument("--out", type=pathlib.Path, default=RECORD)
  args = p.parse_args(argv)
  try:
    seconds = file_seconds(args.report)
  except (OSError, ValueError, ET.ParseError) as e:
    p.error(str(e))
  write(seconds, args.source, args.out)
  print(f"{args.out}: {len(seconds)} files, {sum(seconds.values()):.1f} s")


if __name__ == "__main__":
  main()
