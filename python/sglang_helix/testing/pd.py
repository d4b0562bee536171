"""Prefill/decode disaggregation on the CPU harness: a prefill server, a decode server and
sglang-router, with the Mooncake transfer engine over TCP (docs/disaggregation.md).

``PDCluster(model, prefill_args, decode_args)`` starts the three (both servers at once), waits until
the router answers a generate, and stops them all; ``url`` is the router's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

from sglang_helix.testing.server import CpuServer, free_port

# The Mooncake transfer engine over TCP (no RDMA device here), as upstream's own PD tests set it.
MOONCAKE_ENV = {"MOONCAKE_PROTOCOL": "tcp", "MC_TCP_ENABLE_CONNECTION_POOL": "true"}


def mooncake_available() -> bool:
    try:
        import mooncake.engine  # noqa: F401
        import sglang_router  # noqa: F401
    except ImportError:
        return False
    return True


class PDCluster:
    def __init__(
        self, model_path: str, prefill_args: list, decode_args: list, log_dir: str, page_size: int,
        decode_env: dict | None = None, startup_timeout: float = 900.0, prefill_env: dict | None = None,
    ):  # fmt: skip
        self.bootstrap_port = free_port()
        common = ["--disaggregation-transfer-backend", "mooncake", "--page-size", str(page_size)]
        self.prefill = CpuServer(
            model_path, [*prefill_args, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                         str(self.bootstrap_port), *common],
            startup_timeout=startup_timeout, log_dir=log_dir, extra_env={**MOONCAKE_ENV, **(prefill_env or {})},
            health_path="/health",
        )  # fmt: skip
        self.decode = CpuServer(
            model_path, [*decode_args, "--disaggregation-mode", "decode", *common], startup_timeout=startup_timeout,
            log_dir=log_dir, extra_env={**MOONCAKE_ENV, **(decode_env or {})}, health_path="/health",
        )  # fmt: skip
        self.log_dir = log_dir
        self.router: subprocess.Popen | None = None
        self.router_port = free_port()
        self.prometheus_port = free_port()
        self.url = f"http://127.0.0.1:{self.router_port}"

    def router_command(self) -> list:
        return [
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", self.prefill.base_url, str(self.bootstrap_port), "--decode", self.decode.base_url,
            "--host", "127.0.0.1", "--port", str(self.router_port),
            # A long prefill on a few CPU cores can starve a server's /health past the router's
            # default timeout, and the router then drops the worker mid-request.
            "--health-check-timeout-secs", "60", "--health-failure-threshold", "5",
            # Its metrics exporter on a port of its own: the default (29000) is one per machine, and a
            # second router (another test run's) panics at start ("Address already in use").
            "--prometheus-port", str(self.prometheus_port),
        ]  # fmt: skip

    def start(self, wait_generate: bool = True) -> "PDCluster":
        try:
            self.prefill.launch()
            self.decode.launch()
            self.prefill._wait_ready()
            self.decode._wait_ready()
            self.router_log = open(os.path.join(self.log_dir, f"router-{self.router_port}.log"), "w")
            self.router = subprocess.Popen(
                self.router_command(), stdout=self.router_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
            if wait_generate:
                self._wait_router()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_router(self, timeout: float = 120.0) -> None:
        """Until a one-token generate goes through (the router admits workers after its health checks)."""
        body = json.dumps({"text": "ready", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()
        deadline = time.monotonic() + timeout
        while True:
            try:
                req = urllib.request.Request(self.url + "/generate", body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=300) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if self.router.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sglang-router not serving after {timeout:.0f}s (log: {self.router_log.name})")
            time.sleep(1.0)

    def stop(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.terminate()
            try:
                self.router.wait(20)
            except subprocess.TimeoutExpired:
                self.router.kill()
        errors = []
        for server in (self.decode, self.prefill):
            try:
                server.stop()
            except Exception as e:  # stop both before reporting
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> "PDCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
