"""Soak: many concurrent clients, every request kind, the same requests against two servers.

``make_requests(count, seed, ...)`` draws a reproducible request list; ``run(base_url, requests,
clients)`` sends it from ``clients`` concurrent threads and returns one ``Outcome`` per request;
``compare(reference, candidate)`` lists every request whose outcome differs. The driver
(``benchmark/soak_helix.py``) and the CI test (``test/test_helix_soak.py``) run it against plain
``--tp N`` and Helix with the same, deliberately small, KV pool.

Request kinds (``KINDS``): OpenAI completions and chat, streamed and not, ``n`` > 1, stop
strings; ``/generate`` streamed and not; clients that close the stream mid-way; ``/generate``
streams aborted through ``/abort_request``; prompts longer than the context and prompts longer
than the KV pool (both must fail with the reference's HTTP status and message). Prompts run from
1 token to several thousand, and a third of them extend one of a few shared prefixes (prefix-cache
hits). Everything is greedy: a completed request has one right answer, the reference's, up to
its first indecisive step (``openai_probe.assert_same_generation``).
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from sglang_helix.testing.openai_probe import LOGPROB_ATOL, MARGIN, Generation, assert_same_generation

# kind -> weight in the mix
KINDS = {
    "completion": 20, "completion_stream": 14, "chat": 12, "chat_stream": 10,
    "generate": 14, "generate_stream": 10, "disconnect": 6, "abort": 6,
    "over_context": 4, "over_pool": 4,
}  # fmt: skip
# Kinds whose outcome is not a completed generation (nothing to compare beyond "no error").
INTERRUPTED = ("disconnect", "abort")
# Streams whose logprobs may skip tokens (see _differs): compared by their text.
OPENAI_STREAMS = ("completion_stream", "chat_stream")
FIRST_ID, LAST_ID = 10, 400  # plain tokens of the tiny models' vocabulary (no special token)
WORDS = "river mountain city garden music paper light stone water fire cloud forest ocean attention head query key value cache".split()
STOPS = [" the", "e", "an", ".", "ing"]
REQUEST_TIMEOUT = 900.0  # s: a request not answered by then is a hang


@dataclass(frozen=True)
class Request:
    index: int
    kind: str
    prompt: tuple = ()  # token ids (completions, /generate)
    text: str = ""  # chat message
    max_tokens: int = 16
    n: int = 1
    stop: tuple = ()
    cut_after: int = 0  # disconnect / abort: after this many streamed chunks


@dataclass
class Outcome:
    status: int  # HTTP status (0: no answer / connection error)
    error: str = ""  # the server's error message, for a status other than 200
    finish: list = field(default_factory=list)  # per choice: length / stop / abort
    gens: list = field(default_factory=list)  # per choice: Generation
    texts: list = field(default_factory=list)  # per choice
    seconds: float = 0.0
    note: str = ""

    def to_json(self) -> dict:
        d = asdict(self)
        d["gens"] = [asdict(g) for g in self.gens]
        return d


def _length(rng: random.Random, pool_tokens: int) -> int:
    """Prompt length: mostly short, a tail of long ones up to ~85% of the pool."""
    r = rng.random()
    if r < 0.55:
        return rng.randint(1, 64)
    if r < 0.85:
        return rng.randint(65, 600)
    if r < 0.96:
        return rng.randint(601, pool_tokens // 2)
    return rng.randint(pool_tokens // 2, int(pool_tokens * 0.85))


def _max_tokens(rng: random.Random) -> int:
    r = rng.random()
    return rng.randint(1, 16) if r < 0.5 else rng.randint(17, 64) if r < 0.85 else rng.randint(65, 300)


def make_requests(count: int, seed: int, context_len: int, pool_tokens: int, num_prefixes: int = 4) -> list:
    """``count`` requests, reproducible from ``seed``. ``pool_tokens``: the KV pool's token
    capacity (``over_pool`` prompts are longer than it, and shorter than ``context_len``)."""
    assert pool_tokens + 64 < context_len, "over_pool prompts need room between the pool and the context"
    rng = random.Random(seed)
    ids = lambda n: tuple(rng.randrange(FIRST_ID, LAST_ID) for _ in range(n))  # noqa: E731
    prefixes = [ids(n) for n in (32, 200, 700, 1500)[:num_prefixes]]
    kinds, weights = zip(*KINDS.items())
    # Every kind at least once (the first len(KINDS) requests, shuffled), then the weighted mix.
    first = list(kinds)
    rng.shuffle(first)
    out = []
    for i in range(count):
        kind = first[i] if i < len(first) else rng.choices(kinds, weights)[0]
        n = _length(rng, pool_tokens)
        prompt = ids(n)
        if rng.random() < 0.33:  # a shared prefix, then the request's own tokens
            prefix = rng.choice(prefixes)
            prompt = prefix + prompt[: max(1, n - len(prefix))]
        req = Request(i, kind, prompt=prompt, max_tokens=_max_tokens(rng))
        if kind in ("chat", "chat_stream"):
            req = Request(i, kind, text=" ".join(rng.choice(WORDS) for _ in range(min(n, 800))), max_tokens=req.max_tokens)
        if kind in ("completion", "chat") and rng.random() < 0.25:
            req = Request(**{**asdict(req), "n": rng.randint(2, 3)})
        if kind in ("completion", "completion_stream", "chat", "generate") and rng.random() < 0.3:
            req = Request(**{**asdict(req), "stop": tuple(rng.sample(STOPS, 2))})
        if kind in INTERRUPTED:
            req = Request(**{**asdict(req), "max_tokens": rng.randint(8, 300), "cut_after": rng.randint(1, 6)})
        if kind == "over_context":
            req = Request(i, kind, prompt=ids(context_len + rng.randint(0, 100)), max_tokens=8)
        if kind == "over_pool":
            req = Request(i, kind, prompt=ids(rng.randint(pool_tokens + 1, context_len - 64)), max_tokens=8)
        out.append(req)
    return out


# ---------------------------------------------------------------------------------------------
# Sending
# ---------------------------------------------------------------------------------------------
def _open(base_url: str, path: str, body: dict):
    req = urllib.request.Request(base_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT)


def _events(resp):
    for line in resp:
        if line.startswith(b"data: "):
            payload = line[len(b"data: ") :].strip()
            if payload == b"[DONE]":
                return
            yield json.loads(payload)


def _top2(d) -> list:
    if not d:
        return []
    vals = list(d.values()) if isinstance(d, dict) else [x["logprob"] for x in d]
    return sorted(vals, reverse=True)[:2]


def _oai_body(req: Request, stream: bool) -> dict:
    body = {"model": "default", "max_tokens": req.max_tokens, "temperature": 0, "n": req.n, "stream": stream}
    if req.stop:
        body["stop"] = list(req.stop)
    if req.kind.startswith("chat"):
        body.update(messages=[{"role": "user", "content": req.text}], logprobs=True, top_logprobs=2)
    else:
        body.update(prompt=list(req.prompt), logprobs=2)
    return body


def _completion(base_url: str, req: Request, out: Outcome) -> None:
    stream = req.kind.endswith("_stream")
    chat = req.kind.startswith("chat")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    choices: dict = {}

    def add(c, text, lp):
        ch = choices.setdefault(c["index"], {"text": "", "tokens": [], "lps": [], "top2": [], "finish": None})
        ch["text"] += text or ""
        if lp:
            if chat:
                for t in lp.get("content") or []:
                    ch["tokens"].append(t["token"])
                    ch["lps"].append(t["logprob"])
                    ch["top2"].append(_top2(t.get("top_logprobs")))
            else:
                ch["tokens"] += lp.get("tokens") or []
                ch["lps"] += lp.get("token_logprobs") or []
                ch["top2"] += [_top2(t) for t in lp.get("top_logprobs") or []]
        if c.get("finish_reason"):
            ch["finish"] = c["finish_reason"]

    with _open(base_url, path, _oai_body(req, stream)) as resp:
        out.status = resp.status
        if stream:
            for ev in _events(resp):
                for c in ev.get("choices", []):
                    text = (c.get("delta") or {}).get("content") if chat else c.get("text")
                    add(c, text, c.get("logprobs"))
        else:
            for c in json.loads(resp.read())["choices"]:
                add(c, c["message"]["content"] if chat else c["text"], c.get("logprobs"))
    for i in sorted(choices):
        ch = choices[i]
        out.gens.append(Generation(ch["text"], ch["tokens"], ch["lps"], ch["top2"]))
        out.texts.append(ch["text"])
        out.finish.append(ch["finish"])


def _generate_body(req: Request, stream: bool, rid: str | None = None) -> dict:
    params = {"max_new_tokens": req.max_tokens, "temperature": 0}
    if req.stop:
        params["stop"] = list(req.stop)
    body = {"input_ids": list(req.prompt), "sampling_params": params, "stream": stream, "return_logprob": True, "top_logprobs_num": 2}
    if rid:
        body["rid"] = rid
    return body


def _meta_generation(res: dict) -> Generation:
    meta = res["meta_info"]
    lps = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    tokens = [str(t[1]) for t in lps]  # token ids, as strings
    return Generation(res.get("text", ""), tokens, [t[0] for t in lps], [sorted((x[0] for x in t), reverse=True)[:2] for t in tops])


def _generate(base_url: str, req: Request, out: Outcome, rid: str | None = None) -> None:
    stream = req.kind != "generate"
    last = None
    with _open(base_url, "/generate", _generate_body(req, stream, rid)) as resp:
        out.status = resp.status
        if not stream:
            last = json.loads(resp.read())
        else:
            for i, ev in enumerate(_events(resp), start=1):
                last = ev
                if req.kind == "abort" and i == req.cut_after:
                    urllib.request.urlopen(
                        urllib.request.Request(base_url + "/abort_request", json.dumps({"rid": rid}).encode(), {"Content-Type": "application/json"}),
                        timeout=60,
                    ).read()
    if last is not None:
        fin = last["meta_info"].get("finish_reason") or {}
        out.finish.append(fin.get("type") if isinstance(fin, dict) else fin)
        out.gens.append(_meta_generation(last))
        out.texts.append(last.get("text", ""))


def _disconnect(base_url: str, req: Request, out: Outcome) -> None:
    body = {"model": "default", "prompt": list(req.prompt), "max_tokens": req.max_tokens, "temperature": 0, "stream": True}
    resp = _open(base_url, "/v1/completions", body)
    out.status = resp.status
    seen = 0
    try:
        for _ in _events(resp):
            seen += 1
            if seen >= req.cut_after:
                break
    finally:
        resp.close()
    out.note = f"closed after {seen} chunks"


def send(base_url: str, req: Request, tag: str = "soak") -> Outcome:
    out = Outcome(status=0)
    t0 = time.monotonic()
    try:
        if req.kind == "disconnect":
            _disconnect(base_url, req, out)
        elif req.kind in ("generate", "generate_stream"):
            _generate(base_url, req, out)
        elif req.kind == "abort":
            _generate(base_url, req, out, rid=f"{tag}-{req.index}-{threading.get_ident()}")
        else:
            _completion(base_url, req, out)
    except urllib.error.HTTPError as e:
        out.status = e.code
        raw = e.read().decode(errors="replace")
        try:
            msg = json.loads(raw)
            out.error = msg.get("message") or (msg.get("error") or {}).get("message") or raw
        except ValueError:
            out.error = raw
    except Exception as e:  # connection reset, timeout: no answer
        out.status, out.error = 0, f"{type(e).__name__}: {e}"
    out.seconds = time.monotonic() - t0
    return out


def run(base_url: str, requests: list, clients: int = 16, progress=None) -> list:
    """Send ``requests`` from ``clients`` concurrent threads; one ``Outcome`` per request, in order."""
    done = [0]
    lock = threading.Lock()

    def one(req):
        out = send(base_url, req)
        with lock:
            done[0] += 1
            if progress:
                progress(done[0], len(requests))
        return out

    with ThreadPoolExecutor(max_workers=clients) as pool:
        return list(pool.map(one, requests))


# ---------------------------------------------------------------------------------------------
# Judging
# ---------------------------------------------------------------------------------------------
def compare(requests: list, reference: list, candidate: list, atol: float = LOGPROB_ATOL) -> list:
    """Every request whose candidate outcome is not the reference's, as ``(index, kind, why)``.

    - An error must be the reference's error: same HTTP status and message.
    - ``disconnect`` / ``abort``: an answer (status 200); the output is not compared (it depends
      on when the cut landed), only that an aborted generation says ``abort`` or finished.
    - OpenAI streams: the same number of choices, each with the reference's text and finish
      reason where the reference's recorded steps are all decisive (their logprobs skip tokens).
    - Otherwise the same number of choices, each ``assert_same_generation`` (tokens up to the
      reference's first indecisive step, logprobs within ``atol``), and where the reference is
      decisive throughout, the same text and finish reason.
    """
    bad = []
    for req, ref, got in zip(requests, reference, candidate):
        why = _differs(req, ref, got, atol)
        if why:
            bad.append((req.index, req.kind, why))
    return bad


def _differs(req: Request, ref: Outcome, got: Outcome, atol: float) -> str:
    if ref.status != 200 or got.status != 200:
        if (ref.status, ref.error) != (got.status, got.error):
            return f"status/error {got.status} {got.error[:200]!r}, reference {ref.status} {ref.error[:200]!r}"
        return ""
    if req.kind in INTERRUPTED:
        if req.kind == "abort" and got.finish and got.finish[0] not in ("abort", "length", "stop"):
            return f"aborted request finished with {got.finish}"
        return ""
    if len(got.gens) != len(ref.gens):
        return f"{len(got.gens)} choices, reference {len(ref.gens)}"
    if req.kind in OPENAI_STREAMS:
        # Upstream's OpenAI streams leave out the logprobs of tokens whose text the detokenizer
        # holds back (an incomplete UTF-8 sequence, then sent with a later token), and which ones
        # depends on how tokens fall into chunks, i.e. on timing. So a stream is judged by what
        # its client reads: the text and the finish reason, where the reference's recorded steps
        # are all decisive.
        for c, r in enumerate(ref.gens):
            same = (got.texts[c], got.finish[c]) == (ref.texts[c], ref.finish[c])
            if not same and all(len(t) < 2 or t[0] - t[1] >= MARGIN for t in r.top2):
                return f"choice {c}: streamed {got.finish[c]} {got.texts[c][:80]!r} vs reference {ref.finish[c]} {ref.texts[c][:80]!r}"
        return ""
    for c, (r, g) in enumerate(zip(ref.gens, got.gens)):
        try:
            assert_same_generation(r, g, atol, f"choice {c}")
        except AssertionError as e:
            return f"{_first_difference(r, g)}; {str(e)[:300]}"
        if r.decisive_prefix() == len(r.tokens):
            if g.tokens != r.tokens or got.finish[c] != ref.finish[c] or got.texts[c] != ref.texts[c]:
                return f"choice {c}: decisive throughout, yet {got.finish[c]} {got.texts[c][:80]!r} vs reference {ref.finish[c]} {ref.texts[c][:80]!r}"
    return ""


def _first_difference(ref: Generation, got: Generation) -> str:
    """Where two generations part: the step, both tokens, logprobs and top-2, the reference's margin."""
    n = min(len(ref.tokens), len(got.tokens))
    i = next((j for j in range(n) if ref.tokens[j] != got.tokens[j] or abs(ref.logprobs[j] - got.logprobs[j]) > 1e-6), n)
    if i == n:
        return f"first {n} steps agree (lengths {len(ref.tokens)} / {len(got.tokens)})"
    margin = ref.top2[i][0] - ref.top2[i][1] if len(ref.top2[i]) > 1 else float("nan")
    return (
        f"step {i} of {len(ref.tokens)}: reference {ref.tokens[i]!r} {ref.logprobs[i]:.6f} top2 {ref.top2[i]} "
        f"(margin {margin:.2e}), candidate {got.tokens[i]!r} {got.logprobs[i]:.6f} top2 {got.top2[i] if i < len(got.top2) else None}"
    )


def summary(requests: list, outcomes: list) -> dict:
    kinds: dict = {}
    for req, out in zip(requests, outcomes):
        k = kinds.setdefault(req.kind, {"count": 0, "ok": 0, "errors": {}})
        k["count"] += 1
        if out.status == 200:
            k["ok"] += 1
        else:
            key = f"{out.status} {out.error[:80]}"
            k["errors"][key] = k["errors"].get(key, 0) + 1
    secs = sorted(o.seconds for o in outcomes)
    return {
        "requests": len(requests),
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "max_prompt_tokens": max(len(r.prompt) for r in requests),
        "kinds": kinds,
        "latency_s": {"p50": secs[len(secs) // 2], "p99": secs[int(len(secs) * 0.99)], "max": secs[-1]},
    }


# ---------------------------------------------------------------------------------------------
# A whole soak: the reference's outcomes, then the server under test, then its KV accounting
# ---------------------------------------------------------------------------------------------
def soak_server(srv, requests: list, reference: list, clients: int = 16, progress=None) -> dict:
    """Run ``requests`` against ``srv`` (a started ``CpuServer`` with ``kv_checks.DEBUG_ENV``),
    then, idle and with the prefix cache flushed, read every rank's KV checks from its log.

    Returns a report; ``failures(report)`` lists what is wrong with it (empty: the soak passed).
    """
    from sglang_helix.testing import kv_checks

    mark_start = os.path.getsize(srv.log_path)
    t0 = time.monotonic()
    got = run(srv.base_url, requests, clients, progress)
    wall = time.monotonic() - t0
    kv_checks.wait_idle(srv.base_url)
    kv_checks.post(srv.base_url, "/flush_cache", {})
    time.sleep(2.0)  # several idle-loop leak checks on every rank
    mark_end = os.path.getsize(srv.log_path)
    status, _ = kv_checks.get(srv.base_url, "/health_generate")  # the first request after the soak
    kv_checks.wait_idle(srv.base_url)
    time.sleep(1.0)
    with open(srv.log_path, "rb") as f:
        raw = f.read()
    log = raw.decode(errors="replace")
    return {
        "requests": requests, "reference": reference, "outcomes": got, "wall_s": wall,
        "healthy": status == 200 and srv.proc.poll() is None,
        "fired": kv_checks.fired_checks(log),
        "retractions": log.count(kv_checks.RETRACT_LINE),
        # prefix-cache hits: tokens the prefill batches found cached (rank 0's log line)
        "cached_tokens": sum(int(m) for m in re.findall(r"#cached-token: (\d+)", raw[mark_start:].decode(errors="replace"))),
        # {tp_rank: [(total, available, uncached), ...]} at startup, during the soak, after it
        "busy": [kv_checks.busy_counts(raw[a:b].decode(errors="replace")) for a, b in ((0, mark_start), (mark_start, mark_end), (mark_end, len(raw)))],
    }  # fmt: skip


def failures(report: dict, num_ranks: int) -> list:
    """What the soak found wrong, one line each."""
    requests, ref, got = report["requests"], report["reference"], report["outcomes"]
    out = []
    if not report["healthy"]:
        out.append("the server is not healthy after the soak")
    out += [f"KV check fired: {line}" for line in report["fired"][:20]]
    for name, outs in (("reference", ref), ("candidate", got)):
        out += [f"{name}: request {r.index} ({r.kind}) got no answer: {o.error}" for r, o in zip(requests, outs) if o.status == 0]
    out += [f"request {i} ({kind}) differs from the reference: {why}" for i, kind, why in compare(requests, ref, got)]
    for r, o in zip(requests, got):
        if r.kind == "over_pool" and not (o.status == 400 and "token" in o.error):
            out.append(f"request {r.index}: a prompt over the pool got {o.status} {o.error[:200]!r}, not a clear 400")
    startup, during, after = report["busy"]
    ranks = list(range(num_ranks))
    if not (sorted(startup) == sorted(during) == sorted(after) == ranks):
        return out + [f"busy-check lines from ranks {sorted(startup)} / {sorted(during)} / {sorted(after)}, expected {ranks}"]
    for rank in ranks:
        total = startup[rank][0][0]
        low = min(a for _, a, _ in during[rank])
        if not report["retractions"] and low >= total // 8:
            out.append(f"TP{rank}: the pool never ran low (min free {low} of {total}, no retraction)")
        if after[rank][0] != startup[rank][0]:
            out.append(f"TP{rank}: (total, available, uncached) {after[rank][0]} after the soak, {startup[rank][0]} at startup")
    return out


def report_summary(report: dict) -> dict:
    startup, during, _ = report["busy"]
    return {
        "wall_s": round(report["wall_s"], 1),
        "retractions": report["retractions"],
        "cached_tokens": report["cached_tokens"],
        "min_free_per_rank": {r: min(a for _, a, _ in c) for r, c in sorted(during.items())},
        "total_per_rank": {r: c[0][0] for r, c in sorted(startup.items())},
        **summary(report["requests"], report["outcomes"]),
    }
