"""Demo: a tiny Llama served on the CPU by the real SGLang server, queried with the openai client.

Run through scripts/demo.sh. Writes a tiny random-weight model, starts
`python -m sglang.launch_server --device cpu --tp 4 --helix-kvp-size 2 ...` (Helix on by default;
`--helix-kvp-size 1` for plain TP), sends one chat completion and one streaming completion,
prints both, and shuts the server down.
"""

import argparse
import os
import sys
import time

import openai

from sglang_helix.testing.server import CpuServer, ServerStartError
from sglang_helix.testing.tiny_models import TinyModelSpec, write_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--helix-kvp-size", type=int, default=2, help="1 = plain TP, to compare")
    p.add_argument("--attention-backend", default="torch_native", choices=["torch_native", "triton"])
    p.add_argument("--model-dir", default=os.path.join(ROOT, ".cache", "demo-model"))
    p.add_argument("server_args", nargs="*", help="extra launch_server flags (after --)")
    args = p.parse_args()

    model = write_tiny_model(args.model_dir, TinyModelSpec(num_heads=8, num_kv_heads=4, head_dim=16, num_layers=2))
    server_args = ["--tp", str(args.tp), "--helix-kvp-size", str(args.helix_kvp_size), *args.server_args]
    print(f"model:  {model}")
    print(f"server: python -m sglang.launch_server --device cpu --attention-backend {args.attention_backend} {' '.join(server_args)}")
    try:
        serve_and_ask(model, server_args, args.attention_backend)
    except ServerStartError as e:  # e.g. flags the server refuses: its one-line error ends the log tail
        print(f"demo: the server did not start.\n{e}", file=sys.stderr)
        return 1
    print("server stopped; no process left")
    return 0


def serve_and_ask(model: str, server_args: list, attention_backend: str) -> None:
    t0 = time.time()
    with CpuServer(model, server_args, attention_backend=attention_backend, log_dir=os.path.join(ROOT, ".cache")) as srv:
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


if __name__ == "__main__":
    sys.exit(main())
