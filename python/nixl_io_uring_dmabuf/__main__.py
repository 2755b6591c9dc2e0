"""`python -m nixl_io_uring_dmabuf`: the command line (see tools/cli.py)."""

import sys

from nixl_io_uring_dmabuf.tools.cli import main

sys.exit(main())
