"""tests/suite_durations.py: a suite run's report (pytest's JUnit XML or its --durations
output) becomes seconds per test file, the record it writes orders the files longest first with
unrecorded files after them, and the committed record reads."""

import pytest

import suite_durations as sd

# pytest's JUnit XML (default family xunit2: classname = the file's dotted path, then the
# class of a test method); times are each test's setup + call + teardown.
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.model.test_transformer" name="test_a" time="30.25" />
<testcase classname="tests.model.test_transformer" name="test_b[full]" time="1.5" />
<testcase classname="tests.model.test_transformer.TestGroup" name="test_c" time="0.25" />
<testcase classname="tests.test_notebook" name="test_quickstart" time="108.75">
<skipped message="x" /></testcase></testsuite></testsuites>"""

DURATIONS = """============================= slowest 4 durations =============================
119.49s call     tests/multidevice/test_sharded_train.py::test_step
2.50s setup    tests/model/test_layers.py::test_kda[float32-1::2]
10.00s call     tests/model/test_layers.py::test_kda[float32-1::2]
0.01s teardown tests/model/test_layers.py::test_kda[float32-1::2]
453 passed, 1 skipped, 3 warnings in 1124.47s (0:18:44)
"""


def test_junit_xml_and_durations_output_sum_per_file(tmp_path):
  (tmp_path / "suite.xml").write_text(JUNIT)
  (tmp_path / "suite.log").write_text(DURATIONS)
  assert sd.file_seconds(tmp_path / "suite.xml") == {"tests/model/test_transformer.py": 32.0,
                                                      "tests/test_notebook.py": 108.75}
  got = sd.file_seconds(tmp_path / "suite.log")
  assert got.keys() == {"tests/multidevice/test_sharded_train.py", "tests/model/test_layers.py"}
  assert got["tests/model/test_layers.py"] == pytest.approx(12.51)
  # junit_family=xunit1 names the file itself
  (tmp_path / "x1.xml").write_text('<testsuite><testcase classname="a.b" file="tests/x/test_y.py"'
                                   ' name="t" time="2.0"/></testsuite>')
  assert sd.file_seconds(tmp_path / "x1.xml") == {"tests/x/test_y.py": 2.0}


def test_record_orders_longest_first_and_unrecorded_files_after(tmp_path):
  record = tmp_path / "durations.txt"
  sd.write({"tests/a/test_short.py": 3.0, "tests/test_long.py": 90.5,
            "tests/b/test_mid.py": 40.0}, "a run of the suite, 2026-12-01", record)
  text = record.read_text()
  assert "# Source: a run of the suite, 2026-12-01" in text
  assert text.index("test_long.py") < text.index("test_mid.py") < text.index("test_short.py")
  files = ["tests/a/test_new.py", "tests/a/test_short.py", "tests/b/test_mid.py",
           "tests/c/test_other.py", "tests/test_long.py"]
  assert sorted(files, key=sd.rank_of(record)) == [
      "tests/test_long.py", "tests/b/test_mid.py", "tests/a/test_short.py",
      "tests/a/test_new.py", "tests/c/test_other.py"]
  assert sorted(files, key=sd.rank_of(tmp_path / "missing.txt")) == files  # no record


def test_a_report_without_durations_is_refused(tmp_path, capsys):
  (tmp_path / "out.log").write_text("453 passed in 1124.47s\n")
  with pytest.raises(SystemExit) as e:
    sd.main([str(tmp_path / "out.log"), "--source", "x", "--out", str(tmp_path / "d.txt")])
  assert e.value.code == 2 and "holds no test durations" in capsys.readouterr().err
  assert not (tmp_path / "d.txt").exists()


def test_the_committed_record_reads_and_starts_with_the_longest_file():
  rank = sd.rank_of()
  rows = [l.split() for l in sd.RECORD.read_text().splitlines() if not l.startswith("#")]
  assert len(rows) >= 10 and rank(rows[0][1]) == 0
  assert all(rank(f) == i for i, (_, f) in enumerate(rows))
  assert [float(s) for s, _ in rows] == sorted((float(s) for s, _ in rows), reverse=True)
