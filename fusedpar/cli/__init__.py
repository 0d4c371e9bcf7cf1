"""``fusedpar info | check | train | bench`` (also ``python -m fusedpar ...``); one module
per command:

- ``info`` (:mod:`.info`): versions, GPU, extension, which backends run here and why not.
- ``train`` (:mod:`.train`, alias ``demo``): the main job: train a small model
  parallelized by ``fusedpar.parallelize`` and compare its loss curve with one process.
- ``check`` (:mod:`.check`): every op on every backend available here, checked against
  its oracle, with the bytes moved next to the lower bound.
- ``bench`` (:mod:`.bench`): the benchmark suite (pytest-benchmark).
- ``plan`` (:mod:`.plan`): memory per GPU and step time of every parallel config.
- ``tune`` (:mod:`.tune`): measure each op's fastest backend on this GPU, for given shapes
  or one training step of a model (``--model``).

Multi-rank commands launch their ranks through :mod:`.launch`. Nothing in fusedpar
imports this package.
"""

from __future__ import annotations

import argparse
import sys
import traceback

from fusedpar.cli import bench, check, info, plan, train, tune


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fusedpar",
        description="fusedpar: fused communication+compute kernels for PyTorch. 'info' shows "
                    "what runs here, 'train' (alias 'demo') trains a small model on several "
                    "ranks, 'check' checks every op on every backend, 'bench' runs "
                    "the benchmark suite.")
    sub = parser.add_subparsers(dest="command", metavar="{train,check,info,bench,plan,tune}")
    sub.required = True
    for command in (train, check, info, bench, plan, tune):
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.command == "bench":
        return bench.run(extra[1:] if extra[:1] == ["--"] else extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "info":
        return info.run(args)
    if args.command == "plan":
        return plan.run(args)
    if args.command == "tune":
        return tune.run(args)
    try:
        return check.run(args, parser) if args.command == "check" else train.run(args, parser)
    except KeyboardInterrupt:
        return 130
    except Exception:  # noqa: BLE001 - show the traceback, exit non-zero
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
