#!/usr/bin/env bash
# The clients venv (.venv-clients, or $IUD_CLIENTS_VENV) for tests/python/clients: the real client
# code the plugin is proven through, from PyPI, on a CPU-only machine.
#   torch==2.15.0      PyPI's Linux wheel is the CUDA 13 build (PyPI has no CPU-only torch; the
#                      CPU wheels live on another index this project does not use). It imports
#                      and runs on CPU once its nvidia-* dependencies are installed (~3 GB).
#   lmcache==0.5.6     --no-deps, plus the modules its StorageManager / NIXL storage path imports
#                      (its full dependency set pulls cupy, grpc, kafka, ...).
#   vllm==0.33.0       --no-deps, plus what vllm.v1.kv_offload.tiering imports on CPU.
#   nixl==1.5.1 nixl-cu13==1.5.1  --no-deps: with a CUDA 13 torch, `import nixl` loads nixl_cu13.
# Idempotent: a stamp file holding this spec skips the work when nothing changed. About 3 minutes
# on a 2-core machine with an empty pip cache (most of it torch's CUDA libraries).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
V="${IUD_CLIENTS_VENV:-$IUD_ROOT/.venv-clients}"
TORCH=(torch==2.15.0)
NODEPS=(lmcache==0.5.6 vllm==0.33.0 nixl==1.5.1 nixl-cu13==1.5.1)
# LMCache 0.5.6's storage path (config, StorageManager, LocalCPUBackend, NixlStorageBackend):
LMCACHE_DEPS=(pyyaml requests cachetools sortedcontainers "prometheus_client<=0.24.1" py-cpuinfo
              psutil aiohttp aiofile aiofiles msgspec "pyzmq>=25" "transformers>=5.4" cryptography
              "numpy<=2.2.6" numba pytest)
# vLLM 0.33's kv_offload tiering modules (factory, base, manager, cpu shared region):
VLLM_DEPS=(cbor2 openai openai-harmony pillow pybase64 cloudpickle uvloop xgrammar fastapi
           partial-json-parser llguidance)
spec="${TORCH[*]} | ${NODEPS[*]} | ${LMCACHE_DEPS[*]} | ${VLLM_DEPS[*]}"
stamp="$V/.iud-clients-spec"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$spec" ]; then
    echo "ci/clients-setup.sh: $V is up to date"
    exit 0
fi
[ -x "$V/bin/python" ] || python3 -m venv "$V"
pip=("$V/bin/python" -m pip install -q --disable-pip-version-check)
echo "ci/clients-setup.sh: installing ${TORCH[*]} (CUDA build from PyPI; runs on CPU) into $V"
"${pip[@]}" "${TORCH[@]}"
echo "ci/clients-setup.sh: installing ${NODEPS[*]} without their dependencies"
"${pip[@]}" --no-deps "${NODEPS[@]}"
echo "ci/clients-setup.sh: installing what the LMCache storage path and vLLM's tiering import"
"${pip[@]}" "${LMCACHE_DEPS[@]}" "${VLLM_DEPS[@]}"
"$V/bin/python" - <<'PY'
import nixl, torch
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: F401
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: F401
print(f"clients venv ready: torch {torch.__version__} (cuda available: {torch.cuda.is_available()}), "
      f"nixl from {nixl._pkg.__name__}")
PY
echo "$spec" > "$stamp"
