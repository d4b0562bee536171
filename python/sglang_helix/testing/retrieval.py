"""Long-context retrieval prompts for a trained model, sent through SGLang's OpenAI API.

A passkey task (the single-key "needle" of RULER): an instruction, a haystack of filler text of a
given token length, one five-digit key hidden at a given depth (0 = right after the instruction,
1 = right before the question), and a question the model completes. A greedy answer retrieves the
key when the key's digits are in its text. ``multikey_prompt`` hides several keys (each with its
own name) and asks for one of them; ``kv_lookup_prompt`` is RULER's key-value lookup (pairs of
random-looking ids, one asked for).

Prompts are sized with the checkpoint's own tokenizer (``tokenizer.json``), so "4K" is 4096 tokens
of this model give or take one filler sentence. Everything is deterministic (seeded keys).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

from sglang_helix.testing.openai_probe import Generation, _top2

INSTRUCTION = (
    "There is an important pass key hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the pass key.\n"
)
# The haystack: plain sentences, cycled (our own text; RULER's "noise" haystack is of this kind).
FILLER = [
    "The grass is green. ",
    "The sky is blue. ",
    "The sun is yellow. ",
    "Here we go. ",
    "There and back again. ",
]
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"

MULTI_NEEDLE = "The pass key of the {name} door is {key}. Remember it.\n"
MULTI_QUESTION = "\nWhat is the pass key of the {name} door? The pass key of the {name} door is"
DOOR_NAMES = ["red", "blue", "green", "yellow", "black", "white", "silver", "golden"]


@dataclass(frozen=True)
class RetrievalPrompt:
    name: str
    text: str
    answer: str  # the digits the answer must contain
    tokens: int  # prompt length in this model's tokens
    needle_positions: tuple = field(default=())  # token position of each needle's first token


def _tokenizer(model_dir: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))


def _count(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False).ids)


def _haystack_units(n: int) -> list[str]:
    return [FILLER[i % len(FILLER)] for i in range(n)]


def _fit(tok, build, length: int) -> tuple[str, int]:
    """Largest filler count whose prompt ``build(n)`` is at most ``length`` tokens."""
    lo, hi = 0, 4 * length
    while lo < hi:  # binary search on the sentence count
        mid = (lo + hi + 1) // 2
        if _count(tok, build(mid)[0]) <= length:
            lo = mid
        else:
            hi = mid - 1
    text, _ = build(lo)
    return text, lo


def key_for(seed: int) -> str:
    return str(random.Random(seed).randint(10000, 99999))


def passkey_prompt(model_dir: str, length: int, depth: float, seed: int = 0, tok=None) -> RetrievalPrompt:
    """One key at ``depth`` (fraction of the haystack before it) of a ``length``-token prompt."""
    tok = tok or _tokenizer(model_dir)
    key = key_for(seed * 1000 + length + int(depth * 100))
    needle = NEEDLE.format(key=key)

    def build(n):
        units = _haystack_units(n)
        at = round(depth * n)
        before = INSTRUCTION + "".join(units[:at])
        return before + needle + "".join(units[at:]) + QUESTION, before

    text, n = _fit(tok, build, length)
    before = build(n)[1]
    return RetrievalPrompt(f"passkey-{length}-d{int(round(depth * 100))}", text, key, _count(tok, text), (_count(tok, before),))


def multikey_prompt(model_dir: str, length: int, keys: int = 4, ask: int = 0, seed: int = 0, tok=None) -> RetrievalPrompt:
    """``keys`` named keys spread evenly over the haystack; the question asks for the ``ask``-th."""
    tok = tok or _tokenizer(model_dir)
    rng = random.Random(seed * 7919 + length * 31 + keys)
    names = rng.sample(DOOR_NAMES, keys)
    values = [str(rng.randint(10000, 99999)) for _ in range(keys)]

    def build(n):
        units = _haystack_units(n)
        cuts = [round((i + 0.5) * n / keys) for i in range(keys)]
        text, befores, prev = INSTRUCTION, [], 0
        for name, key, cut in zip(names, values, cuts):
            text += "".join(units[prev:cut])
            befores.append(text)
            text += MULTI_NEEDLE.format(name=name, key=key)
            prev = cut
        return text + "".join(units[prev:]) + MULTI_QUESTION.format(name=names[ask]), befores

    text, n = _fit(tok, lambda m: (build(m)[0], None), length)
    befores = build(n)[1]
    return RetrievalPrompt(
        f"multikey{keys}-{length}-ask{ask}", text, values[ask], _count(tok, text), tuple(_count(tok, b) for b in befores)
    )


def kv_lookup_prompt(model_dir: str, length: int, depth: float = 0.5, seed: int = 0, tok=None) -> RetrievalPrompt:
    """RULER's key-value lookup: a JSON-ish list of ``"key": "value"`` pairs of five-digit ids
    (instead of filler) and a question for the value of one key at ``depth``."""
    tok = tok or _tokenizer(model_dir)
    rng = random.Random(seed * 104729 + length)
    head = "Below is a list of numbered lockers and their codes. Find the code of the locker asked for.\n"

    def pairs(n):
        r = random.Random(rng.random())
        return [(str(r.randint(10000, 99999)), str(r.randint(10000, 99999))) for _ in range(n)]

    def build(n):
        ps = pairs(n)
        i = min(n - 1, round(depth * (n - 1))) if n else 0
        lines = [f"Locker {k} has code {v}.\n" for k, v in ps]
        asked = ps[i] if n else ("0", "0")
        return head + "".join(lines) + f"\nWhat is the code of locker {asked[0]}? The code of locker {asked[0]} is", (head + "".join(lines[:i]), asked[1])

    lo, hi = 1, length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _count(tok, build(mid)[0]) <= length:
            lo = mid
        else:
            hi = mid - 1
    text, (before, value) = build(lo)
    return RetrievalPrompt(f"kvlookup-{length}-d{int(round(depth * 100))}", text, value, _count(tok, text), (_count(tok, before),))


def shared_prefix_prompts(
    model_dir: str, prefix_length: int = 2048, keys: int = 4, suffix_sentences: int = 24, seed: int = 0, tok=None
) -> list[RetrievalPrompt]:
    """``keys`` prompts that share one ``prefix_length``-token prefix (the instruction and filler)
    and differ after it: each has its own key right after the prefix, then ``suffix_sentences``
    more filler sentences and the question. A server with a radix cache serves the later prompts'
    prefix from the first one's KV; each key is new prefill over that cached prefix."""
    tok = tok or _tokenizer(model_dir)

    def build(n):
        return INSTRUCTION + "".join(_haystack_units(n)), None

    prefix, n = _fit(tok, build, prefix_length)
    tail = "".join(_haystack_units(n + suffix_sentences)[n:])
    at = _count(tok, prefix)
    values, out = [], []
    for i in range(keys):
        seed_i = seed * 1000 + 7919 + i
        key = key_for(seed_i)
        while key in values:  # distinct keys: an answer cannot come from another prompt's cache
            seed_i += 101
            key = key_for(seed_i)
        values.append(key)
        text = prefix + NEEDLE.format(key=key) + tail + QUESTION
        out.append(RetrievalPrompt(f"shared{prefix_length}-key{i}", text, key, _count(tok, text), (at,)))
    return out


def retrieved(prompt: RetrievalPrompt, text: str) -> bool:
    return prompt.answer in "".join(text.split())


def _client(base_url: str, timeout: float):
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", timeout=timeout, max_retries=0)


def ask_one(client, p: RetrievalPrompt, max_tokens: int = 8) -> tuple[Generation, int | None]:
    """One greedy completion of ``p`` with its logprobs and top-2 logprobs, and the prompt tokens the
    server took from its radix cache (``usage.prompt_tokens_details``; None unless the server runs
    with ``--enable-cache-report``)."""
    r = client.completions.create(
        model="default", prompt=p.text, max_tokens=max_tokens, temperature=0, logprobs=2,
    )  # fmt: skip
    c = r.choices[0]
    lp = c.logprobs
    details = getattr(r.usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    return Generation(c.text, list(lp.tokens), list(lp.token_logprobs), [_top2(t) for t in lp.top_logprobs]), cached


def ask(base_url: str, prompts, max_tokens: int = 8, timeout: float = 1800) -> list[Generation]:
    """Greedy completions of ``prompts`` (one request each, in order, so that prompts that share a
    prefix meet the radix cache as a user's would), with their logprobs and top-2 logprobs."""
    client = _client(base_url, timeout)
    return [ask_one(client, p, max_tokens)[0] for p in prompts]


def ask_first_then_together(base_url: str, prompts, max_tokens: int = 8, timeout: float = 1800) -> list:
    """The first prompt alone (it fills the radix cache with the shared prefix), then all the others
    at once (one client thread each: they meet the cache and decode in one batch). ``[(Generation,
    cached prompt tokens)]`` in ``prompts``' order."""
    from concurrent.futures import ThreadPoolExecutor

    client = _client(base_url, timeout)
    first = ask_one(client, prompts[0], max_tokens)
    with ThreadPoolExecutor(max(1, len(prompts) - 1)) as pool:
        rest = list(pool.map(lambda p: ask_one(client, p, max_tokens), prompts[1:]))
    return [first, *rest]
