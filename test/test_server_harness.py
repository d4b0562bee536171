"""The server fixture: real launch, bounded readiness wait with the log on failure, no orphans."""

import psutil
import pytest

from sglang_helix.testing.server import CpuServer, ServerStartError


def _alive(pids):
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_tp2_server_serves_and_leaves_no_process(model_dir, server_log_dir):
    srv = CpuServer(model_dir(), ["--tp", "2"], log_dir=server_log_dir, startup_timeout=600).start()
    try:
        import openai

        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model="default", prompt="the quick", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
        tree = set(srv.tree_pids)
        # launcher + 2 scheduler ranks + detokenizer at least
        assert len(_alive(tree)) >= 4, tree
    finally:
        calls = srv.stub_calls()
        srv.stop()
    assert _alive(tree) == []
    assert calls == []


def test_failed_start_shows_log_and_cleans_up(tmp_path, server_log_dir):
    srv = CpuServer(str(tmp_path / "no-such-model"), ["--tp", "2"], log_dir=server_log_dir, startup_timeout=300)
    with pytest.raises(ServerStartError) as e:
        srv.start()
    assert "server log tail" in str(e.value)
    assert "no-such-model" in str(e.value)
    assert _alive(srv.tree_pids) == []


def test_startup_timeout_is_bounded_and_cleans_up(model_dir, server_log_dir):
    srv = CpuServer(model_dir(), ["--tp", "2"], log_dir=server_log_dir, startup_timeout=5)
    with pytest.raises(ServerStartError, match="not ready after 5s"):
        srv.start()
    assert srv.tree_pids and _alive(srv.tree_pids) == []
