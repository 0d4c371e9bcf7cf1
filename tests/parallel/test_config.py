"""ParallelConfig: validation on CPU without process groups, and mesh building on 4 gloo ranks."""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings

import pytest

from fusedpar.errors import FusedparError, ParallelConfigError
from fusedpar.parallel import (
    EP_MESH_AXES,
    FLATTENED_AXES,
    MESH_AXES,
    ParallelConfig,
    get_submesh,
)
from fusedpar.parallel import ParallelConfigError as ReexportedError

# --------------------------------------------------------------------------- validation


def test_error_type():
    assert ReexportedError is ParallelConfigError
    assert issubclass(ParallelConfigError, ValueError)
    assert issubclass(ParallelConfigError, FusedparError)


def test_defaults_are_pure_fsdp():
    cfg = ParallelConfig()
    assert (cfg.dp_replicate, cfg.dp_shard, cfg.tp, cfg.cp, cfg.ep) == (1, -1, 1, 1, 1)
    assert not cfg.is_resolved and cfg.world_size is None
    assert ParallelConfig().validate(8) == ParallelConfig(dp_shard=8)


def test_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        ParallelConfig(1, 2)  # type: ignore[misc]
    cfg = ParallelConfig(tp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tp = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, world, expected",
    [
        ({}, 1, (1, 1, 1, 1, 1)),
        ({}, 8, (1, 8, 1, 1, 1)),
        ({"tp": 2}, 8, (1, 4, 2, 1, 1)),
        ({"tp": 8}, 8, (1, 1, 8, 1, 1)),
        ({"cp": 2, "tp": 2}, 8, (1, 2, 2, 2, 1)),
        ({"dp_replicate": 2}, 8, (2, 4, 1, 1, 1)),
        ({"dp_replicate": 2, "tp": 2}, 16, (2, 4, 2, 1, 1)),
        ({"dp_replicate": 4, "dp_shard": 2, "tp": 2}, 16, (4, 2, 2, 1, 1)),  # Axolotl 4x2x2
        ({"dp_replicate": -1, "dp_shard": 2}, 8, (4, 2, 1, 1, 1)),
        ({"dp_replicate": -1, "dp_shard": 4, "tp": 2}, 64, (8, 4, 2, 1, 1)),
        ({"ep": 8}, 8, (1, 8, 1, 1, 8)),
        ({"tp": 2, "ep": 4}, 8, (1, 4, 2, 1, 4)),  # ep borrows from dp_shard x tp
        ({"cp": 2, "tp": 2, "ep": 8}, 16, (1, 4, 2, 2, 8)),
        ({"dp_replicate": 3}, 6, (3, 2, 1, 1, 1)),  # odd sizes
        ({"tp": 3, "ep": 5}, 15, (1, 5, 3, 1, 5)),
    ],
)
def test_validate_resolves(kwargs, world, expected):
    cfg = ParallelConfig(**kwargs).validate(world)
    assert (cfg.dp_replicate, cfg.dp_shard, cfg.tp, cfg.cp, cfg.ep) == expected
    assert cfg.is_resolved and cfg.world_size == world
    assert cfg.mesh_shape == (cfg.dp_replicate, cfg.dp_shard, cfg.cp, cfg.tp)
    assert cfg.dp == cfg.dp_replicate * cfg.dp_shard
    assert cfg.dp_shard_cp == cfg.dp_shard * cfg.cp
    assert cfg.efsdp * cfg.ep == cfg.dp_shard * cfg.cp * cfg.tp
    assert cfg.validate(world) == cfg  # idempotent
    assert ParallelConfig(**kwargs).validate(world) is not ParallelConfig(**kwargs)


def test_validate_returns_copy_and_leaves_original():
    cfg = ParallelConfig(tp=2)
    resolved = cfg.validate(8)
    assert cfg.dp_shard == -1 and resolved.dp_shard == 4


@pytest.mark.parametrize(
    "kwargs, world, fragments",
    [
        # product of explicit degrees differs from the world size
        (
            {"dp_shard": 3, "tp": 2},
            8,
            [
                "dp_replicate(1) * dp_shard(3) * cp(1) * tp(2) = 6 but world_size is 8",
                "make the product equal 8",
                "dp_shard=-1",
                "(dp_shard=4)",
            ],
        ),
        (
            {"dp_shard": 2},
            8,
            ["= 2 but world_size is 8", "dp_shard=-1", "(dp_shard=8)", "dp_replicate=-1", "(dp_replicate=4)"],
        ),
        (
            {"dp_replicate": 2, "dp_shard": 2},
            2,
            ["dp_replicate(2) * dp_shard(2) * cp(1) * tp(1) = 4 but world_size is 2"],
        ),
        (
            {"dp_shard": 1, "tp": 3},
            8,
            ["= 3 but world_size is 8", "tp=3 does not divide world_size=8", "1, 2, 4, 8"],
        ),
        # -1 cannot be resolved
        ({"tp": 3}, 8, ["tp=3 does not divide world_size=8", "dp_shard=-1", "1, 2, 4, 8"]),
        ({"cp": 16}, 8, ["cp=16 does not divide world_size=8"]),
        (
            {"cp": 4, "tp": 4},
            8,
            ["dp_replicate(1) * cp(4) * tp(4) = 16 does not divide world_size=8", "dp_shard=-1"],
        ),
        ({"dp_replicate": -1, "dp_shard": 3}, 8, ["dp_shard=3 does not divide world_size=8", "dp_replicate=-1"]),
        # ep must divide dp_shard * cp * tp
        (
            {"tp": 2, "ep": 3},
            8,
            ["ep=3 does not divide dp_shard(4) * cp(1) * tp(2) = 8", "borrows", "1, 2, 4, 8"],
        ),
        ({"dp_replicate": 2, "ep": 4}, 4, ["ep=4 does not divide dp_shard(2) * cp(1) * tp(1) = 2"]),
        # Axolotl counts ep x dp_shard == world: we say ep borrows
        (
            {"dp_shard": 4, "ep": 2},
            8,
            ["dp_shard(4)", "= 4 but world_size is 8", "ep=2 is not a factor of the world size", "(dp_shard=8)"],
        ),
        # bad world sizes
        ({}, 0, ["world_size=0"]),
        ({}, -4, ["world_size=-4"]),
        ({}, 2.0, ["world_size=2.0"]),
        ({}, True, ["world_size=True"]),
    ],
)
def test_validate_errors_name_the_numbers(kwargs, world, fragments):
    with pytest.raises(ParallelConfigError) as info:
        ParallelConfig(**kwargs).validate(world)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        ({"tp": 0}, ["tp=0", "positive int"]),
        ({"cp": -3}, ["cp=-3", "positive int"]),
        ({"ep": 0}, ["ep=0"]),
        ({"dp_shard": 0}, ["dp_shard=0", "or -1"]),
        ({"dp_shard": -2}, ["dp_shard=-2", "or -1"]),
        ({"dp_replicate": 0}, ["dp_replicate=0"]),
        ({"tp": -1}, ["tp=-1 is not allowed", "only dp_shard and dp_replicate"]),
        ({"cp": -1}, ["cp=-1 is not allowed"]),
        ({"ep": -1}, ["ep=-1 is not allowed"]),
        ({"dp_replicate": -1, "dp_shard": -1}, ["dp_replicate=-1 and dp_shard=-1", "at most one"]),
        ({"tp": 2.0}, ["tp=2.0", "float"]),
        ({"tp": "2"}, ["tp='2'", "str"]),
        ({"tp": True}, ["tp=True", "bool"]),
        ({"dp_shard": None}, ["dp_shard=None"]),
    ],
)
def test_bad_degrees_fail_at_construction(kwargs, fragments):
    with pytest.raises(ParallelConfigError) as info:
        ParallelConfig(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_index_like_degrees_become_int():
    np = pytest.importorskip("numpy")
    cfg = ParallelConfig(tp=np.int64(2))
    assert type(cfg.tp) is int and cfg.validate(4).dp_shard == 2


def test_exhaustive_small_worlds_agree_with_the_rules():
    """Every degree combination up to world 12: validate succeeds exactly when the rules hold."""
    for world in range(1, 13):
        for dp_replicate, dp_shard, cp, tp, ep in itertools.product(
            (-1, 1, 2, 3), (-1, 1, 2, 3, 4), (1, 2, 3), (1, 2, 4), (1, 2, 3, 4)
        ):
            if dp_replicate == -1 and dp_shard == -1:
                continue
            cfg = ParallelConfig(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep)
            known = math.prod(v for v in (dp_replicate, dp_shard, cp, tp) if v != -1)
            if -1 in (dp_replicate, dp_shard):
                ok = world % known == 0
                filled = world // known if ok else None
            else:
                ok = known == world
                filled = None
            if ok:
                shard = filled if dp_shard == -1 else dp_shard
                ok = (shard * cp * tp) % ep == 0
            if ok:
                resolved = cfg.validate(world)
                assert resolved.world_size == world
            else:
                with pytest.raises(ParallelConfigError):
                    cfg.validate(world)


@pytest.mark.parametrize(
    "cfg, text",
    [
        (ParallelConfig(dp_shard=4, tp=2), "dp_replicate=1 dp_shard=4 cp=1 tp=2 ep=1 (world 8)"),
        (ParallelConfig(tp=2), "dp_replicate=1 dp_shard=-1 cp=1 tp=2 ep=1 (world: not resolved)"),
        (ParallelConfig(dp_replicate=2, cp=2).validate(16), "dp_replicate=2 dp_shard=4 cp=2 tp=1 ep=1 (world 16)"),
    ],
)
def test_describe(cfg, text):
    assert cfg.describe() == text
    assert str(cfg) == text
    assert "ParallelConfig(" in repr(cfg)


def test_derived_sizes_need_resolution():
    with pytest.raises(ParallelConfigError, match="validate"):
        ParallelConfig().mesh_shape
    with pytest.raises(ParallelConfigError, match="validate"):
        ParallelConfig().efsdp


# --------------------------------------------------------------------------- from_dict


@pytest.mark.parametrize(
    "d",
    [
        {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "cp": 1, "ep": 2},  # ours
        {"dp_replicate_size": 2, "dp_shard_size": 1, "tensor_parallel_size": 2, "expert_parallel_size": 2},  # Axolotl
        {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2, "cp_size": 1, "ep_size": 2},  # Accelerate
        {
            "data_parallel_replicate_degree": 2,
            "data_parallel_shard_degree": 2,
            "tensor_parallel_degree": 2,
            "context_parallel_degree": 1,
            "expert_parallel_degree": 2,
        },
    ],
)
def test_from_dict_key_families(d):
    assert ParallelConfig.from_dict(d) == ParallelConfig(dp_replicate=2, dp_shard=2, tp=2, ep=2)


@pytest.mark.parametrize("key", ["cp", "context_parallel_size", "sequence_parallel_degree", "cp_size", "context_parallel_degree"])
def test_from_dict_cp_aliases(key):
    assert ParallelConfig.from_dict({key: 4}).cp == 4


def test_from_dict_none_means_unset():
    cfg = ParallelConfig.from_dict(
        {"dp_shard_size": None, "dp_replicate_size": None, "tensor_parallel_size": 2, "context_parallel_size": None}
    )
    assert cfg == ParallelConfig(tp=2)
    assert ParallelConfig.from_dict({}) == ParallelConfig()


def test_from_dict_minus_one():
    assert ParallelConfig.from_dict({"data_parallel_shard_degree": -1, "tp": 2}).validate(8).dp_shard == 4
    cfg = ParallelConfig.from_dict({"dp_shard_size": 2, "dp_replicate_size": -1})
    assert cfg.validate(8).dp_replicate == 4
    with pytest.raises(ParallelConfigError, match="tensor_parallel_size=-1 is not allowed"):
        ParallelConfig.from_dict({"tensor_parallel_size": -1})


def test_from_dict_same_field_twice():
    # the same value under two names is fine
    assert ParallelConfig.from_dict({"context_parallel_size": 2, "sequence_parallel_degree": 2}).cp == 2
    assert ParallelConfig.from_dict({"tp": 2, "tensor_parallel_size": None}).tp == 2
    with pytest.raises(ParallelConfigError) as info:
        ParallelConfig.from_dict({"context_parallel_size": 2, "sequence_parallel_degree": 4})
    message = str(info.value)
    assert "cp is given twice" in message
    assert "context_parallel_size=2" in message and "sequence_parallel_degree=4" in message
    with pytest.raises(ParallelConfigError, match="tp=2 and tensor_parallel_degree=4"):
        ParallelConfig.from_dict({"tp": 2, "tensor_parallel_degree": 4})


def test_from_dict_unknown_key_lists_accepted():
    with pytest.raises(ParallelConfigError) as info:
        ParallelConfig.from_dict({"tensor_paralel_size": 2, "zero_stage": 2})
    message = str(info.value)
    assert "'tensor_paralel_size'" in message and "'zero_stage'" in message
    assert "did you mean 'tensor_parallel_size'" in message
    for key in ("dp_shard_size", "sequence_parallel_degree", "data_parallel_shard_degree", "expert_parallel_size", "tp"):
        assert key in message


def test_from_dict_bad_values():
    with pytest.raises(ParallelConfigError, match="dp_shard_size=0"):
        ParallelConfig.from_dict({"dp_shard_size": 0})
    with pytest.raises(ParallelConfigError, match="tensor_parallel_size='2'"):
        ParallelConfig.from_dict({"tensor_parallel_size": "2"})
    with pytest.raises(ParallelConfigError, match="mapping"):
        ParallelConfig.from_dict([("tp", 2)])  # type: ignore[arg-type]


def test_build_mesh_without_world_size_says_how_to_fix(monkeypatch):
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # pragma: no cover
        pytest.skip("a default process group exists in this process")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ParallelConfigError, match="torchrun"):
        ParallelConfig().build_mesh("cpu")


# --------------------------------------------------------------------------- meshes (4 gloo ranks)


def _mesh_worker(config_kwargs: dict) -> dict:
    """Build the dense and expert meshes on this rank and report them as plain data."""
    import torch.distributed as dist

    rank = dist.get_rank()
    cfg = ParallelConfig(**config_kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = cfg.build_mesh("cpu")
        build_warnings = [str(w.message) for w in caught]
        axes = {}
        for name in (*MESH_AXES, *FLATTENED_AXES):
            sub = get_submesh(mesh, name)
            axes[name] = {
                "mesh": sub.mesh.flatten().tolist(),
                "group": dist.get_process_group_ranks(sub.get_group()),
                "size": sub.size(),
                "local_rank": sub.get_local_rank(),
            }
        hsdp = get_submesh(mesh, ("dp_replicate", "dp_shard_cp"))  # FSDP2's 2-D HSDP mesh
        axes["hsdp"] = {"names": list(hsdp.mesh_dim_names), "mesh": hsdp.mesh.tolist(),
                        "groups": [dist.get_process_group_ranks(hsdp.get_group(d)) for d in range(2)]}
        getter_warnings = [str(w.message) for w in caught][len(build_warnings) :]
    with warnings.catch_warnings():
        # torch >= 2.10 warns that slicing a flattened axis from the root is deprecated
        warnings.simplefilter("ignore")
        getitem = {name: dist.get_process_group_ranks(mesh[name].get_group()) for name in FLATTENED_AXES}
    ep_mesh = cfg.build_ep_mesh("cpu")
    ep_axes = {name: dist.get_process_group_ranks(ep_mesh[name].get_group()) for name in EP_MESH_AXES}
    dist.barrier()
    return {
        "rank": rank,
        "mesh_dim_names": list(mesh.mesh_dim_names),
        "shape": list(mesh.shape),
        "coordinate": list(mesh.get_coordinate()),
        "axes": axes,
        "getitem": getitem,
        "ep_mesh_dim_names": list(ep_mesh.mesh_dim_names),
        "ep_shape": list(ep_mesh.shape),
        "ep_axes": ep_axes,
        "build_warnings": build_warnings,
        "getter_warnings": getter_warnings,
    }


def _expected_group(shape: tuple[int, ...], rank: int, axes: tuple[str, ...], names=MESH_AXES) -> list[int]:
    """Ranks of ``rank``'s group over ``axes`` in a row-major (last axis innermost) mesh."""
    coords = dict(zip(names, _unravel(rank, shape)))
    strides = {name: math.prod(shape[i + 1 :]) for i, name in enumerate(names)}
    base = sum(coords[n] * strides[n] for n in names if n not in axes)
    ranges = [range(shape[names.index(a)]) for a in axes]
    return [base + sum(i * strides[a] for i, a in zip(idx, axes)) for idx in itertools.product(*ranges)]


def _unravel(rank: int, shape: tuple[int, ...]) -> list[int]:
    coords = []
    for size in reversed(shape):
        coords.append(rank % size)
        rank //= size
    return coords[::-1]


MESH_CASES = {
    # id: (config_kwargs, mesh shape, tp groups, dp_shard_cp groups)
    "fsdp2-tp2": ({"dp_shard": 2, "tp": 2}, (1, 2, 1, 2), [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    "hsdp2x2": ({"dp_replicate": 2, "dp_shard": -1}, (2, 2, 1, 1), [[0], [1], [2], [3]], [[0, 1], [2, 3]]),
    "fsdp2-cp2-ep2": ({"cp": 2, "ep": 2}, (1, 2, 2, 1), [[0], [1], [2], [3]], [[0, 1, 2, 3]]),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(MESH_CASES))
def test_build_mesh_on_four_ranks(pools, case):
    config_kwargs, shape, tp_groups, dp_shard_cp_groups = MESH_CASES[case]
    reports = pools(4).run(_mesh_worker, config_kwargs)
    world = len(reports)
    cfg = ParallelConfig(**config_kwargs).validate(world)
    assert cfg.mesh_shape == shape
    for rank, report in enumerate(reports):
        assert report["rank"] == rank
        assert report["mesh_dim_names"] == list(MESH_AXES)
        assert report["shape"] == list(shape)
        assert report["coordinate"] == _unravel(rank, shape)
        axes = report["axes"]
        # tp innermost, then cp, dp_shard, dp_replicate outermost
        assert axes["tp"]["group"] == next(g for g in tp_groups if rank in g)
        assert axes["dp_shard_cp"]["group"] == next(g for g in dp_shard_cp_groups if rank in g)
        for name in MESH_AXES:
            expected = _expected_group(shape, rank, (name,))
            assert axes[name]["mesh"] == expected, name
            assert sorted(axes[name]["group"]) == expected, name
            assert axes[name]["size"] == shape[MESH_AXES.index(name)]
            assert axes[name]["local_rank"] == expected.index(rank)
        for name, parts in FLATTENED_AXES.items():
            expected = _expected_group(shape, rank, parts)
            assert axes[name]["mesh"] == expected, name
            assert sorted(axes[name]["group"]) == expected, name
            assert axes[name]["size"] == math.prod(shape[MESH_AXES.index(p)] for p in parts)
            assert axes[name]["local_rank"] == expected.index(rank)
            assert sorted(report["getitem"][name]) == expected, name  # mesh["dp_shard_cp"] works too
        # HSDP's (dp_replicate, dp_shard_cp) mesh: the root's rows, the axes' own groups
        hsdp = axes["hsdp"]
        assert hsdp["names"] == ["dp_replicate", "dp_shard_cp"]
        dp = _expected_group(shape, rank, ("dp_replicate", "dp_shard", "cp"))
        assert hsdp["mesh"] == [dp[i:i + len(dp) // shape[0]] for i in range(0, len(dp), len(dp) // shape[0])]
        assert hsdp["groups"] == [axes["dp_replicate"]["group"], axes["dp_shard_cp"]["group"]]
        # get_submesh is the warning-free way to reach a flattened axis
        assert not [w for w in report["getter_warnings"] if "flatten" in w.lower()], report["getter_warnings"]
        assert not [w for w in report["build_warnings"] if "flatten" in w.lower()], report["build_warnings"]
        # expert mesh: ep innermost, borrowed from dp_shard x cp x tp
        ep_shape = (cfg.dp_replicate, cfg.efsdp, cfg.ep)
        assert report["ep_mesh_dim_names"] == list(EP_MESH_AXES)
        assert report["ep_shape"] == list(ep_shape)
        for name in EP_MESH_AXES:
            assert sorted(report["ep_axes"][name]) == _expected_group(ep_shape, rank, (name,), EP_MESH_AXES), name
    if cfg.ep == 2:
        assert [sorted(r["ep_axes"]["ep"]) for r in reports] == [[0, 1], [0, 1], [2, 3], [2, 3]]
        assert [sorted(r["ep_axes"]["efsdp"]) for r in reports] == [[0, 2], [1, 3], [0, 2], [1, 3]]


# --------------------------------------------------------------------------- pipeline parallelism


@pytest.mark.parametrize("key", ["pp", "pipeline_parallel_size", "pipeline_parallel_degree", "pp_size"])
def test_pp_is_the_outermost_axis(key):
    cfg = ParallelConfig.from_dict({key: 2, "tp": 2}).validate(8)
    assert (cfg.pp, cfg.dp_shard, cfg.world_size) == (2, 2, 8)
    assert cfg.mesh_axes == ("pp", *MESH_AXES) and cfg.mesh_shape == (2, 1, 2, 1, 2)
    assert cfg.describe() == "pp=2 (1F1B) dp_replicate=1 dp_shard=2 cp=1 tp=2 ep=1 (world 8)"
    plain = ParallelConfig(tp=2).validate(8)  # without pp: no pp axis, the same description
    assert plain.mesh_axes == MESH_AXES and plain.mesh_shape == (1, 4, 1, 2)
    assert plain.describe() == "dp_replicate=1 dp_shard=4 cp=1 tp=2 ep=1 (world 8)"


def test_pp_schedules_and_stages():
    for name, want, stages in [("gpipe", "GPipe", 1), ("1F1B", "1F1B", 1),
                               ("interleaved", "Interleaved1F1B", 2), ("ZBV", "ZBVZeroBubble", 2),
                               ("interleaved_zero_bubble", "InterleavedZeroBubble", 2)]:
        cfg = ParallelConfig.from_dict({"pp": 2, "pipeline_parallel_schedule": name}).validate(4)
        assert (cfg.pp_schedule, cfg.pp_stages_per_rank, cfg.pp_stages) == (want, stages, 2 * stages)
    cfg = ParallelConfig(pp=4, pp_schedule="Interleaved1F1B", pp_stages_per_rank=3,
                         pp_microbatches=8, pp_split_points=[2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22])
    assert cfg.pp_stages == 12 and cfg.pp_split_points == tuple(range(2, 24, 2))
    assert cfg.describe().startswith("pp=4 (Interleaved1F1B, 8 microbatches) ")


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(pp=2, pp_schedule="pipedream"), "pp_schedule='pipedream': choose one of 1F1B, GPipe, Interleaved1F1B"),
    (dict(pp=2, pp_stages_per_rank=2), "pp_stages_per_rank=2 with pp_schedule=1F1B: 1F1B runs one stage per rank"),
    (dict(pp=2, pp_schedule="Interleaved1F1B", pp_stages_per_rank=1), "a multi-stage schedule runs at least 2"),
    (dict(pp=2, pp_schedule="zbv", pp_stages_per_rank=3), "ZBVZeroBubble runs exactly 2 stages per rank"),
    (dict(pp=0), "pp=0: must be a positive int"),
    (dict(pp=-1), "pp=-1 is not allowed"),
    (dict(pp=2, pp_microbatches=0), "pp_microbatches=0: must be a positive int"),
    (dict(pp=2, pp_split_points="2,4"), "pp_split_points='2,4': give the decoder-layer indices"),
])
def test_pp_option_errors(kwargs, fragment):
    with pytest.raises(ParallelConfigError) as info:
        ParallelConfig(**kwargs)
    assert fragment in str(info.value)


def test_pp_counts_in_the_world_size():
    with pytest.raises(ParallelConfigError, match=r"pp\(2\) \* dp_replicate\(1\) \* dp_shard\(4\) \* "
                                                  r"cp\(1\) \* tp\(1\) = 8 but world_size is 4"):
        ParallelConfig(pp=2, dp_shard=4).validate(4)
    with pytest.raises(ParallelConfigError, match="pp=3 does not divide world_size=4"):
        ParallelConfig(pp=3).validate(4)


def test_axolotl_expert_parallel_size_counts_beside_dp_shard():
    """Axolotl's dp_shard_size: 2, expert_parallel_size: 2 is 4 ranks (ep x dp_shard == world):
    FSDP over 4, experts over ep=2 of them; torchtitan's keys keep ep borrowing from dp_shard."""
    axolotl = ParallelConfig.from_dict({"dp_shard_size": 2, "expert_parallel_size": 2}).validate(4)
    assert (axolotl.dp_shard, axolotl.ep) == (4, 2)
    titan = ParallelConfig.from_dict({"data_parallel_shard_degree": 4, "expert_parallel_degree": 2})
    assert (titan.validate(4).dp_shard, titan.ep) == (4, 2)
    auto = ParallelConfig.from_dict({"dp_shard_size": -1, "expert_parallel_size": 2}).validate(4)
    assert (auto.dp_shard, auto.ep) == (4, 2)


# --------------------------------------------------------------------------- float8


@pytest.mark.parametrize("d, expected", [
    ({"float8": "rowwise"}, dict(float8="rowwise")),
    ({"fp8": True}, dict(float8="tensorwise")),  # Axolotl: torchao's default recipe
    ({"fp8": False, "tp": 2}, dict(tp=2)),  # no float8
    ({"fp8": True, "fp8_enable_fsdp_float8_all_gather": False},
     dict(float8="tensorwise", float8_all_gather=False)),
    ({"quantize.linear.float8": {"recipe_name": "rowwise_with_gw_hp", "filter_fqns": ["output"]}},
     dict(float8="rowwise_with_gw_hp", float8_exclude=("output",))),
    ({"quantize": {"linear": {"float8": {"enable_fsdp_float8_all_gather": True,
                                         "precompute_float8_dynamic_scale_for_fsdp": True}}}},
     dict(float8="tensorwise")),  # torchtitan's default recipe
    ({"float8": "tensorwise", "float8_include": "lm_head"}, dict(float8="tensorwise", float8_include=("lm_head",))),
    ({"fp8": True, "cp": 2, "tp": 2, "ep": 2}, dict(float8="tensorwise", cp=2, tp=2, ep=2)),  # every axis
])
def test_float8_keys(d, expected):
    assert ParallelConfig.from_dict(d) == ParallelConfig(**expected)


def test_float8_describe():
    assert ParallelConfig(float8="rowwise", dp_shard=4).describe() == \
        "dp_replicate=1 dp_shard=4 cp=1 tp=1 ep=1 float8=rowwise (world 4)"


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(float8="rowwize"), "float8='rowwize': torchao has no such float8 recipe; choose one of "
                             "tensorwise, rowwise, rowwise_with_gw_hp (did you mean 'rowwise'?)"),
    (dict(float8="rowwise", float8_exclude=[3]), "float8_exclude=[3]: give module-name substrings"),
    (dict(float8="rowwise", float8_all_gather="yes"), "float8_all_gather='yes': must be True or False"),
])
def test_float8_errors(kwargs, fragment):
    with pytest.raises(ParallelConfigError) as info:
        ParallelConfig(**kwargs)
    assert fragment in str(info.value)


def test_float8_key_conflicts_and_torchtitan_table_errors():
    with pytest.raises(ParallelConfigError, match="float8 is given twice"):
        ParallelConfig.from_dict({"fp8": True, "float8": "rowwise"})
    with pytest.raises(ParallelConfigError, match=r"quantize.linear.float8: unknown key\(s\) \['recipe'\]"):
        ParallelConfig.from_dict({"quantize.linear.float8": {"recipe": "rowwise"}})
    with pytest.raises(ParallelConfigError, match="reads torchtitan's quantize.linear.float8 table only"):
        ParallelConfig.from_dict({"quantize": {"linear": {"mx": {}}}})
