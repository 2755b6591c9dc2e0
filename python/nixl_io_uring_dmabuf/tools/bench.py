"""`bench`: DRAM -> FILE -> DRAM round trips through NIXL, one agent per backend name, each
checked byte for byte. A quick look, not the project's benchmark (bench/, iud-bench)."""

from __future__ import annotations

import platform

from nixl_io_uring_dmabuf.tools import roundtrip

# NIXL's POSIX picks its queue from these; without them it may fall back to libaio.
_DEFAULT_PARAMS = {"POSIX": {"use_uring": "true"}}


def bench(
    directory: str, size: int, block: int, backends: list[str], direct: bool, iters: int
) -> int:
    print(
        f"# {platform.node()} kernel {platform.release()}: {size} bytes in {block}-byte "
        f"descriptors, {'O_DIRECT' if direct else 'buffered'}, file in {directory}"
    )
    print(f"{'backend':16s} {'iter':>4s} {'write GB/s':>10s} {'read GB/s':>10s}  check")
    status = 0
    for name in backends:
        agent = roundtrip.new_agent("iud-bench")
        try:
            agent.create_backend(name, _DEFAULT_PARAMS.get(name, {}))
        except Exception as e:
            print(f"{name:16s} cannot create the backend: {e!r}")
            status = 1
            continue
        for it in range(iters):
            r = roundtrip.run(agent, name, directory, size, block, direct)
            print(
                f"{name:16s} {it:4d} {r.gbps(r.write_s):10.2f} {r.gbps(r.read_s):10.2f}  "
                f"{'OK' if r.ok else 'FAILED: ' + r.detail}"
            )
            status |= 0 if r.ok else 1
    return status
