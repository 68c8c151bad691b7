"""The worker's grammar view of the tokenizer, built while the model loads and waited for before serving
(``serving/grammar_view.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.engine.factory import constraint_set
from deepinfer.engine.model_dir import resolve_model_dir
from deepinfer.grammar import vocab
from deepinfer.serving import grammar_view


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_gv") / "m", seed=0)


def test_the_view_built_ahead_is_the_one_the_constraints_take(model_dir: Path) -> None:
    vocab._tokenizer_info.cache_clear()
    ahead = grammar_view.start_ahead(str(model_dir))
    assert ahead is not None
    ahead.join()
    assert vocab._tokenizer_info.cache_info().currsize == 1  # built in the thread, before any constraint set
    cs = constraint_set(*resolve_model_dir(model_dir))
    grammar_view.ready(cs, None)
    assert vocab._tokenizer_info.cache_info().misses == 1  # taken from the cache, not built again
    assert cs._info is vocab.build_tokenizer_info(model_dir)


def test_a_hub_id_is_left_to_the_loading() -> None:
    assert grammar_view.start_ahead("deepseek-ai/not-a-local-directory") is None


def test_a_view_that_cannot_be_built_leaves_the_worker_serving() -> None:
    class Broken:
        def warm(self) -> None:
            raise ValueError("no tokenizer")

    grammar_view.ready(Broken(), None)  # logged (grammar_view_unavailable), not raised
