"""The collective budget of a decode step, counted in a real server (docs/helix-design.md).

Per layer and decode step, Helix must add exactly ONE All-to-All (partial output + LSE packed) to
what plain TP does, and nothing else: no query all-gather, no LSE all-gather, the same
all-reduces (o_proj, down_proj) and the same logits/embedding collectives.

Counted with a sitecustomize that wraps torch.distributed in every server process: the difference
between a request of 3 and of 11 generated tokens is 8 decode steps.
"""

import collections
import os

import pytest

from conftest import GQA, stop_server
from sglang_helix.testing.cpu_env import STUB_DIR
from sglang_helix.testing.server import CpuServer

COUNTER_DIR = os.path.join(os.path.dirname(STUB_DIR), "collective_counter")
LAYERS = GQA.num_layers
STEPS = 8


def _counts(path):
    """{(pid, op): calls} for model collectives (float all-reduce/gather, every all-to-all)."""
    c = collections.Counter()
    with open(path) as f:
        for line in f:
            pid, op, dtype, _ = line.split()
            if op == "all_to_all_single" or "float" in dtype:
                c[(pid, op)] += 1
    return c


def _decode_step_collectives(model, args, log_dir, tmp_path):
    import openai

    log = tmp_path / "collectives.log"
    env = {"HELIX_COLLECTIVE_LOG": str(log), "PYTHONPATH": os.pathsep.join([STUB_DIR, COUNTER_DIR])}
    srv = CpuServer(model, args, attention_backend="torch_native", log_dir=log_dir, extra_env=env).start()
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)

        def run(n):
            log.write_text("")
            client.completions.create(model="default", prompt="the quick brown fox", max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
            return _counts(log)

        short, long = run(3), run(3 + STEPS)
    finally:
        stop_server(srv)
    diff = long - short
    per_rank = collections.defaultdict(dict)
    for (pid, op), n in diff.items():
        assert n % STEPS == 0, (pid, op, n)
        per_rank[pid][op] = n // STEPS
    return per_rank


@pytest.mark.e2e
def test_helix_adds_exactly_one_all_to_all_per_layer(model_dir, server_log_dir, tmp_path):
    model = model_dir(GQA)
    plain = _decode_step_collectives(model, ["--tp", "2"], server_log_dir, tmp_path)
    helix = _decode_step_collectives(model, ["--tp", "2", "--helix-kvp-size", "2"], server_log_dir, tmp_path)
    assert len(plain) == 2 and len(helix) == 2, (plain, helix)  # the two rank processes
    (plain_rank,) = {tuple(sorted(v.items())) for v in plain.values()}  # every rank does the same
    (helix_rank,) = {tuple(sorted(v.items())) for v in helix.values()}
    plain_rank, helix_rank = dict(plain_rank), dict(helix_rank)
    assert plain_rank.get("all_to_all_single", 0) == 0
    assert helix_rank.pop("all_to_all_single") == LAYERS
    assert helix_rank == plain_rank, (helix_rank, plain_rank)
    assert plain_rank["all_reduce"] >= 2 * LAYERS  # o_proj and down_proj of every layer
