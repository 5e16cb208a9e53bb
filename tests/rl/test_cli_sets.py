"""`python -m experiments.agentic_rl`'s --set and path errors: one line naming the key and the
fix, status 2, before anything is built (no tracebacks: AttributeError, TypeError, OSError)."""

import pytest

from experiments import agentic_rl
from experiments.agentic_rl import PRESETS, apply_sets


@pytest.mark.parametrize("args, message", [
    # a group of settings set as a value: an AttributeError in validate() before
    (["--set", "grpo=5"], r"--set grpo='5': grpo is a group of settings; set its fields one by "
     r"one, e.g. --set grpo.group_size=VALUE"),
    (["--set", 'sft_optim={"peak_lr": 1}'], r"sft_optim is a group of settings"),
    # a typo inside a group lists that group's fields, not RLConfig's
    (["--set", "grpo.group_sise=3"], r"unknown --set key 'grpo.group_sise'; grpo.<field> is "
     r"one of \['group_size'"),
    # a None-valued field takes its annotation's type: a str path, an int length
    (["--set", "sft_seq_len=abc"], r"--set sft_seq_len='abc' must be an integer"),
    # model_overrides: ModelConfig's names and types (was: "'<=' not supported between str, int")
    (["--set", 'model_overrides=[["num_layers", "five"]]'],
     r"model_overrides.num_layers='five': expected an int"),
    (["--set", 'model_overrides=[["num_layer", 3]]'],
     r"unknown ModelConfig field 'num_layer'; did you mean num_layers"),
    # paths: a workdir that cannot be made (was a FileNotFoundError traceback from run()); an
    # --init_from that is a file is asked to be an existing directory, not "new or existing"
    (["--workdir", "/proc/sparse_lm_nope"], r"--workdir=/proc/sparse_lm_nope: cannot create it "
     r"\(FileNotFoundError.*give a directory you can write"),
])
def test_cli_refuses_with_one_line_naming_the_key(args, message, capsys):
  with pytest.raises(SystemExit) as e:
    agentic_rl.main(["--preset=tiny", *args])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err
  assert __import__("re").search(message, err), err


def test_init_from_a_file_is_asked_to_be_an_existing_directory(tmp_path, capsys):
  f = tmp_path / "f"
  f.write_text("x")
  with pytest.raises(SystemExit):
    agentic_rl.main(["--preset=tiny", f"--init_from={f}", f"--workdir={tmp_path}/rl"])
  assert f"--init_from={f}: is a file; give an existing directory" in capsys.readouterr().err


def test_typed_sets_that_are_valid_still_apply():
  cfg = apply_sets(PRESETS["tiny"], ["sft_seq_len=40", "init_from=runs/x", "sft_seq_len=null",
                                     'model_overrides=[["num_layers", "3"], ["mla_every", 2]]'])
  assert cfg.sft_seq_len is None and cfg.init_from == "runs/x"
  assert cfg.model_overrides == (("num_layers", 3), ("mla_every", 2))
