"""Start the real ``python -m sglang.launch_server`` on the CPU, wait for it, and always clean up.

``CpuServer`` is a context manager:

    with CpuServer(model_path, ["--tp", "4"], attention_backend="triton") as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none")

It picks a free loopback port (below the kernel's ephemeral range, so that no socket the server
or a neighbour opens in the meantime can be handed the same port; a start that still loses its
port to someone else is retried on a new one), runs the server in its own session (process group), polls
``/health_generate`` until it answers (bounded by ``startup_timeout``), and on failure raises with
the tail of the server log. ``stop()`` terminates the whole process tree (the launcher, scheduler
ranks, detokenizer, ...) and verifies every process is gone: no orphans outlive a test.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from sglang_helix.testing.cpu_env import cpu_server_env


DEFAULT_MAX_TOTAL_TOKENS = 65536


class ServerStartError(RuntimeError):
    pass


# HTTP ports come from [10000, 22000): below the kernel's ephemeral range (32768+ by default, where
# bind(0) and connect() draw gloo, ZMQ and client ports from) and below the [22000, 30000) range
# sglang draws its own NCCL/TCPStore port from (srt/utils/network.get_free_port_below_ephemeral).
PORT_RANGE = (10000, 22000)
START_ATTEMPTS = 3
_PORT_LOST = "address already in use"


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port that is free now and that the kernel will not hand out as an ephemeral one."""
    low, high = PORT_RANGE[0], min(PORT_RANGE[1], _ephemeral_low())
    for port in random.sample(range(low, high), min(256, max(high - low, 0))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_size(args: list[str]) -> int:
    for flag in ("--tp", "--tp-size", "--tensor-parallel-size"):
        if flag in args:
            return int(args[args.index(flag) + 1])
    return 1


class CpuServer:
    def __init__(
        self,
        model_path: str,
        args: list[str] = (),
        attention_backend: str = "torch_native",
        startup_timeout: float = 600.0,
        log_dir: str | None = None,
        extra_env: dict | None = None,
        python: str = sys.executable,
        health_path: str = "/health_generate",
    ):
        self.model_path = model_path
        self.args = list(args)
        self.attention_backend = attention_backend
        self.startup_timeout = startup_timeout
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="sglang-cpu-")
        self.extra_env = dict(extra_env or {})
        self.python = python
        # A prefill/decode disaggregation server cannot generate alone: it is ready at /health.
        self.health_path = health_path
        self.proc: subprocess.Popen | None = None
        self.tree_pids: set[int] = set()
        self.port_retries = 0  # starts that lost their port to another process and were retried
        self._assign_port()
        # One stub log across retried starts, so a stub call in any attempt is seen.
        self.stub_log = os.path.join(self.log_dir, f"sgl-kernel-stub-{self.port}.log")
        open(self.stub_log, "w").close()

    def _assign_port(self) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(self.log_dir, f"server-{self.port}.log")

    # -- lifecycle -----------------------------------------------------------------------------
    def command(self) -> list[str]:
        cmd = [
            self.python, "-m", "sglang.launch_server",
            "--model-path", self.model_path,
            "--device", "cpu",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--attention-backend", self.attention_backend,
            "--dtype", "float32",
            "--skip-server-warmup",
            *self.args,
        ]  # fmt: skip
        # The CPU engine sizes the KV pool from free *system* memory: bound it, or every rank of
        # a multi-rank server tries to take most of the machine.
        if not any(a in self.args for a in ("--max-total-tokens", "--mem-fraction-static")):
            cmd += ["--max-total-tokens", str(DEFAULT_MAX_TOTAL_TOKENS)]
        # Interpreted Triton (TRITON_INTERPRET=1): one forward of a 4-rank server can take minutes
        # on 2 shared cores, past the scheduler's 300 s watchdog, which then kills a healthy server
        # (seen 2026-11-27 at load 24: dcp2-rq-triton, a decode step of the streamed chat).
        if self.attention_backend == "triton" and "--watchdog-timeout" not in self.args:
            cmd += ["--watchdog-timeout", "1800"]
        return cmd

    def start(self) -> "CpuServer":
        for attempt in range(START_ATTEMPTS):
            try:
                return self._start_once()
            except ServerStartError:
                # The port was free when picked but someone bound it before the server did
                # (the server binds only after loading the model). Not the server's fault: retry.
                if attempt + 1 == START_ATTEMPTS or _PORT_LOST not in self.log_text().lower():
                    raise
                self.port_retries += 1
                self.tree_pids = set()
                self._assign_port()
        raise AssertionError("unreachable")

    def _start_once(self) -> "CpuServer":
        self.launch()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self) -> "CpuServer":
        """Start the launcher process and return at once (``start`` also waits until it serves)."""
        env = cpu_server_env(_tp_size(self.args), self.attention_backend, self.stub_log)
        env.update(self.extra_env)
        self._log = open(self.log_path, "w")
        self._log.write("$ " + " ".join(self.command()) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(
            self.command(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            self._snapshot_tree()
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"server exited with code {self.proc.returncode} before it was ready\n"
                    + self.log_tail()
                )
            try:
                with urllib.request.urlopen(self.base_url + self.health_path, timeout=60) as r:
                    if r.status == 200:
                        self._snapshot_tree()
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise ServerStartError(
            f"server not ready after {self.startup_timeout:.0f}s\n" + self.log_tail()
        )

    def _snapshot_tree(self) -> None:
        import psutil

        if self.proc is None:
            return
        try:
            root = psutil.Process(self.proc.pid)
            self.tree_pids.add(root.pid)
            self.tree_pids.update(c.pid for c in root.children(recursive=True))
        except psutil.NoSuchProcess:
            pass

    def stop(self, grace: float = 20.0) -> None:
        """Terminate the server and every process it spawned; raise if any survives."""
        import psutil

        if self.proc is None:
            return
        self._snapshot_tree()
        procs = []
        for pid in self.tree_pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            for p in procs:
                try:
                    p.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            _, alive = psutil.wait_procs(procs, timeout=grace if sig == signal.SIGTERM else 10)
            procs = alive
            if not procs:
                break
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
        self.proc = None
        survivors = [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if survivors:
            raise RuntimeError(f"server processes survived shutdown: {survivors}")

    def __enter__(self) -> "CpuServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- inspection ----------------------------------------------------------------------------
    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_tail(self, n: int = 80) -> str:
        lines = self.log_text().splitlines()[-n:]
        return f"--- server log tail ({self.log_path}) ---\n" + "\n".join(lines)

    def stub_calls(self) -> list[str]:
        with open(self.stub_log) as f:
            return [line.strip() for line in f if line.strip()]


class MultiNodeServer:
    """One server launched as ``nnodes`` nodes on this machine (loopback), as on a cluster:

        python -m sglang.launch_server ... --nnodes 2 --node-rank 0 --dist-init-addr 127.0.0.1:P
        python -m sglang.launch_server ... --nnodes 2 --node-rank 1 --dist-init-addr 127.0.0.1:P

    Node 0 serves the API at ``base_url``; node r >= 1 runs TP ranks ``r*N/nnodes ...`` and
    upstream's health-only endpoint on its own port. Each node is a ``CpuServer`` (its own
    process tree and log); ``stop()`` stops all of them and verifies no process survives.
    """

    def __init__(self, model_path: str, args: list[str], nnodes: int = 2, **kwargs):
        self.dist_init_addr = f"127.0.0.1:{free_port()}"
        self.nodes = [
            CpuServer(model_path, [*args, "--nnodes", str(nnodes), "--node-rank", str(r), "--dist-init-addr", self.dist_init_addr], **kwargs)
            for r in range(nnodes)
        ]

    @property
    def base_url(self) -> str:
        return self.nodes[0].base_url

    def start(self) -> "MultiNodeServer":
        try:
            for node in self.nodes[1:]:  # they wait in the rendezvous for node 0
                node.launch()
            self.nodes[0].launch()
            for node in self.nodes:
                node._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        errors = []
        for node in self.nodes:
            try:
                node.stop()
            except Exception as e:  # stop every node before reporting
                errors.append(e)
        if errors:
            raise errors[0]

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(node.log_tail(n) for node in self.nodes)

    def stub_calls(self) -> list[str]:
        return [c for node in self.nodes for c in node.stub_calls()]

    def __enter__(self) -> "MultiNodeServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
