"""Packed documents are read from the device once per tensor, not once per layer: every host
read (``tolist``, ``item``, ``cpu``, ``bool``, ``torch.equal``) of a step is counted, on CPU
tensors standing in for device ones (on a GPU each is a device-to-host sync)."""

import contextlib

import pytest
import torch

import fusedpar
from fusedpar.ops.flash_attention import from_host_list, host_list
from fusedpar.parallel import sequence_shard
from fusedpar.parallel.forward import document_ends

pytestmark = [pytest.mark.timeout(120)]

LAYERS = 3


@contextlib.contextmanager
def host_reads():
    """``reads``: ``(how, tensor)`` for each host read of a tensor inside."""
    reads, saved = [], {}

    def counting(owner, name):
        original = saved[owner, name] = getattr(owner, name)

        def read(t, *args, **kwargs):
            reads.append((name, t))
            return original(t, *args, **kwargs)
        setattr(owner, name, read)

    for name in ("tolist", "item", "cpu", "__bool__"):
        counting(torch.Tensor, name)
    counting(torch, "equal")
    try:
        yield reads
    finally:
        for (owner, name), original in saved.items():
            setattr(owner, name, original)


def of(reads, t) -> list[str]:
    return [how for how, read in reads if read is t]


def _layers(q, k, v, **documents):
    """``LAYERS`` packed flash attentions one after another (each layer's queries the last
    one's output), forward and backward; returns the output and q's gradient."""
    x = q
    for _ in range(LAYERS):
        x = fusedpar.ops.flash_attention(x, k, v, causal=True, backend="reference", **documents)
    x.sum().backward()
    return x.detach(), q.grad


def _inputs():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(30, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2)]


def test_packed_flash_attention_reads_documents_once_per_step():
    """One cu_seqlens, or cu_seqlens_q and cu_seqlens_k (equal values in two tensors, then
    other values): each is read once across the layers' forwards and backwards, and nothing
    else is read to the host; an in-place write is read again and gives what a new tensor
    of the new values gives."""
    cu = torch.tensor([0, 7, 8, 30], dtype=torch.int32)
    with host_reads() as reads:
        _layers(*_inputs(), cu_seqlens=cu)
    assert (of(reads, cu), len(reads)) == (["tolist"], 1), reads

    cu_q, cu_k = cu.clone(), cu.clone()
    with host_reads() as reads:
        same = _layers(*_inputs(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert (of(reads, cu_q), of(reads, cu_k), len(reads)) == (["tolist"], ["tolist"], 2), reads
    for got, want in zip(same, _layers(*_inputs(), cu_seqlens=cu)):
        assert torch.equal(got, want)

    cu_k[1] = 5  # k/v's documents now differ from q's
    with host_reads() as reads:
        other = _layers(*_inputs(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert (of(reads, cu_q), of(reads, cu_k), len(reads)) == ([], ["tolist"], 1), reads
    fresh = torch.tensor([0, 5, 8, 30], dtype=torch.int32)
    for got, want in zip(other, _layers(*_inputs(), cu_seqlens_q=cu_q, cu_seqlens_k=fresh)):
        assert torch.equal(got, want)
    assert not torch.equal(other[0], same[0])


def test_documents_found_on_the_host_are_never_read_back():
    """A packed row's cu_seqlens made from host values (``document_ends``, as the
    parallelized forward finds them from position_ids; ``from_host_list``) is not read by
    ``host_list`` nor by cp sharding; an in-place write is read again."""
    restarts = torch.zeros(31, dtype=torch.bool)
    restarts[[7, 19]] = True  # documents of 8, 12 and 12 positions
    x = torch.arange(32)[None]
    with host_reads() as reads:
        cu = document_ends(restarts, "cpu")
        assert host_list(cu) == cu.tolist() == [0, 8, 20, 32]  # the second: a read, counted
        parts = [sequence_shard(x, 1, r, 2, layout="zigzag_docs", cu_seqlens=cu) for r in range(2)]
    assert of(reads, cu) == ["tolist"], reads
    assert torch.equal(torch.cat(parts, 1).sort().values, x)
    assert parts[0].tolist() == [[0, 1, 6, 7, 8, 9, 10, 17, 18, 19, 20, 21, 22, 29, 30, 31]]

    made = from_host_list([0, 4, 12], "cpu")
    with host_reads() as reads:
        assert host_list(made) == [0, 4, 12] and reads == []
        made[1] = 6
        assert host_list(made) == [0, 6, 12] and of(reads, made) == ["tolist"]
    with pytest.raises(RuntimeError, match="overflow"):
        from_host_list([0, 2 ** 31], "cpu")
