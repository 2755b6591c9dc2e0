"""contrib/nixlbench: the patch is a well-formed unified diff that adds IO_URING_DMABUF in the
three places upstream nixlbench checks backend names. (Applying it is checked against the
upstream source outside CI, and building nixlbench needs NIXL's C++ headers: see
contrib/nixlbench/README.md.)"""

from __future__ import annotations

import os
import re

import clients_env as E

PATCH = os.path.join(
    E.REPO, "contrib", "nixlbench", "0001-nixlbench-add-IO_URING_DMABUF-storage-backend.patch"
)


def test_nixlbench_patch_adds_the_name_where_nixlbench_checks_names():
    text = open(PATCH, encoding="utf-8").read()
    files = re.findall(r"^diff --git a/(\S+) b/\1$", text, re.M)
    assert files == [
        "benchmark/nixlbench/src/utils/utils.cpp",
        "benchmark/nixlbench/src/utils/utils.h",
        "benchmark/nixlbench/src/worker/nixl/nixl_worker.cpp",
    ]
    added = [ln[1:] for ln in text.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    assert '#define XFERBENCH_BACKEND_IO_URING_DMABUF "IO_URING_DMABUF"' in added
    assert any("XFERBENCH_BACKEND_IO_URING_DMABUF == xferBenchConfig::backend" in a for a in added)
    assert any("compare(XFERBENCH_BACKEND_IO_URING_DMABUF)" in a for a in added)
    # Every hunk's line counts match its body (a hand-edited patch that git would reject).
    for m in re.finditer(r"^@@ -\d+,(\d+) \+\d+,(\d+) @@.*\n((?:[ +\-].*\n|\\.*\n)*)", text, re.M):
        body = m.group(3).splitlines()
        old = sum(1 for ln in body if ln[:1] in (" ", "-"))
        new = sum(1 for ln in body if ln[:1] in (" ", "+"))
        assert (old, new) == (int(m.group(1)), int(m.group(2))), m.group(0)[:80]
