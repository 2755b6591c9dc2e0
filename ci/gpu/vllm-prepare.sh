#!/usr/bin/env bash
# Prepares vLLM for the GPU machine: $IUD_VLLM_RELEASE, 0.34.0 (default) or 0.33.0. That machine
# has torch 2.11.0+cu130 and Python 3.12 but no internet, and a device call carries at most
# 64 MiB. Output, git-ignored:
#   .device/vllm/part-aa, part-ab, ...   one xz tarball split into parts of $IUD_PART_MB MiB
#   .device/vllm/SHA256SUMS              of the parts
# The tarball holds site/: that vLLM as PyPI ships it, less what a Llama engine on Hopper
# does not load (below), the dependencies the machine's image lacks (PINS, exact versions), and
# NIXL 1.5.1 cu13 with the plugin as ci/gpu/prepare.sh trims them (its output is reused).
# Carry one part per device call (they stay on a warm machine); ci/gpu/vllm-run.sh unpacks them.
#
# Left out of the vLLM wheel (none is imported by a dense Llama on an H100/H200 with
# FlashAttention 3; vLLM imports the optional ones in try blocks, vllm/platforms/cuda.py):
# _vllm_fa2_C (FlashAttention 2, pre-Hopper), _moe_C (MoE), _flashmla_C, _qutlass_C,
# _deepselect_C, _flashkda_C, third_party's C++ headers for JIT kernels (deep_gemm, fmha_sm100,
# flashmla, tml_fa4), the vllm-rs binary and the OpenAPI page's JavaScript.
# PINS: vLLM 0.33.0's requirements, resolved with pip on Python 3.12 against the versions the
# image holds (KINDS.md's package list of the device tool), less the image's own packages, the
# torch stack and the fastapi[standard] command-line extras. PINS_034: what vLLM 0.34.0 needs
# beyond them (`pip install --dry-run --report` of its requirements for cp312 manylinux, read
# on 2026-12-06): huggingface_hub>=2.0 (with hf-xet and click>=8.4.2), which transformers 5.17
# (the image's, <2.0) refuses, so transformers 5.22.2 (<5.23 as 0.34 asks); tokenizers>=0.23.3,
# filelock>=4.2.4; and nvidia-cutlass-dsl[cu13], which vLLM 0.34 imports unguarded on CUDA
# (model_executor/warmup/kernel_warmup.py -> minimax_m3_msa_warmup -> `import cutlass`) whatever
# the model. Its packages live under nvidia_cutlass_dsl/dsl_packages, which a .pth file adds in
# a site folder; vllm-run.sh puts that folder on PYTHONPATH instead. The same chain imports
# `quack` (quack-kernels, pure Python over cutlass; models/minimax_m3/nvidia/ops/
# index_decode_score.py), found on the H100 on 2026-12-06.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=.device/vllm
stage=${IUD_VLLM_STAGE:-/tmp/iud-vllm-stage}
PART_MB=${IUD_PART_MB:-56}
PINS=(annotated-types==0.8.0 anthropic==2.16.0 apache-tvm-ffi==0.1.11 astor==0.8.1 blake3==1.0.11
  cachetools==8.0.2 cbor2==6.3.0 cffi==2.1.1 compressed-tensors==0.17.0 cryptography==50.0.2
  depyf==0.20.0 dill==0.4.1 dnspython==2.9.2 docstring-parser==0.18.0 email-validator==2.4.0
  fastapi==0.136.3 googleapis-common-protos==1.76.0 httpcore2==2.16.2 httptools==0.9.0
  httpx2==2.16.2 ijson==3.6.0 interegular==0.3.3 jiter==0.19.0 jmespath==1.1.0
  jsonschema-specifications==2025.9.1 jsonschema==4.26.0 lark==1.2.2 llguidance==1.7.6
  lm-format-enforcer==0.11.3 loguru==0.7.3 mcp-types==2.3.0 mcp==2.3.0 mistral-common==1.13.1
  model-hosting-container-standards==0.1.16 msgspec==0.23.0 openai-harmony==0.0.8 openai==3.57.0
  opentelemetry-api==1.45.2 opentelemetry-exporter-http-transport==0.66b2
  opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
  opentelemetry-exporter-otlp==1.45.2 opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2
  opentelemetry-semantic-conventions-ai==0.5.1 opentelemetry-semantic-conventions==0.66b2
  orjson==3.13.0 oss-harmony==0.0.11 outlines-core==0.2.14 partial-json-parser==0.2.1.1.post7
  prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1 pycountry==26.2.16 pycparser==3.12
  pydantic-core==2.50.5 pydantic-extra-types==2.11.1 pydantic-settings==2.16.3 pydantic==2.14.4
  pyjwt==2.15.1 python-dotenv==1.2.4 python-json-logger==4.2.0 python-multipart==0.0.34
  pyzmq==27.3.0 referencing==0.37.0 rpds-py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1
  sse-starlette==3.7.1 starlette==1.10.0 truststore==0.10.5 typing-inspection==0.4.5
  typing-extensions==4.16.0 uvicorn==0.55.0 watchfiles==1.3.0 websockets==17.4 xgrammar==0.2.8)
PINS_034=(huggingface_hub==2.4.0 hf-xet==1.8.0 click==8.5.1 transformers==5.22.2 tokenizers==0.23.3
  filelock==4.3.2 httpx2==2.17.0 httpcore2==2.17.0 nvidia-cutlass-dsl==4.8.0
  nvidia-cutlass-dsl-libs-base==4.8.0 nvidia-cutlass-dsl-libs-core==4.8.0
  nvidia-cutlass-dsl-libs-cu13==4.8.0 quack-kernels==0.6.5)
RELEASE=${IUD_VLLM_RELEASE:-0.34.0}
case "$RELEASE" in
0.33.0) ;;
0.34.0) declare -A over=(); for p in "${PINS_034[@]}"; do over[${p%%==*}]=$p; done
        kept=(); for p in "${PINS[@]}"; do [ -n "${over[${p%%==*}]:-}" ] || kept+=("$p"); done
        PINS=("${kept[@]}" "${PINS_034[@]}") ;;
*) echo "vllm-prepare.sh: IUD_VLLM_RELEASE is 0.33.0 or 0.34.0, not $RELEASE" >&2; exit 2 ;;
esac
P=(-q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
   --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
   --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

[ -f .device/gpu/libplugin_IO_URING_DMABUF.so ] || bash ci/gpu/prepare.sh
rm -rf "$stage" "$out"; mkdir -p "$stage/site" "$stage/wheel" "$out"
python3 -m pip download "${P[@]}" -d "$stage/wheel" "vllm==$RELEASE"
(cd "$stage/site" && unzip -q "$stage"/wheel/vllm-"$RELEASE"-*.whl)
V=$stage/site/vllm
rm -rf "$V/vllm-rs" "$V/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$V/_moe_C_stable_libtorch.abi3.so" \
    "$V"/_flashmla_C.abi3.so "$V"/_qutlass_C.abi3.so "$V"/_deepselect_C.abi3.so \
    "$V"/_flashkda_C.abi3.so "$V"/third_party/{deep_gemm,fmha_sm100,flashmla,tml_fa4} \
    "$V"/entrypoints/serve/instrumentator/static
python3 -m pip install "${P[@]}" --target "$stage/site" "${PINS[@]}"
rm -rf "$stage/site/bin"
cp -a .device/gpu/site/. "$stage/site/"
cp .device/gpu/libplugin_IO_URING_DMABUF.so .device/gpu/iud-doctor "$stage/"
echo "$RELEASE" > "$stage/site/IUD_VLLM_RELEASE"
find "$stage/site" -name '*.so*' -type f -exec strip --strip-unneeded {} + 2>/dev/null || true
find "$stage/site" -name __pycache__ -type d -prune -exec rm -rf {} +
du -sh "$stage/site"
tar -C "$stage" -cf - site libplugin_IO_URING_DMABUF.so iud-doctor | xz -9 -T2 \
    | split -b "${PART_MB}M" - "$out/part-"
(cd "$out" && sha256sum part-* > SHA256SUMS)
rm -rf "$stage"
ls -la "$out"
