"""`python -m nixl_io_uring_dmabuf`: the command line (see cli.py)."""

import sys

from nixl_io_uring_dmabuf.cli import main

sys.exit(main())
