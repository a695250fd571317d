"""A prompt the model's tokenizer or vocabulary cannot take is a 400 with a code naming why
(server/api/serving/requests.py `prompt_tokens`), never the tokenizer's ValueError (a 500): a
word a word-level vocabulary without <unk> lacks, a token id outside the vocabulary. (Token ids
over HTTP and the websocket: tests/e2e/test_user_input_refusals.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from xlserve.models.tokenizer import WordTokenizer
from xlserve.server.api.errors import InvalidRequest
from xlserve.server.api.serving.requests import prompt_tokens

STATE = SimpleNamespace(settings=SimpleNamespace(server=SimpleNamespace(max_prompt_bytes=1000)))


def served_with(tokenizer) -> SimpleNamespace:
    return SimpleNamespace(tokenizer=tokenizer, vocab_size=tokenizer.vocab_size)


def test_a_word_the_vocabulary_lacks_is_400_word_not_in_vocabulary():
    served = served_with(WordTokenizer(["<eos>", "hello", "world"]))  # no <unk>
    assert prompt_tokens(STATE, served, "hello world") == [1, 2]
    with pytest.raises(InvalidRequest) as refused:
        prompt_tokens(STATE, served, "hello there", param="text")
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, "word_not_in_vocabulary", "text")
    assert "'there' is not in the vocabulary" in refused.value.message


@pytest.mark.parametrize("token", [-1, 3, 2**40])
def test_a_token_id_outside_the_vocabulary_is_400_token_id_out_of_vocabulary(token):
    served = served_with(WordTokenizer(["<eos>", "hello", "world"]))
    with pytest.raises(InvalidRequest) as refused:
        prompt_tokens(STATE, served, [1, token])
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, "token_id_out_of_vocabulary",
                                                                              "prompt")
