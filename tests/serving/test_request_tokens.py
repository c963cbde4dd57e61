"""The drafter service's record of each request's tokens (services/drafter/request_tokens.py):
tokens by position from context updates, forks, missing token ids refused, and a grammar
matcher that follows the output (against a fresh matcher fed the whole output at once)."""

from __future__ import annotations

import pytest

from dspark.structured_output import GrammarCompiler, GrammarRequest, GrammarSpec
from services.drafter.request_tokens import RequestTokens

EOS = 2


@pytest.fixture(scope="module")
def compiler(tmp_path_factory, save_json_tokenizer):
    folder = tmp_path_factory.mktemp("request_tokens")
    save_json_tokenizer(folder)
    return GrammarCompiler(folder, 64)


def test_tokens_by_position_forks_and_gaps():
    record = RequestTokens(None)
    record.record("r", [0, 1, 2], [5, 6, 7])
    record.record("r", [3, 4], [8, 9])
    assert record.through_anchor("r", 11, 5) == [5, 6, 7, 8, 9, 11]
    assert record.through_anchor("r", 11, 3) == [5, 6, 7, 11]
    record.fork("r", "c", 2)
    assert record.through_anchor("c", 4, 2) == [5, 6, 4]
    with pytest.raises(ValueError, match="token ids"):
        record.through_anchor("c", 4, 3)  # position 2 not in the child's context
    record.record("g", [0, 2], [1, 1])  # position 1 never sent
    with pytest.raises(ValueError, match="token ids"):
        record.through_anchor("g", 3, 3)
    record.record("n", [0, 1], None)  # an update without token ids
    with pytest.raises(ValueError, match="token ids"):
        record.through_anchor("n", 3, 2)
    record.release("r")
    with pytest.raises(ValueError):
        record.through_anchor("r", 11, 5)


def test_the_matcher_follows_the_output_and_rebuilds_on_a_different_one(compiler):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(compiler.tokenizer_dir)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    grammar = GrammarRequest(GrammarSpec.json_schema({"type": "object"}), (EOS,))
    record = RequestTokens(compiler)

    def same_mask(state, output) -> bool:
        fresh = compiler.start(grammar.spec, grammar.stop_token_ids)
        fresh.observe(output)
        return bool((state.allowed_tokens() == fresh.allowed_tokens()).all())

    first = record.grammar_state("r", grammar, encode('{"a'))
    assert same_mask(first, encode('{"a'))
    later = record.grammar_state("r", grammar, encode('{"ab":'))  # advanced, not rebuilt
    assert later is first and same_mask(later, encode('{"ab":'))
    other = record.grammar_state("r", grammar, encode('{"x'))  # not a continuation: rebuilt
    assert other is not first and same_mask(other, encode('{"x'))
    with pytest.raises(ValueError, match="refuses"):
        record.grammar_state("r", grammar, encode('{"x"}}'))
    with pytest.raises(ValueError, match="no tokenizer"):
        RequestTokens(None).grammar_state("r", grammar, encode("{"))
