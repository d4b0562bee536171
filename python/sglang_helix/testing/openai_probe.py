"""Send the standard probe requests through SGLang's OpenAI-compatible API and compare layouts.

``Generation`` is one greedy answer: its token strings, their logprobs, and the top-2 logprobs at
each step. ``assert_same_generation`` compares a candidate against a reference:

- tokens must be equal up to the first step where the *reference* is indecisive (top-1 minus
  top-2 logprob below ``MARGIN``): past that point two exact-up-to-rounding layouts may
  legitimately diverge, so nothing after it is compared;
- every compared step's logprob, and its top-2 logprobs, must agree within ``atol``.

float32 layouts that only reassociate sums agree to ~1e-5 in logprob on the tiny models; a wrong
attention result (a KV shard missing, duplicated, or merged with the wrong weights) moves them by
orders of magnitude more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MARGIN = 1e-3  # nats: a step decided by less than this is not compared
LOGPROB_ATOL = 1e-4  # float32
# float32, relative: a logprob of magnitude |lp| may move by 2^-15 |lp| (256 ulps) more when
# attention sums in another order (Helix's grouped einsum and split shards against plain TP's
# SDPA); top-1 logprobs are near 0 and keep LOGPROB_ATOL.
LOGPROB_RTOL = 2.0**-15

PROMPTS = [
    "the quick brown fox",
    "attention head query key value cache token sequence shard rank merge parallel helix",
    " ".join(["river mountain city garden music paper light stone water fire"] * 6),
    "a",
]
CHAT = [
    {"role": "system", "content": "you are a tiny model"},
    {"role": "user", "content": "decode the long context with helix please"},
]


@dataclass
class Generation:
    text: str
    tokens: list[str]
    logprobs: list[float]
    top2: list[list[float]] = field(default_factory=list)  # sorted descending

    def decisive_prefix(self, margin: float = MARGIN) -> int:
        for i, t in enumerate(self.top2):
            if len(t) > 1 and t[0] - t[1] < margin:
                return i + 1  # step i itself is compared (its token is the reference's pick)
        return len(self.tokens)


def assert_same_generation(
    ref: Generation, got: Generation, atol: float = LOGPROB_ATOL, what: str = "", margin: float = MARGIN
):
    n = ref.decisive_prefix(margin)
    assert got.tokens[:n] == ref.tokens[:n], f"{what}: tokens differ within the decisive prefix ({n})\nref={ref.tokens[:n]}\ngot={got.tokens[:n]}"
    bound = lambda b: atol + LOGPROB_RTOL * abs(b)  # noqa: E731
    for i in range(n):
        d = abs(got.logprobs[i] - ref.logprobs[i])
        assert d <= bound(ref.logprobs[i]), f"{what}: step {i} logprob {got.logprobs[i]} vs {ref.logprobs[i]} (|d|={d:.2e} > {bound(ref.logprobs[i]):.2e})"
        for a, b in zip(got.top2[i], ref.top2[i]):
            assert abs(a - b) <= bound(b), f"{what}: step {i} top-2 logprobs {got.top2[i]} vs {ref.top2[i]}"


def _top2(d) -> list[float]:
    if d is None:
        return []
    if isinstance(d, dict):
        vals = list(d.values())
    else:  # chat: list of objects with .logprob
        vals = [x.logprob for x in d]
    return sorted(vals, reverse=True)[:2]


def completions(client, prompts=PROMPTS, max_tokens: int = 16) -> list[Generation]:
    r = client.completions.create(
        model="default", prompt=list(prompts), max_tokens=max_tokens, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    out = [None] * len(prompts)
    for c in r.choices:
        lp = c.logprobs
        out[c.index] = Generation(c.text, list(lp.tokens), list(lp.token_logprobs), [_top2(t) for t in lp.top_logprobs])
    return out


def completion_stream(client, prompt: str = PROMPTS[1], max_tokens: int = 16) -> str:
    stream = client.completions.create(
        model="default", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


def chat_response(client, messages=CHAT, max_tokens: int = 16):
    """``(Generation, the raw response)``: the response carries ``usage`` (cached tokens with
    ``--enable-cache-report``)."""
    r = client.chat.completions.create(
        model="default", messages=messages, max_tokens=max_tokens, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    c = r.choices[0]
    content = c.logprobs.content
    gen = Generation(c.message.content, [t.token for t in content], [t.logprob for t in content], [_top2(t.top_logprobs) for t in content])
    return gen, r


def chat(client, messages=CHAT, max_tokens: int = 16) -> Generation:
    return chat_response(client, messages, max_tokens)[0]


def chat_stream(client, messages=CHAT, max_tokens: int = 16) -> str:
    stream = client.chat.completions.create(
        model="default", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return "".join((chunk.choices[0].delta.content or "") for chunk in stream if chunk.choices)


@dataclass
class ProbeResult:
    completions: list[Generation]
    completion_stream: str
    chat: Generation
    chat_stream: str


def probe(base_url: str, max_tokens: int = 16) -> ProbeResult:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", timeout=600, max_retries=0)
    return ProbeResult(
        completions=completions(client, max_tokens=max_tokens),
        completion_stream=completion_stream(client, max_tokens=max_tokens),
        chat=chat(client, max_tokens=max_tokens),
        chat_stream=chat_stream(client, max_tokens=max_tokens),
    )


def assert_same_probe(
    ref: ProbeResult, got: ProbeResult, atol: float = LOGPROB_ATOL, what: str = "", margin: float = MARGIN
):
    for i, (r, g) in enumerate(zip(ref.completions, got.completions)):
        assert_same_generation(r, g, atol, f"{what} completion[{i}]", margin)
    assert_same_generation(ref.chat, got.chat, atol, f"{what} chat", margin)
    # Streaming must deliver the non-streaming text of the same layout (where greedy is decisive).
    if ref.completions[1].decisive_prefix(margin) == len(ref.completions[1].tokens):
        assert got.completion_stream == got.completions[1].text, f"{what}: streamed completion differs"
    if ref.chat.decisive_prefix(margin) == len(ref.chat.tokens):
        assert got.chat_stream == got.chat.text, f"{what}: streamed chat differs"


# ---------------------------------------------------------------------------------------------
# Long prompts and concurrency (the Helix end-to-end matrix)
# ---------------------------------------------------------------------------------------------
_WORDS = "attention head query key value cache token sequence shard rank merge parallel helix decode prefill chunk layer model tensor kernel".split()
# ~300 tokens: with --helix-kvp-chunk-size 4 it spans ~75 ownership chunks, and with
# --chunked-prefill-size 64 it is prefilled in several chunks over an already-sharded prefix.
LONG_PROMPT = " ".join(_WORDS[(i * 7) % len(_WORDS)] for i in range(260))
# Mixed lengths for the concurrency waves (1 to ~60 tokens).
WAVE_PROMPTS = [" ".join(_WORDS[(i * j) % len(_WORDS)] for i in range(n)) for j, n in enumerate((1, 3, 6, 9, 14, 20, 28, 40), start=3)]
WAVE_SIZES = (1, 2, 7, 16, 32, 64)


def _client(base_url: str):
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", timeout=900, max_retries=0)


def long_completion(base_url: str, max_tokens: int = 16) -> Generation:
    return completions(_client(base_url), [LONG_PROMPT], max_tokens=max_tokens)[0]


# Prompts of exact token counts (ids, no tokenizer in between): shorter than a 4-token ownership
# chunk, one 8-token Helix page (chunk 4 x KVP 2), two pages (one at KVP 4), and one past a page.
SIZED_PROMPTS = [[(7 * i + 3 * n) % 400 + 10 for i in range(n)] for n in (3, 8, 16, 21)]


def generate_ids(base_url: str, input_ids: list, max_tokens: int = 8) -> Generation:
    """One greedy ``/generate`` of token ids (sglang-router's OpenAI routes take text prompts only)."""
    return generation_of(generate_ids_meta(base_url, input_ids, max_tokens))


def generate_ids_meta(base_url: str, input_ids: list, max_tokens: int = 8) -> dict:
    """One greedy ``/generate`` of token ids: its ``meta_info`` (logprobs, top-2, cached tokens)."""
    import json
    import urllib.request

    body = {"input_ids": input_ids, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    req = urllib.request.Request(base_url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.loads(r.read())["meta_info"]


def generation_of(meta: dict) -> Generation:
    steps = meta["output_token_logprobs"]  # [(logprob, token id, text)]
    top2 = [sorted((x[0] for x in step), reverse=True)[:2] for step in meta["output_top_logprobs"]]
    return Generation("", [str(t[1]) for t in steps], [t[0] for t in steps], top2)


def sized_completions(base_url: str, max_tokens: int = 8) -> list[Generation]:
    return [generate_ids(base_url, ids, max_tokens) for ids in SIZED_PROMPTS]


def single_completions(base_url: str, prompts=WAVE_PROMPTS, max_tokens: int = 4) -> list[Generation]:
    """Reference answers, one per distinct prompt (greedy answers do not depend on batching)."""
    return completions(_client(base_url), list(prompts), max_tokens=max_tokens)


def concurrent_waves(base_url: str, sizes=WAVE_SIZES, prompts=WAVE_PROMPTS, max_tokens: int = 4) -> dict:
    """For each size n, n concurrent single-prompt requests (prompt i % len(prompts)).

    Returns ``{n: [(prompt_index, Generation), ...]}``.
    """
    from concurrent.futures import ThreadPoolExecutor

    out = {}
    for n in sizes:
        def one(i):
            return i % len(prompts), completions(_client(base_url), [prompts[i % len(prompts)]], max_tokens=max_tokens)[0]

        with ThreadPoolExecutor(max_workers=n) as pool:
            out[n] = list(pool.map(one, range(n)))
    return out
