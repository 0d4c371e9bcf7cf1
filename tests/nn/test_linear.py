"""ColumnParallelLinear / RowParallelLinear / SharedGather against one process's nn.Linear and
against torch DTensor's ColwiseParallel / RowwiseParallel on the same weights.

Every rank builds the same seeded full layer, input and output-gradient weights, then feeds
its own shard; the checks cover the forward output, the input gradient, the full weight /
bias gradients reassembled from the shards, and the parameters after one SGD step.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fusedpar
from fusedpar.nn import ColumnParallelLinear, RowParallelLinear, SharedGather
from tests.nn.tp_cases import close, tp_mesh

LR = 0.1
BACKEND = "reference"  # the fused ops' backend for the shared-gather checks

# (input shape, sequence_dim passed to the layer, the sequence dim it resolves to)
LAYOUTS = [((2, 8, 16), None, 1), ((8, 16), None, 0), ((8, 2, 16), 0, 0)]


def _rank_world():
    return dist.get_rank(), dist.get_world_size()


def _full(t):
    """A DTensor's full value; a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train_step(module, x, g):
    """``module(x)``, then one SGD step on ``(y * g).sum()``: ``(y, x's grad, {name: full
    grad}, {name: full parameter after the step})``."""
    x = x.clone().requires_grad_()
    y = module(x)
    (y * g).sum().backward()
    torch.optim.SGD(module.parameters(), lr=LR).step()
    return (y.detach(), x.grad, {n: _full(p.grad) for n, p in module.named_parameters()},
            {n: _full(p.detach()) for n, p in module.named_parameters()})


# ---- the per-rank checks ---------------------------------------------------------------------


def _check_layer(kind: str, sp: bool, bias: bool, shape, sequence_dim, seq, backend) -> None:
    """A ColumnParallelLinear (``kind="column"``) or RowParallelLinear against the single-process
    nn.Linear and torch's ColwiseParallel / RowwiseParallel: output, input grad, and the
    parameters' grads and values after one SGD step."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    column = kind == "column"
    rank, world = _rank_world()
    torch.manual_seed(0 if column else 1)
    out_features = 24 if column else 12
    full = nn.Linear(shape[-1], out_features, bias=bias)
    x_full = torch.randn(shape)
    g_full = torch.randn(*shape[:-1], out_features)
    layer = ColumnParallelLinear if column else RowParallelLinear
    ours = layer.from_linear(copy.deepcopy(full), None, sequence_parallel=sp,
                             sequence_dim=sequence_dim, backend=backend)
    sequence = Shard(seq) if sp else Replicate()
    style = (ColwiseParallel(input_layouts=sequence, use_local_output=True) if column
             else RowwiseParallel(output_layouts=sequence, use_local_output=True))
    dt = parallelize_module(copy.deepcopy(full), tp_mesh(), style)

    def part(t, features: bool):
        """This rank's part of a full input or output: its features, or its sequence chunk (SP)."""
        if features:
            return t.chunk(world, -1)[rank]
        return t.chunk(world, seq)[rank] if sp else t

    # column: the input is sequence-sharded (SP), the output feature-sharded; row: the reverse
    y_ref, x_grad_ref, grads_ref, params_ref = _train_step(full, x_full, g_full)
    x_local, g_local = part(x_full, not column), part(g_full, column)
    y, x_grad, grads, params = _train_step(ours, x_local, g_local)
    y_dt, x_grad_dt, grads_dt, params_dt = _train_step(dt, x_local, g_local)

    assert y.shape == part(y_ref, column).shape
    close(y, part(y_ref, column), f"{kind} output")
    close(x_grad, part(x_grad_ref, not column), f"{kind} input grad")
    for n in grads_ref:  # a row layer's bias is replicated: every rank holds the complete grad
        close(grads[n], grads_ref[n], f"{kind} {n} grad")
        close(params[n], params_ref[n], f"{kind} {n} after SGD")
    # DTensor: same outputs and input grads; its parameter grads/params are full tensors
    close(y, y_dt, f"{kind} output vs DTensor")
    close(x_grad, x_grad_dt, f"{kind} input grad vs DTensor")
    for n in grads_dt:
        close(grads[n], grads_dt[n], f"{kind} {n} grad vs DTensor")
        close(params[n], params_dt[n], f"{kind} {n} after SGD vs DTensor")


def _check_layers(sp: bool, backend: str) -> bool:
    for i, (shape, sequence_dim, seq) in enumerate(LAYOUTS):
        for bias in (True, False) if i == 0 else (True,):
            for kind in ("column", "row"):
                _check_layer(kind, sp, bias, shape, sequence_dim, seq, backend)
    return True


def _check_column_row_pair(sp: bool) -> bool:
    """Column -> row (an MLP) reproduces the single-process two-layer MLP."""
    rank, world = _rank_world()
    torch.manual_seed(2)
    up, down = nn.Linear(16, 32), nn.Linear(32, 16)
    x_full, g_full = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    col = ColumnParallelLinear.from_linear(up, None, sequence_parallel=sp, backend=BACKEND)
    row = RowParallelLinear.from_linear(down, None, sequence_parallel=sp, backend=BACKEND)
    x_ref = x_full.clone().requires_grad_()
    y_ref = down(torch.relu(up(x_ref)))
    (y_ref * g_full).sum().backward()
    x = (x_full.chunk(world, 1)[rank] if sp else x_full).clone().requires_grad_()
    y = row(torch.relu(col(x)))
    (y * (g_full.chunk(world, 1)[rank] if sp else g_full)).sum().backward()
    close(y, y_ref.detach().chunk(world, 1)[rank] if sp else y_ref.detach(), "mlp output")
    close(x.grad, x_ref.grad.chunk(world, 1)[rank] if sp else x_ref.grad, "mlp input grad")
    close(_full(col.weight.grad), up.weight.grad, "mlp up weight grad")
    close(_full(row.weight.grad), down.weight.grad, "mlp down weight grad")
    close(_full(row.bias.grad), down.bias.grad, "mlp down bias grad")
    return True


def _check_shared_gather(sp: bool) -> bool:
    """One gather for three layers, explicit and through prepare_input, same numbers as
    three separate layers."""
    rank, world = _rank_world()
    torch.manual_seed(3)
    fulls = [nn.Linear(16, 8), nn.Linear(16, 4 * world, bias=False), nn.Linear(16, 4)]
    x_full, gs = torch.randn(2, 8, 16), [torch.randn(2, 8, f.out_features) for f in fulls]

    def layers():
        return [ColumnParallelLinear.from_linear(f, None, sequence_parallel=sp, backend=BACKEND)
                for f in fulls]

    x_local = x_full.chunk(world, 1)[rank] if sp else x_full
    x_bytes = x_local.numel() * x_local.element_size()
    reference = None
    for mode in ("separate", "call", "prepare"):
        group = layers()
        x = x_local.clone().requires_grad_()
        with fusedpar.comm.count_bytes() as counter:
            if mode == "separate":
                outs = [layer(x) for layer in group]
            elif mode == "call":
                outs = SharedGather(*group)(x)
            else:
                shared = ColumnParallelLinear.share_gather(*group)
                prepared = shared.prepare_input(x)
                assert prepared.shape == x_full.shape  # gathered (SP) or replicated
                outs = [layer(prepared) for layer in reversed(group)][::-1]  # any order
                assert shared._stash == {}
                again = group[1](prepared)  # a second call: computed locally, same numbers
                close(again, outs[1], "second call of a shared layer")
        gathers = counter.by_op().get(("all_gather_matmul", BACKEND), 0)
        expected = (len(group) if mode == "separate" else 1) * (world - 1) * x_bytes if sp else 0
        assert gathers == expected, (mode, gathers, expected)
        sum((o * g.chunk(world, -1)[rank]).sum() for o, g in zip(outs, gs)).backward()
        result = ([o.detach() for o in outs], x.grad, [_full(layer.weight.grad) for layer in group],
                  [_full(layer.bias.grad) if layer.bias is not None else None for layer in group])
        if reference is None:
            reference = result
            continue
        for a, b in zip(result[0], reference[0]):
            close(a, b, f"{mode}: output")
        close(result[1], reference[1], f"{mode}: input grad")
        for a, b in zip(result[2] + result[3], reference[2] + reference[3]):
            if b is not None:
                close(a, b, f"{mode}: parameter grad")
    return True


def _check_init_and_errors() -> bool:
    from torch.distributed.tensor import Replicate, Shard

    rank, world = _rank_world()
    torch.manual_seed(5)
    full = nn.Linear(16, 24)
    torch.manual_seed(5)
    col = ColumnParallelLinear(16, 24)
    torch.manual_seed(5)
    row = RowParallelLinear(16, 24)
    # a seeded layer holds exactly the seeded nn.Linear's shard
    assert torch.equal(col.weight.to_local(), full.weight.chunk(world, 0)[rank])
    assert torch.equal(col.bias.to_local(), full.bias.chunk(world, 0)[rank])
    assert torch.equal(row.weight.to_local(), full.weight.chunk(world, 1)[rank])
    assert torch.equal(row.bias.to_local(), full.bias)
    # DTensors of the global shape on the TP axis, placed as ColwiseParallel/RowwiseParallel
    assert col.weight.shape == row.weight.shape == (24, 16)
    assert col.weight.placements == (Shard(0),) and col.bias.placements == (Shard(0),)
    assert row.weight.placements == (Shard(1),) and row.bias.placements == (Replicate(),)
    assert torch.equal(col.weight.full_tensor(), full.weight)
    meta = ColumnParallelLinear(16, 24, device="meta")
    assert meta.weight.is_meta
    assert "sequence_parallel=False" in repr(col)
    assert set(col.state_dict()) == {"weight", "bias"}
    messages = []
    for bad in (lambda: ColumnParallelLinear(16, 6 * world + 1),
                lambda: RowParallelLinear(4 * world + 1, 8),
                lambda: row(torch.randn(3, 16)),  # the full input instead of this rank's shard
                lambda: ColumnParallelLinear(16, 8, sequence_parallel=True)(torch.randn(3, 8)),
                lambda: SharedGather(col, ColumnParallelLinear(16, 8, sequence_parallel=True)),
                lambda: SharedGather(col, RowParallelLinear(16, 24)),
                lambda: ColumnParallelLinear(16, 8, float8="tensorwise"),  # float8 needs SP
                lambda: RowParallelLinear(16, 8, sequence_parallel=True, float8="rowwize"),
                lambda: SharedGather(ColumnParallelLinear(16, 8, sequence_parallel=True),
                                     ColumnParallelLinear(16, 8, sequence_parallel=True, float8="rowwise"))):
        try:
            bad()
        except (ValueError, TypeError) as e:
            messages.append(str(e))
        else:
            raise AssertionError("no error raised")
    assert "not divisible by the tensor-parallel size" in messages[0]
    assert "in_features" in messages[1]
    assert "this rank's shard" in messages[2]
    assert "sequence_parallel" in messages[4]
    assert "float8='tensorwise') needs sequence_parallel=True" in messages[6]
    assert "unknown recipe 'rowwize'" in messages[7]
    assert "layer 1 has float8='rowwise' but layer 0 has None" in messages[8]
    # a float8 layer called twice on one prepared input: its gathered input is fp8
    pair = [ColumnParallelLinear(16, 16, sequence_parallel=True, float8="tensorwise") for _ in range(2)]
    shared = SharedGather(*pair)
    prepared = shared.prepare_input(torch.randn(2, 4, 16))
    assert prepared.shape == (2, 4 * world, 16) and prepared.dtype == torch.float8_e4m3fn
    pair[0](prepared)
    try:
        pair[0](prepared)
    except RuntimeError as e:
        assert "called twice on one prepared input" in str(e)
    else:
        raise AssertionError("no error raised")
    return True


# ---- tests -----------------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sp,backend", [(False, None), (True, "reference"), (True, "pipelined")],
                         ids=["replicated", "sp-reference", "sp-pipelined"])
@pytest.mark.parametrize("world", [2, 4])
def test_layers_match_single_process_and_dtensor(pools, world, sp, backend):
    """Without SP the layers call no fused op (a local matmul and an all-reduce)."""
    assert pools(world).run(_check_layers, sp, backend) == [True] * world


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sequence_parallel"])
def test_column_then_row_is_the_mlp(pools, sp):
    assert pools(2).run(_check_column_row_pair, sp) == [True] * 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sequence_parallel"])
@pytest.mark.parametrize("world", [2, 4])
def test_shared_gather_does_one_gather(pools, world, sp):
    assert pools(world).run(_check_shared_gather, sp) == [True] * world


@pytest.mark.timeout(300)
def test_seeded_init_and_errors(pools):
    assert pools(2).run(_check_init_and_errors) == [True] * 2
