"""The tools: what `python -m nixl_io_uring_dmabuf` (and the `nixl-io-uring-dmabuf` script) runs.

- cli.py: the command line (install, doctor, bench, ...).
- install.py: puts the plugin into the NIXL wheel's plugin folder, or takes it out.
- doctor.py: what a process would load, and whether a round trip works.
- bench.py, roundtrip.py: a timed DRAM<->FILE round trip through NIXL.
- nixlenv.py: which NIXL wheel `import nixl` loads in this environment, and why.
- locate.py: where the installed NIXL wheels keep their libraries and plugins; the one place
  that knows the wheels' layout (the storage node and the tests use it too).

The integrations (the vLLM connector, the vLLM tier, the LMCache plugin) are not here: they sit
at the package's top level, at the module paths client configurations name.
"""
