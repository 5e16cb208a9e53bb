"""benchmarks/decode.py refuses bad arguments by name before building a model (it used to time
decode steps from a negative position, or print 'not run' for an unknown part)."""

import re

import pytest

from benchmarks import decode


@pytest.mark.parametrize("argv, match", [
    (["--parts", "foo"], r"--parts 'foo'"),
    (["--configs", "1x"], r"--configs '1x'"),
    (["--configs", "1x8x2"], r"configuration 1x8x2"),
    (["--configs", "0x64"], r"configuration 0x64"),
    (["--configs", "1x256", "--decode-steps", "300"], r"--decode-steps 300 must be below"),
])
def test_bad_arguments_are_refused_by_name(argv, match, capsys):
  with pytest.raises(SystemExit) as e:
    decode.main(["--preset", "tiny"] + argv)
  assert e.value.code == 2
  assert re.search(match, capsys.readouterr().err)
