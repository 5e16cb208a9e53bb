"""`python -m sparse_lm.generate` on a checkpoint written the way the training loop writes one,
and the end-of-stage sample (train/sample.py) through the engine."""

import io
import re
import shutil
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from sparse_lm import generate as cli
from sparse_lm import sharding as shd
from sparse_lm.data.tokenizer import train_bpe
from sparse_lm.inference import Engine, SamplingParams
from sparse_lm.train import sample
from sparse_lm.train.builder import build
from sparse_lm.train.checkpoint import Checkpointer, make_meta
from sparse_lm.train.config import StageConfig
from sparse_lm.train.state import split_model
from tests import checkpoint_testlib

WORDS = "def return class import lambda yield print value index list dict".split()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """Two stages' checkpoints written as the training loop writes them (its builder's state,
  its meta); stage_64k is written last."""
  rng = np.random.default_rng(0)
  texts = [" ".join(rng.choice(WORDS, 40)) for _ in range(200)]
  tokenizer = train_bpe(iter(texts), vocab_size=300)
  root = tmp_path_factory.mktemp("run")
  mesh = shd.make_mesh(shd.MeshLayout())
  for name, step in (("stage_8k", 3), ("stage_64k", 5)):
    stage = StageConfig(name=name, preset="tiny", seq_len=64, tokens_per_batch=128, steps=10)
    parts = build(stage, mesh)
    state = parts.init().replace(step=jax.numpy.int32(step))
    ckpt = Checkpointer(root / name / "checkpoints", async_save=False)
    ckpt.save(state, data_state={},
              meta=make_meta(stage, tokenizer.fingerprint, tokenizer.to_json()))
    ckpt.close()
  model = nnx.merge(parts.graphdef, state.params, state.model_vars)
  return root, model, tokenizer


def test_cli_streams_the_engines_greedy_completion(workdir):
  root, model, tokenizer = workdir
  loaded, tok, where = cli.load_workdir(root)
  assert "stage_64k" in where and tok.fingerprint == tokenizer.fingerprint
  loaded2, _, meta = cli.load_checkpoint(root / "stage_64k" / "checkpoints" / "5")
  assert meta["step"] == 5
  for m in (loaded, loaded2):
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(m))):
      np.testing.assert_array_equal(a, b)
  out = io.StringIO()
  assert cli.main(["--workdir", str(root), "--prompt", "def ", "--max-new-tokens", "5",
                   "--max-length", "64", "--prefill-chunk", "64"], out=out) == 0
  ids = [tokenizer.bos_id] + tokenizer.encode("def ")
  engine = Engine(model, max_length=64, max_batch=1, prefill_chunk=64)
  want = engine.generate([ids], max_new_tokens=5, sampling=SamplingParams(
      temperature=0, stop_tokens=[tokenizer.eos_id]))[0].tokens
  assert out.getvalue() == "def " + tokenizer.decode(want, skip_special=True) + "\n"
  # The end-of-stage sample: the same engine, eos not returned.
  _, params, model_vars = split_model(model)
  got = sample.generate(nnx.graphdef(model), params, model_vars, ids, max_new_tokens=5,
                        eos_id=tokenizer.eos_id)
  assert got == [t for t in want if t != tokenizer.eos_id]


def test_cli_refuses_another_preset_before_compiling(workdir, capsys):
  root, _, _ = workdir
  for source in (["--workdir", str(root)],
                 ["--checkpoint", str(root / "stage_8k" / "checkpoints" / "3")]):
    with pytest.raises(SystemExit) as stop:  # argparse's exit: status 2, no traceback
      cli.main(source + ["--preset", "small", "--prompt", "x"])
    assert stop.value.code == 2
    assert re.search(r"error: --preset='small'.*'tiny' model.*--preset=tiny",
                     capsys.readouterr().err)
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    cli.main(["--workdir", str(root / "nothing"), "--prompt", "x"])
  with pytest.raises(FileNotFoundError, match="--checkpoint"):
    cli.main(["--checkpoint", str(root / "stage_8k"), "--prompt", "x"])
  # a step that was never saved: the message lists the steps there are
  saved = sorted(p.name for p in (root / "stage_8k" / "checkpoints").iterdir()
                 if p.name.isdigit())
  with pytest.raises(FileNotFoundError,
                     match=r"checkpoints/1000: no such checkpoint; the steps saved there: "
                           + ", ".join(sorted(saved, key=int))):
    cli.main(["--checkpoint", str(root / "stage_8k" / "checkpoints" / "1000"), "--prompt", "x"])


def test_cli_interactive_continues_the_state(workdir, monkeypatch):
  """Each stdin line is a turn continuing the previous turn's DecodeState."""
  root, model, tokenizer = workdir
  monkeypatch.setattr("sys.stdin", io.StringIO("return\nclass value\n"))
  out = io.StringIO()
  assert cli.main(["--workdir", str(root), "--interactive", "--prompt", "def ",
                   "--max-new-tokens", "4", "--max-length", "64", "--prefill-chunk", "64"],
                  out=out) == 0
  engine = Engine(model, max_length=64, max_batch=1, prefill_chunk=64)
  sp = SamplingParams(temperature=0, stop_tokens=[tokenizer.eos_id])
  state, want = None, "def "
  for text in ("def ", "return", "class value"):
    ids = tokenizer.encode(text) if state else [tokenizer.bos_id] + tokenizer.encode(text)
    res = engine.generate([ids], max_new_tokens=4, sampling=sp, states=[state])[0]
    want += tokenizer.decode(res.tokens, skip_special=True) + "\n"
    state = res.state
  assert out.getvalue() == want


@pytest.mark.parametrize("flags, want", [
    (["--temperature", "-1"], r"--temperature=-1.0 must be finite and >= 0"),
    (["--temperature", "inf"], r"--temperature=inf must be finite and >= 0"),
    (["--top-p", "1.5"], r"--top-p"),
    (["--max-new-tokens", "0"], r"--max-new-tokens=0 must be >= 1"),
    # out of the engine's integer ranges: OverflowError tracebacks before
    (["--max-new-tokens", "2147483648"], r"--max-new-tokens=2147483648 must be >= 1 \(and < "),
    (["--top-k", "3000000000"], r"--top-k=3000000000 must be an int in \[0, 2\*\*31\)"),
    (["--seed", str(2**70)], r"--seed=1180591620717411303424 must be a 64-bit int"),
])
def test_cli_errors_name_the_flag_before_loading(flags, want, capsys, tmp_path):
  """Bad numbers stop with argparse's status 2 and the flag's name (not the engine's argument
  name), before any checkpoint is read (the workdir here does not exist)."""
  with pytest.raises(SystemExit) as e:
    cli.main(["--workdir", str(tmp_path / "none"), "--prompt", "x"] + flags)
  assert e.value.code == 2
  assert re.search(want, capsys.readouterr().err)


def test_text_stream_holds_back_a_character_cut_between_bursts():
  """A burst that ends inside a multi-byte UTF-8 character (a byte-level tokenizer decodes the
  partial bytes as U+FFFD) must not stop the stream: the text written is the whole
  completion, each character once, for every place the bursts can be cut."""
  text = "héllo 日本 def \u05f9otb"
  data = list(text.encode("utf-8"))  # one token per byte, as a byte-level BPE can emit
  decode = lambda toks: bytes(toks).decode("utf-8", errors="replace")
  for cut in range(1, len(data)):
    for burst in (1, 2, 3, 5):
      out = io.StringIO()
      s = cli.TextStream(decode, out)
      ends = sorted({*range(cut, len(data), burst), len(data)})
      for end in ends:
        s.update(data[:end])
      s.finish(data)
      assert out.getvalue() == text, (cut, burst)
  out = io.StringIO()  # still cut at the end: finish writes the replacement character
  s = cli.TextStream(decode, out)
  s.update(data[:2])
  s.finish(data[:2])
  assert out.getvalue() == "h\ufffd"


def test_cli_refusals_echo_nothing_and_a_full_session_ends_cleanly(workdir, monkeypatch, capsys):
  """A prompt the engine refuses (too long) stops with status 2 before the prompt is echoed;
  in --interactive a refused line is reported and the session goes on from the state before
  it, and once the history reaches --max-length the session ends with status 0 and says so;
  a stage directory passed as --workdir names the workdir above it."""
  root, _, _ = workdir
  flags = ["--max-new-tokens", "4", "--max-length", "24", "--prefill-chunk", "64"]
  out = io.StringIO()
  with pytest.raises(SystemExit) as stop:
    cli.main(["--workdir", str(root), "--prompt", "def " * 40] + flags, out=out)
  assert stop.value.code == 2 and out.getvalue() == ""
  err = capsys.readouterr().err
  assert "exceed the engine's --max-length=24; shorten it or raise --max-length" in err, err
  monkeypatch.setattr("sys.stdin", io.StringIO("return " * 40 + "\nreturn\nclass\nvalue\n"
                                               "index\nlist\ndict\nprint\n"))
  out = io.StringIO()
  flags[1] = "8"  # 8 new tokens a turn: the third turn reaches the 24 tokens of history
  assert cli.main(["--workdir", str(root), "--interactive", "--prompt", "def "] + flags,
                  out=out) == 0
  err = capsys.readouterr().err
  assert "[not sent: " in err and "--max-length" in err
  assert err.count("the session ends") == 1
  assert out.getvalue().startswith("def ") and out.getvalue().count("\n") == 3
  # ended at once: the line after the last turn was not read (at a terminal the session
  # used to wait for one more line, then drop it)
  assert sys.stdin.read() == "value\nindex\nlist\ndict\nprint\n"
  with pytest.raises(FileNotFoundError, match=r"is a stage directory: pass --workdir "
                     + re.escape(str(root)) + " --stage stage_8k"):
    cli.main(["--workdir", str(root / "stage_8k"), "--prompt", "x"])
  from sparse_lm.train import load  # the Python loader says the same in its own terms
  with pytest.raises(FileNotFoundError, match=r"is a stage directory: load it with load\("
                     + re.escape(repr(str(root.absolute()))) + r", stage='stage_8k'\)"):
    load(root / "stage_8k")
  with pytest.raises(SystemExit) as stop:
    cli.main(["--workdir", str(root), "--prompt", ""])
  assert stop.value.code == 2 and "--prompt is empty" in capsys.readouterr().err


def test_unreadable_checkpoints_and_a_stray_stage_flag_are_one_message(workdir, tmp_path,
                                                                        capsys):
  """A corrupt checkpoint (its arrays truncated) through --checkpoint or --workdir, as the
  command runs it (`entry`): one message naming the checkpoint, status 1, no traceback;
  --stage beside --checkpoint: status 2."""
  root = workdir[0]
  corrupt = tmp_path / "run"
  shutil.copytree(root / "stage_8k", corrupt / "stage_8k")
  step_dir = corrupt / "stage_8k" / "checkpoints" / "3"
  checkpoint_testlib.truncate_arrays(step_dir)
  got = cli.entry(["--checkpoint", str(step_dir), "--prompt", "x"])
  assert isinstance(got, str) and f"--checkpoint {step_dir}: its state cannot be read" in got
  with pytest.warns(RuntimeWarning, match="no older checkpoint"):
    got = cli.entry(["--workdir", str(corrupt), "--prompt", "x"])
  assert isinstance(got, str) and "no readable checkpoint in" in got, got
  assert "nothing was moved" in got and (step_dir.is_dir())  # a reader moves nothing
  assert "Traceback" not in capsys.readouterr().err
  with pytest.raises(SystemExit) as e:
    cli.main(["--checkpoint", str(step_dir), "--stage", "stage_8k", "--prompt", "x"])
  assert e.value.code == 2 and "drop --stage" in capsys.readouterr().err
