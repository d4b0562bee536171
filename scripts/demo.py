"""Demo: a trained model finds a passkey in a long text, served by Helix and by plain TP on the CPU.

Run through scripts/demo.sh. Starts the real `python -m sglang.launch_server --device cpu` twice on
SmolLM2-135M-Instruct (the trained model `scripts/setup.sh` installs; 9 query / 3 KV heads):
`--tp 3 --helix-kvp-size 3` (each rank holds a third of the sequence, all 3 KV heads), then plain
`--tp 3` (each rank one KV head, the whole sequence).
Each gets the same prompt through the openai client: a passkey hidden in a ~2K-token text, then
the question. Prints both answers side by side, whether their tokens are the same, and each
server's time per output token. `--random-model`: the earlier demo (a tiny random-weight Llama,
one chat and one streaming completion under Helix; its text is noise).
"""

import argparse
import os
import sys
import time

import openai

from sglang_helix.testing.server import CpuServer, ServerStartError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG_DIR = os.path.join(ROOT, ".cache")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=None, help="default: 3 (trained model), 4 (--random-model)")
    p.add_argument("--helix-kvp-size", type=int, default=None, help="default: 3 (trained), 2 (--random-model)")
    p.add_argument("--attention-backend", default="torch_native", choices=["torch_native", "triton"])
    p.add_argument("--prompt-tokens", type=int, default=2048, help="the passkey prompt's length")
    p.add_argument("--depth", type=float, default=0.5, help="where the key sits in the text (0-1)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--random-model", action="store_true", help="the tiny random-weight Llama instead")
    p.add_argument("--model-dir", default=None, help="where to write the random model / the converted checkpoint")
    p.add_argument("server_args", nargs="*", help="extra launch_server flags (after --)")
    args = p.parse_args()
    try:
        if args.random_model:
            return random_model_demo(args)
        return passkey_demo(args)
    except ServerStartError as e:  # e.g. flags the server refuses: its one-line error ends the log tail
        print(f"demo: the server did not start.\n{e}", file=sys.stderr)
        return 1


# -- the trained model: a passkey, Helix against plain TP ------------------------------------------


def passkey_demo(args) -> int:
    from sglang_helix.testing.retrieval import passkey_prompt, retrieved
    from sglang_helix.testing.smollm2 import TrainedModelMissing, smollm2_checkpoint

    try:
        model = smollm2_checkpoint(args.model_dir)
    except TrainedModelMissing as e:
        print(f"demo: {e}\n(run 'bash scripts/setup.sh', or use --random-model)", file=sys.stderr)
        return 1
    tp, kvp = args.tp or 3, args.helix_kvp_size or 3
    prompt = passkey_prompt(model, args.prompt_tokens, args.depth)
    # the pool holds the prompt on every layout (plain TP's rank holds the whole sequence)
    pool = ["--max-total-tokens", str(max(8192, 2 * (prompt.tokens + args.max_tokens)))]
    layouts = [("helix", ["--tp", str(tp), "--helix-kvp-size", str(kvp)]), ("plain TP", ["--tp", str(tp)])]
    print(f"model:  {model} (SmolLM2-135M-Instruct)")
    print(f"prompt: {prompt.tokens} tokens, the passkey {prompt.answer} at {args.depth:.0%} depth; "
          f"...{prompt.text[-60:]!r}\n")  # fmt: skip
    answers = {}
    for name, layout in layouts:
        server_args = [*layout, *pool, *args.server_args]
        print(f"{name}: python -m sglang.launch_server --device cpu --dtype float32 "
              f"--attention-backend {args.attention_backend} {' '.join(server_args)}")  # fmt: skip
        t0 = time.time()
        with CpuServer(model, server_args, attention_backend=args.attention_backend, log_dir=LOG_DIR) as srv:
            print(f"  ready in {time.time() - t0:.0f}s")
            answers[name] = ask_streaming(srv.base_url, prompt.text, args.max_tokens)
        text, tokens, ttft, tpot = answers[name]
        print(f"  answer {text!r}: {'found' if retrieved(prompt, text) else 'NOT found'}; "
              f"first token {ttft:.2f} s, then {tpot * 1e3:.0f} ms per output token\n")  # fmt: skip
    (h_text, h_tokens, _, h_tpot), (p_text, p_tokens, _, p_tpot) = answers["helix"], answers["plain TP"]
    print(f"{'':10}{'helix --tp %d --helix-kvp-size %d' % (tp, kvp):<40}plain --tp {tp}")
    print(f"{'answer':10}{h_text!r:<40}{p_text!r}")
    print(f"{'per token':10}{'%.0f ms' % (h_tpot * 1e3):<40}{'%.0f ms' % (p_tpot * 1e3)}")
    same = h_tokens == p_tokens
    print(f"same tokens: {'yes' if same else 'NO'} ({len(h_tokens)} tokens)")
    print(f"(each Helix rank holds 1/{kvp} of the sequence's KV; a 135M model with K = 3 KV heads at 2K "
          "tokens on the CPU says nothing of Helix's speed: benchmark/README.md has it)")  # fmt: skip
    return 0 if same and retrieved(prompt, h_text) else 2


def ask_streaming(base_url: str, text: str, max_tokens: int):
    """A greedy streamed completion: ``(text, its tokens, time to first token, time per output token
    after it)``. Each streamed chunk is one token (the server streams every token)."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=1800)
    t0, stamps, pieces, ids = time.time(), [], [], []
    for chunk in client.completions.create(
        model="default", prompt=text, max_tokens=max_tokens, temperature=0, stream=True, logprobs=0,
    ):  # fmt: skip
        if not chunk.choices or not chunk.choices[0].text and not chunk.choices[0].logprobs:
            continue
        stamps.append(time.time())
        pieces.append(chunk.choices[0].text)
        lp = chunk.choices[0].logprobs
        ids += list(lp.tokens) if lp is not None and lp.tokens else [chunk.choices[0].text]
    ttft = stamps[0] - t0 if stamps else float("nan")
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan")
    return "".join(pieces), ids, ttft, tpot


# -- the random model: the earlier demo ---------------------------------------------------------------


def random_model_demo(args) -> int:
    from sglang_helix.testing.tiny_models import TinyModelSpec, write_tiny_model

    model_dir = args.model_dir or os.path.join(ROOT, ".cache", "demo-model")
    model = write_tiny_model(model_dir, TinyModelSpec(num_heads=8, num_kv_heads=4, head_dim=16, num_layers=2))
    tp, kvp = args.tp or 4, args.helix_kvp_size or 2
    server_args = ["--tp", str(tp), "--helix-kvp-size", str(kvp), *args.server_args]
    print(f"model:  {model}")
    print(f"server: python -m sglang.launch_server --device cpu --attention-backend {args.attention_backend} {' '.join(server_args)}")
    t0 = time.time()
    with CpuServer(model, server_args, attention_backend=args.attention_backend, log_dir=LOG_DIR) as srv:
        print(f"ready in {time.time() - t0:.0f}s at {srv.base_url} (log: {srv.log_path})\n")
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)

        chat = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "what is helix parallelism?"}],
            max_tokens=24, temperature=0,
        )  # fmt: skip
        print("chat completion:")
        print(f"  {chat.choices[0].message.content!r}")
        print(f"  ({chat.usage.prompt_tokens} prompt tokens, {chat.usage.completion_tokens} completion tokens)\n")

        print("streaming completion:")
        print("  ", end="")
        n = 0
        for chunk in client.completions.create(
            model="default", prompt="the quick brown fox", max_tokens=24, temperature=0, stream=True,
        ):  # fmt: skip
            if chunk.choices:
                print(repr(chunk.choices[0].text), end=" ", flush=True)
                n += 1
        print(f"\n  ({n} chunks)\n")
        print("shutting down")
    print("server stopped; no process left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
