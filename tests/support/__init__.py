"""Helpers shared by the test suites (tests/python, tests/reliability, tests/gpu, tests/remote).

pytest.ini puts tests/ (and python/, the package of this checkout) on sys.path, so every suite
imports these as `support.<module>`:

- plugin_dir: the NIXL plugin folder the tests load (IUD_PLUGIN_DIR), set before NIXL starts.
- mounts: file systems a test needs root to mount: the FUSE fault file systems (FuseMount) and
  small tmpfs folders (TmpfsMounts).
- descriptors: descriptor generators: random sizes and the file and memory offsets that lay them
  out (back to back, shuffled, spread with gaps, in slots; the round trips' mixed layout; the
  storage node's scattered blocks).
- rings: this process's io_uring fds and what their fixed-file and fixed-buffer tables hold.
- fuse_faultfs.py, fuse_rules.py: the FUSE daemons FuseMount runs (raw /dev/fuse protocol,
  stdlib only), each run as its own process: a fault mode (EIO at an offset, hung reads), or a
  list of rules (EIO on read or write, ENOSPC, short I/O, delays, direct I/O).

The NIXL wheel lookup the suites need is the package's own (nixl_io_uring_dmabuf.tools.locate).
"""
