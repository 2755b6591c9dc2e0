"""The README's Python example runs as written, with the venv's interpreter, against the real
NIXL runtime and the plugin (the block between the readme-example markers); its vLLM
configuration is the one the package builds (what the benchmarks run)."""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "python"))

from nixl_io_uring_dmabuf.vllm_connector.config import kv_transfer_config  # noqa: E402


def readme_example():
    text = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(
        r"<!-- readme-example: begin -->\n```python\n(.*?)```\n<!-- readme-example: end -->",
        text,
        re.S,
    )
    assert m, "README.md has no readme-example block"
    return m.group(1)


def test_the_readme_example_runs_as_written(plugin_so, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    env = dict(os.environ, NIXL_PLUGIN_DIR=os.path.dirname(plugin_so), TMPDIR=str(tmp_path))
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "round trip verified: 4194304 bytes" in r.stdout, r.stdout


def test_the_readme_vllm_config_is_the_one_the_package_builds():
    text = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(r"--kv-transfer-config '(\{.*?\})'\n", text, re.S)
    assert m, "README.md has no --kv-transfer-config block"
    extra = {"path": "/mnt/nvme/vllm-kv", "capacity_gb": 512, "o_direct": True}
    assert json.loads(m.group(1)) == kv_transfer_config(**extra)
