"""The server fixture: real launch, bounded readiness wait with the log on failure, no orphans."""

import psutil
import pytest

from conftest import FULL
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


# HELIX_TEST_FULL=1: every end-to-end test of the default run serves through this harness and
# stops its server with the same no-survivor check (conftest.stop_server).
@FULL
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


# A stand-in for ``python -m sglang.launch_server``: binds --port like uvicorn does (failing with
# uvicorn's message when the port is taken) and answers /health_generate. Lets the harness's port
# handling be tested in a second, without loading a model.
_FAKE_LAUNCHER = r'''#!{python}
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass

try:
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
except OSError as e:
    print(f"ERROR:    [Errno {{e.errno}}] error while attempting to bind on address "
          f"('127.0.0.1', {{port}}): address already in use", flush=True)
    sys.exit(3)
server.serve_forever()
'''


@pytest.fixture
def fake_launcher(tmp_path):
    import sys

    path = tmp_path / "fake-python"
    path.write_text(_FAKE_LAUNCHER.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def test_triton_interpreter_only_for_the_triton_backend():
    from sglang_helix.testing.cpu_env import cpu_server_env

    caller = {"TRITON_INTERPRET": "1"}  # as in a pytest process that imported the kernel tests
    assert cpu_server_env(2, "triton", base={})["TRITON_INTERPRET"] == "1"
    assert "TRITON_INTERPRET" not in cpu_server_env(2, "torch_native", base=caller)


def test_torch_compile_is_eager_in_the_default_tier_only():
    """Servers of the default tier run upstream's torch.compile'd helpers eagerly (no per-rank
    dynamo + inductor at the first forwards); HELIX_TEST_FULL=1 keeps them compiled, and a
    caller's own TORCHDYNAMO_DISABLE is kept."""
    from sglang_helix.testing.cpu_env import cpu_server_env

    assert cpu_server_env(4, base={})["TORCHDYNAMO_DISABLE"] == "1"
    assert "TORCHDYNAMO_DISABLE" not in cpu_server_env(4, base={"HELIX_TEST_FULL": "1"})
    assert cpu_server_env(4, base={"TORCHDYNAMO_DISABLE": "0"})["TORCHDYNAMO_DISABLE"] == "0"


def test_default_tier_servers_import_only_the_served_model_modules():
    """The model registry imports every module of sglang.srt.models in the launcher and in each
    rank; the default tier's servers skip those no test serves (SGLANG_DISABLED_MODEL_ARCHS), and
    every architecture the tests write (``tiny_models.ARCHS``, the EAGLE head) is the EntryClass
    of a module they keep. HELIX_TEST_FULL=1 imports them all; a caller's own value is kept."""
    import importlib

    from sglang_helix.testing.cpu_env import SERVED_MODEL_MODULES, cpu_server_env
    from sglang_helix.testing.tiny_models import ARCHS

    skipped = cpu_server_env(4, base={})["SGLANG_DISABLED_MODEL_ARCHS"].split(",")
    assert len(skipped) > 200 and "deepseek_v2" in skipped and "gemma" in skipped
    assert not set(skipped) & set(SERVED_MODEL_MODULES)
    assert "SGLANG_DISABLED_MODEL_ARCHS" not in cpu_server_env(4, base={"HELIX_TEST_FULL": "1"})
    assert cpu_server_env(4, base={"SGLANG_DISABLED_MODEL_ARCHS": ""})["SGLANG_DISABLED_MODEL_ARCHS"] == ""
    served = set()
    for name in SERVED_MODEL_MODULES:
        entry = importlib.import_module(f"sglang.srt.models.{name}").EntryClass
        served |= {cls.__name__ for cls in (entry if isinstance(entry, list) else [entry])}
    wanted = {model_cls for _, model_cls, _ in ARCHS.values()} | {"LlamaForCausalLMEagle"}
    assert wanted <= served, wanted - served


def test_server_stop_skips_the_gpu_crash_diagnostics():
    """SIGTERM makes the server sleep 5 s before py-spy / CUDA coredump steps (both on upstream):
    every test server's stop paid it. The harness turns both off; a caller's own value is kept."""
    from sglang_helix.testing.cpu_env import cpu_server_env

    env = cpu_server_env(4, base={})
    assert env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "0"
    assert env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"
    assert cpu_server_env(4, base={"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "1"})["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "1"


def test_free_port_avoids_the_ephemeral_and_sglang_ranges():
    from sglang_helix.testing import server

    ephemeral_low = server._ephemeral_low()
    for _ in range(50):
        port = server.free_port()
        assert server.PORT_RANGE[0] <= port < min(server.PORT_RANGE[1], ephemeral_low)
        assert not 22000 <= port < 30000  # sglang's own NCCL/TCPStore port range


def test_start_retries_on_a_port_lost_before_bind(monkeypatch, tmp_path, fake_launcher):
    """The CI failure this guards: the picked port was free, but another process bound it while
    the server was still loading, and uvicorn exited with 'address already in use'."""
    import socket

    from sglang_helix.testing import server

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", server.free_port()))
    # Bound, not listening: the launcher's bind fails, and health polls are refused at once.
    taken = squatter.getsockname()[1]
    real_free_port = server.free_port
    picks = iter([taken])
    monkeypatch.setattr(server, "free_port", lambda: next(picks, None) or real_free_port())
    try:
        srv = CpuServer("unused", log_dir=str(tmp_path), startup_timeout=30, python=fake_launcher)
        assert srv.port == taken
        srv.start()
        try:
            assert srv.port != taken and srv.port_retries == 1
        finally:
            srv.stop()
        assert _alive(srv.tree_pids) == []
    finally:
        squatter.close()


def test_start_gives_up_after_bounded_port_retries(monkeypatch, tmp_path, fake_launcher):
    import socket

    from sglang_helix.testing import server

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", server.free_port()))
    taken = squatter.getsockname()[1]
    monkeypatch.setattr(server, "free_port", lambda: taken)
    try:
        srv = CpuServer("unused", log_dir=str(tmp_path), startup_timeout=30, python=fake_launcher)
        with pytest.raises(ServerStartError, match="address already in use"):
            srv.start()
        assert srv.port_retries == server.START_ATTEMPTS - 1
    finally:
        squatter.close()
