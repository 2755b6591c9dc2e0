"""The vLLM connector's block checksums on a CUDA GPU: the Triton kernel and the torch operations
give exactly the host algorithm's values (a store's checksums, computed on the GPU, are checked
against the file by the scheduler on the host). Runs on the GPU machine (ci/gpu/run.sh tests);
without torch.cuda or Triton it skips with one line saying why.
"""

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="GPU tests need PyTorch")
if not torch.cuda.is_available():
    pytest.skip(
        "GPU tests need a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True
    )
pytest.importorskip("triton", reason="the checksum kernel needs Triton")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))

from nixl_io_uring_dmabuf.vllm_connector import checksum as C  # noqa: E402


def host_sums(rows: list[np.ndarray], pages: list[int], ids) -> list[int]:
    return [C.fold(C.page_sums(r[b, :p].view(np.uint8)) for r, p in zip(rows, pages)) for b in ids]


@pytest.mark.parametrize("pages", [[65536] * 4, [4096, 2050, 8192], [131072, 16]])
def test_kernel_and_torch_equal_the_host_algorithm(pages):
    gen = np.random.default_rng(sum(pages))
    nrows = 300
    # rows longer than their page (vLLM pads pages), the extreme word -32768 in one block
    rows = [gen.integers(-128, 128, size=(nrows, p + 64), dtype=np.int8) for p in pages]
    rows[0][5, :2] = [0, -128]
    rows[0][6, :2] = [-1, 127]
    dev = [torch.as_tensor(r).cuda() for r in rows]
    ids = gen.permutation(nrows)[:257]  # scattered, and not a multiple of 16
    want = host_sums(rows, pages, ids)
    kernel = C.TorchRows(dev, pages, kernel="triton")
    assert kernel.kernel == "triton"
    kernel.self_check()
    assert kernel.block_sums(ids) == want
    assert C.TorchRows(dev, pages, kernel="torch").block_sums(ids) == want
    assert kernel.block_sums(ids[:1]) == want[:1]
    assert kernel.block_sums(np.array([], dtype=np.int64)) == []


def test_the_kernel_sees_one_changed_word_in_any_page():
    pages = [65536] * 8
    gen = np.random.default_rng(9)
    dev = [torch.randint(-128, 128, (64, p), dtype=torch.int8, device="cuda") for p in pages]
    rows = C.TorchRows(dev, pages, kernel="triton")
    ids = np.arange(64)
    before = rows.block_sums(ids)
    for layer, block, word in [(0, 0, 0), (7, 63, 32767), (3, 17, int(gen.integers(32768)))]:
        dev[layer][block, 2 * word] += 1
        after = rows.block_sums(ids)
        assert [i for i in ids if after[i] != before[i]] == [block]
        dev[layer][block, 2 * word] -= 1
    assert rows.block_sums(ids) == before
