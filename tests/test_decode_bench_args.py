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
    # --decode-steps 0 divided by zero after the compile; --repeats 0: no median
    (["--decode-steps", "0"], r"--decode-steps 0: expected a positive integer"),
    (["--repeats", "0"], r"--repeats 0: expected a positive integer"),
    # an unknown case was skipped without a word
    (["--profile-cases", "decode,single step"],
     r"--profile-cases 'decode,single step': expected a comma list of decode call, single step, "
     r"single step model MoE"),
    # --set: an unknown field was an AttributeError, a missing "=" a ValueError traceback
    (["--set", "no_such_field=1"], r"unknown ModelConfig field 'no_such_field'; valid: \[.*"),
    (["--set", "scan_layers"], r"--set 'scan_layers': expected FIELD=VALUE"),
    (["--set", "scan_layers=maybe"], r"scan_layers='maybe': expected a bool"),
    (["--set", "capacity_factor=x"], r"capacity_factor='x': expected a float"),
])
def test_bad_arguments_are_refused_by_name(argv, match, capsys):
  with pytest.raises(SystemExit) as e:
    decode.main(["--preset", "tiny"] + argv)
  assert e.value.code == 2
  assert re.search(match, capsys.readouterr().err)


def test_set_values_are_parsed_to_the_field_types(monkeypatch):
  """`--set scan_layers=false` built the model with scan_layers=True (bool("false") is True),
  and an optional field (default None) could not be set at all (NoneType("1.5"))."""
  seen = {}

  def stop(cfg, **kw):
    del kw
    seen["cfg"] = cfg
    raise SystemExit(0)

  monkeypatch.setattr(decode, "Transformer", stop)
  with pytest.raises(SystemExit):
    decode.main(["--preset", "tiny", "--set", "scan_layers=false", "--set",
                 "capacity_factor=1.5", "--set", "attnres_stack_dtype=none"])
  cfg = seen["cfg"]
  assert cfg.scan_layers is False
  assert cfg.capacity_factor == 1.5 and cfg.attnres_stack_dtype is None


def test_tiny_floor_prints_significant_digits():
  """The tiny preset's bandwidth floor on a CPU is microseconds: the table printed 0.000 ms and
  a floor / step of 0.00."""
  assert decode._sig(0.00043693, 3) == "0.000437"
  assert decode._sig(0.764, 3) == "0.764" and decode._sig(12.0, 3) == "12.000"
  assert decode._sig(0.00057, 2) == "0.00057" and decode._sig(0.5, 2) == "0.50"
  assert decode._sig(0.0, 3) == "0.000"
