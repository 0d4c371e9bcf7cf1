"""Launchers for the CUDA kernels of ``csrc/`` (``torch.ops.fusedpar._cuda_*``), with the
same signatures as the Triton launchers so a backend can take either set."""

import torch


def wait_flags(pad_table, word_base, rank, world_size, epoch, timeout_ns, code, meta=-1) -> None:
    if meta >= 0:
        raise NotImplementedError("the CUDA wait_flags kernel does not check fingerprints")
    torch.ops.fusedpar._cuda_wait_flags(pad_table, word_base, rank, world_size, epoch, timeout_ns, code)


def signal_peers(pad_table, word_base, rank, world_size, epoch, meta) -> None:
    torch.ops.fusedpar._cuda_signal_peers(pad_table, word_base, rank, world_size, epoch, meta)


def all_gather_pull(out, x, pad_table, rank, world_size, epoch, meta, outer, inner, timeout_ns,
                    stats) -> None:
    torch.ops.fusedpar._cuda_all_gather_pull(
        out, x, pad_table, rank, world_size, epoch, meta, outer, inner, timeout_ns, stats
    )


def reduce_scatter_pull(out, pad_table, rank, world_size, epoch, meta, outer, inner, timeout_ns,
                        stats, divisor=1.0) -> None:
    torch.ops.fusedpar._cuda_reduce_scatter_pull(
        out, pad_table, rank, world_size, epoch, meta, outer, inner, timeout_ns, stats, divisor
    )
