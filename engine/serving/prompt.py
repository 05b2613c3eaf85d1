"""A request's prompt as token ids, checked against the model's limits before it reaches an engine's loop.

Encoding runs where the request is submitted, never on the engine's loop: in the caller's thread for the engine
in this process, in the parent process for the engine in a child (engine/serving/process.py), so the child's loop
spends no time on templates. Chat prompts repeat (a retry, another sample of the same conversation, a benchmark's
prompts), so the last encodings are kept.
"""

import json
from collections import OrderedDict

from llamaterm.engine.api import SubmitOptions
from llamaterm.engine.checkpoints.tokenizer import Tokenizer
from llamaterm.engine.errors import RequestError
from llamaterm.engine.thinking import opens_thinking

CACHED_PROMPTS = 256


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._cache: OrderedDict[str, tuple[list[int], bool]] = OrderedDict()

    def prompt_ids(self, prompt: list[dict] | str | None, options: SubmitOptions) -> tuple[list[int], bool]:
        """A request's (ids, whether a thinking block is open): the token ids it gives as they are, else its
        prompt encoded as its options say (engine.api.SubmitOptions)."""
        if (given := options.get("prompt_ids")) is not None:
            return list(given), False
        raw, parse_special = options.get("raw", False), options.get("parse_special", True)
        return self.encode(prompt or "", raw, options.get("enable_thinking"), parse_special, options.get("tools"))

    def encode(
        self,
        prompt: list[dict] | str,
        raw: bool = False,
        enable_thinking: bool | None = None,
        parse_special: bool = True,
        tools: list[dict] | None = None,
    ) -> tuple[list[int], bool]:
        """Chat messages or a string (a user message, or raw text with raw=True) -> (ids, whether the template
        left a thinking block open for the reply: R1 distills, QwQ). Raw text's special-token text
        ('<|im_start|>') becomes those tokens, as vLLM and llama.cpp's server read a prompt, unless
        parse_special=False; a message's content is always text (it cannot forge a turn). tools: the tools the
        chat template renders (engine/tool_calls.py for_template)."""
        if not isinstance(prompt, str | list):
            raise RequestError(f"a prompt is text or a list of chat messages, not {type(prompt).__name__}")
        if isinstance(prompt, str) and raw:
            if not prompt:
                raise RequestError("the prompt is empty: give some text")
            return self.raw_ids(prompt, parse_special), False
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not messages or not any(m.get("content") for m in messages):
            raise RequestError("the prompt is empty: give some text")
        key = json.dumps([messages, enable_thinking, tools], sort_keys=True, default=str)
        if (hit := self._cache.get(key)) is not None:
            self._cache.move_to_end(key)
            return list(hit[0]), hit[1]
        ids = self.tokenizer.encode_chat(messages, enable_thinking=enable_thinking, tools=tools)
        entry = ids, opens_thinking(self.tokenizer.decode(ids[-4:]))
        self._cache[key] = entry
        if len(self._cache) > CACHED_PROMPTS:
            self._cache.popitem(last=False)
        return list(ids), entry[1]

    def raw_ids(self, text: str, parse_special: bool) -> list[int]:
        """Raw text with the BOS the model asks for; a text that begins with the BOS token's own text (a Llama 3
        prompt written out whole) does not get a second one."""
        t = self.tokenizer
        ids = t.encode(text, parse_special=parse_special)
        if t.add_bos and t.bos_id is not None and ids[:2] == [t.bos_id, t.bos_id]:
            return ids[1:]
        return ids


def check_prompt(ids: list[int], vocab_size: int, max_context: int, pool_limit: int) -> None:
    """Refuse a prompt the model cannot take, with what to do about it."""
    if not ids:  # a reply samples from its prompt's last position
        raise RequestError("the prompt is empty (no tokens): give it some text")
    if any(not 0 <= i < vocab_size for i in ids):  # a tokenizer larger than the weights
        raise RequestError(
            f"the prompt has a token id outside the model's {vocab_size}-token "
            "vocabulary: its tokenizer and its weights do not match"
        )
    if len(ids) >= max_context:
        raise RequestError(
            f"the prompt is {len(ids)} tokens but the model's context holds {max_context}: "
            "shorten the prompt or start a new conversation"
        )
    if len(ids) >= pool_limit:
        raise RequestError(
            f"the prompt is {len(ids)} tokens but the KV cache pool holds {pool_limit}: shorten the prompt, "
            "or give the engine a larger pool (--kv-tokens)"
        )
