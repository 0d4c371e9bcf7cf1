import torch

from fusedpar.comm import count_bytes
from fusedpar.comm.counters import record


def test_counts_only_inside_the_block_and_reads_device_counters_lazily():
    record("all_gather", "triton", 100)  # nobody listening: dropped
    with count_bytes() as outer:
        record("all_gather", "triton", 10)
        with count_bytes() as inner:
            counter = torch.zeros(1, dtype=torch.int64)
            record("reduce_scatter", "triton", counter)
            counter += 7  # a kernel filling it in after the record call
        record("all_gather", "reference", 1)
    assert inner.by_op() == {("reduce_scatter", "triton"): 7}
    assert outer.by_op() == {("all_gather", "triton"): 10, ("reduce_scatter", "triton"): 7,
                             ("all_gather", "reference"): 1}
    assert outer.total() == 18
