"""Fixtures shared with tests/train: the session tokenizer and a fresh workdir."""

from tests.train.conftest import tokenizer_json, workdir  # noqa: F401  pylint: disable=unused-import
