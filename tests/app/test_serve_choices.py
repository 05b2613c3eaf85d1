"""`llamaterm serve`'s n choices, logprobs and logit_bias, with the default model on the CPU, through the official
`openai` client: seeded choices repeat, logprobs name the reply's own tokens (their values are the engine's,
checked against transformers in tests/engine/test_logprobs.py), and a bias moves the reply."""

import math

import openai
import pytest

from llamaterm.engine.store.loader import load_tokenizer
from tests.support.serve_support import llamaterm_serve

QUESTION = [{"role": "user", "content": "Name a colour."}]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client():
    with llamaterm_serve("--device", "cpu") as url:
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_n_seeded_choices_repeat_and_differ(client, model):
    ask = lambda: client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=12, temperature=1.0, seed=7, n=4
    )
    first, again = ask(), ask()
    replies = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert replies == [c.message.content for c in again.choices] and len(set(replies)) > 1
    one = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=1.0, seed=7)
    assert one.choices[0].message.content == replies[0]  # choice i samples with seed + i
    assert first.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert 4 <= first.usage.completion_tokens <= 4 * 12  # every choice's


def test_n_choices_stream_each_under_its_index(client, model):
    chunks = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=12, temperature=1.0, seed=7, n=3, stream=True
    )
    texts, reasons = ["", "", ""], [None, None, None]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    whole = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=1.0, seed=7, n=3)
    assert texts == [c.message.content for c in whole.choices] and all(reasons)


def test_chat_logprobs_name_the_replys_tokens(client, model):
    for stream in (False, True):
        reply = client.chat.completions.create(
            model=model, messages=QUESTION, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3, stream=stream
        )
        if stream:
            parts = [(c.choices[0].delta.content or "", c.choices[0].logprobs) for c in reply if c.choices]
            text = "".join(t for t, _ in parts)
            content = [x for _, lp in parts if lp for x in lp.content]
        else:
            text, content = reply.choices[0].message.content, reply.choices[0].logprobs.content
        assert "".join(x.token for x in content) == text
        for x in content:
            assert bytes(x.bytes).decode() == x.token and x.logprob <= 0
            tops = [t.logprob for t in x.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True)
            assert math.isclose(x.logprob, tops[0], abs_tol=1e-5)  # greedy: the likeliest token


def test_completion_logprobs_in_the_older_form(client, model):
    reply = client.completions.create(model=model, prompt="Red, green and", max_tokens=6, temperature=0, logprobs=2)
    lp, text = reply.choices[0].logprobs, reply.choices[0].text
    assert "".join(lp.tokens) == text and len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(
        len(top) == 2 and max(top.values()) >= v - 1e-5
        for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )


def test_logit_bias_moves_the_reply(client, model):
    (token,) = load_tokenizer(None).encode(" banana", add_special=False)
    plain = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=3, temperature=0)
    biased = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=3, temperature=0, logit_bias={str(token): 100}
    )
    assert "banana" not in plain.choices[0].message.content
    assert biased.choices[0].message.content == " banana" * 3
