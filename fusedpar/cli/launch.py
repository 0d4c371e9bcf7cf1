"""Process launching shared by the commands that run on several ranks (``check``, ``train``).

A command writes one module-level function ``target(group, device, spec) -> result``
that every rank runs inside an initialized process group; rank 0's result (JSON) comes
back. Two ways in:

- :func:`spawn`: W local processes (``torch.multiprocessing``, ``spawn`` start method),
  gloo on CPU (Triton kernels in the interpreter) or NCCL with one GPU each. A failing
  rank gets its peers killed at once and its traceback reported; ranks that overrun the
  timeout are killed; this job's ``/dev/shm`` segments are removed whatever happens.
- :func:`torchrun_rank`: this process is one rank of a ``torchrun`` job (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK`` set); NCCL on its GPU, or gloo on CPU.
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import json
import os
import pickle
import re
import secrets
import signal
import tempfile
import time

import torch

import fusedpar
from fusedpar.comm.groups import settle_gloo_workers


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def pick_device(requested: str, world: int, parser) -> str:
    """``auto``: CUDA when there is a GPU per rank, else CPU (never queries a GPU that is
    not there); ``cuda`` without enough GPUs is a usage error."""
    if requested == "auto":
        enough = torch.cuda.is_available() and torch.cuda.device_count() >= world
        return "cuda" if enough else "cpu"
    if requested == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < world:
            parser.error(f"--device cuda needs a GPU per rank: {world} ranks, {count} GPUs")
    return requested


def add_launch_arguments(p, default_world: int, default_timeout: float) -> None:
    p.add_argument("--world-size", type=int, default=None,
                   help=f"ranks to spawn (default {default_world}; under torchrun WORLD_SIZE wins)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="spawned ranks on CPU (gloo, Triton interpreter) or one GPU each (NCCL); "
                        "auto: cuda when there is a GPU per rank")
    p.add_argument("--timeout", type=float, default=default_timeout,
                   help=f"seconds before the ranks are killed (default {default_timeout:g})")


@contextlib.contextmanager
def _environ(values: dict):
    """Set (None: unset) environment variables for the block, then restore them."""
    def apply(items: dict) -> None:
        for k, v in items.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    old = {k: os.environ.get(k) for k in values}
    try:
        apply(values)
        yield
    finally:
        apply(old)


def _kill(processes) -> None:
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join(timeout=10)


def root_cause(traceback_text: str) -> tuple[str, str]:
    """``(the root cause's exception line, the traceback text up to it)``: in a chain the
    first exception (the cause, printed first); an exception whose message nests the
    tracebacks of several ranks (DCP's ``CheckpointException``) stands for the first
    of them."""
    lines = traceback_text.rstrip().splitlines()
    nested = "Traceback (most recent call last): ("  # DCP's per-rank header: "(RANK 0)"
    in_nested = False
    for i, line in enumerate(lines):
        in_nested = in_nested or line.startswith(nested)
        wrapper = not in_nested and i + 1 < len(lines) and lines[i + 1].startswith(nested)
        if _EXCEPTION_LINE.match(line) and not wrapper:
            return line, "\n".join(lines[:i + 1])
    return (lines[-1] if lines else "(empty traceback)"), traceback_text.rstrip()


# "ValueError: ...", "torch.distributed.checkpoint.api.CheckpointException: ...", at column 0
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\w*(: |$)")


#: What a rank raises when a peer died or stalled: a consequence, not the root cause.
_TRANSPORT = re.compile(r"Connection (closed|reset) by peer|Broken pipe|ECONNRESET|DistNetworkError|"
                        r"DistBackendError|FusedparTimeoutError|[Tt]imed out|remote process exited|"
                        r"communicator was aborted")


def _rank_failures(ctx, killed: list[int], exited: dict[int, float]) -> list[str]:
    """What failed, the root cause first: the earliest rank killed by a signal, exiting
    without a traceback, or raising something other than a transport error (its traceback
    up to the root cause, once); then one line per other distinct cause naming its ranks;
    the survivors' transport errors (peers gone) in one line. ``exited``: when each rank
    was seen to exit."""
    found = []  # (secondary, when, rank, cause line, traceback text or None)
    for rank, (proc, path) in enumerate(zip(ctx.processes, ctx.error_files)):
        when = exited.get(rank, float("inf"))
        if os.path.exists(path):
            try:
                with open(path, "rb") as f:
                    text = pickle.load(f)
                when = os.path.getmtime(path)
            except (OSError, EOFError, pickle.UnpicklingError) as e:
                text = f"RuntimeError: its traceback is unreadable: {e}"
            cause, shown = root_cause(text)
            found.append((bool(_TRANSPORT.search(cause)), when, rank, cause, shown))
        elif rank not in killed and proc.exitcode not in (0, None):
            code = proc.exitcode
            if code < 0:
                try:
                    name = signal.Signals(-code).name
                except ValueError:
                    name = f"signal {-code}"
                cause = f"was killed by {name} (exit status {code})"
            else:
                cause = (f"exited with status {code} without a Python exception (exited from "
                         "native code or called os._exit)")
            found.append((False, when, rank, cause, None))
    if not found:
        return ["a rank failed, and no rank left a traceback"]
    found.sort(key=lambda t: t[:3])
    _, _, first, cause, shown = found[0]
    lines = [f"a rank failed: rank {first} {cause}" if cause.startswith(("was killed", "exited"))
             else f"a rank failed: rank {first} raised {cause}"]
    if shown is not None:
        lines += ["", shown, ""]
    same: dict[str, list[int]] = {}  # ranks that failed the same way are named together
    for secondary, _, rank, text, _ in found:
        same.setdefault("" if secondary and rank != first else text, []).append(rank)
    for text, ranks in same.items():
        if ranks == [first]:  # the first line said it
            continue
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {sorted(ranks)}"
        if not text:
            example = next(t[3] for t in found[1:] if t[0])
            lines.append(f"{who} then lost {'its' if len(ranks) == 1 else 'their'} peers "
                         f"(e.g. {example[:200]})")
        else:
            lines.append(f"{who} {text}" if text.startswith(("was killed", "exited")) else f"{who}: {text}")
    quiet = [r for r in killed if r not in {t[2] for t in found}]
    if quiet:  # the ranks still running, with nothing to report
        lines.append(f"rank {quiet[0]} was killed after the failure" if len(quiet) == 1
                     else f"ranks {quiet} were killed after the failure")
    return lines


def _wait_for_ranks(ctx, timeout: float) -> str | None:
    """Wait until every rank exits: None when all succeeded, else what went wrong. A
    failing rank gets its peers killed at once (they may be blocked on it)."""
    import multiprocessing.connection

    deadline = time.monotonic() + timeout
    procs = ctx.processes
    exited: dict[int, float] = {}  # on the clock of the error files' mtimes
    while True:
        codes = [p.exitcode for p in procs]
        for rank, code in enumerate(codes):
            if code is not None:
                exited.setdefault(rank, time.time())
        if all(c == 0 for c in codes):
            return None
        if any(c not in (0, None) for c in codes):
            time.sleep(0.5)  # let peers that fail on their own record their tracebacks
            killed = [r for r, p in enumerate(procs) if p.is_alive()]
            _kill(procs)
            return "\n".join(_rank_failures(ctx, killed, exited))
        if time.monotonic() > deadline:
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            _kill(procs)
            return f"ranks {alive} did not finish within {timeout:g} s; killed them"
        multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()], timeout=0.5)


def _spawned_rank(rank: int, world: int, target, spec: dict, how: dict) -> None:
    """Entry point of a spawned rank (torch.multiprocessing calls it with its index)."""
    import torch.distributed as dist

    if how["device"] == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # the ranks share the cores: more threads each only oversubscribes them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # longer than the parent's deadline: a stalled peer is reported (and killed) by the parent
    dist.init_process_group("nccl" if how["device"] == "cuda" else "gloo",
                            init_method=how["init_method"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=how["timeout"] + 60))
    try:
        try:
            result = target(dist.group.WORLD, device, spec)
        except (Exception, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # e.g. DCP's CheckpointException: torch's spawn records
            # the traceback of an Exception only (the parent would see just an exit status)
            raise RuntimeError(f"{type(e).__name__} (a BaseException) on rank {rank}") from e
        if rank == 0:
            tmp = how["result_file"] + ".tmp"
            with open(tmp, "w") as f:
                json.dump(result, f)
            os.replace(tmp, how["result_file"])
    finally:
        fusedpar.comm.release_buffers()
        dist.destroy_process_group()
        settle_gloo_workers()


def spawn(target, spec: dict, world: int, device: str, timeout: float, name: str,
          interpret: bool = True):
    """Run ``target(group, device, spec)`` on ``world`` spawned ranks.

    CPU ranks run the Triton kernels in the interpreter when ``interpret`` (else the ops
    choose their other backends).

    Returns ``(rank 0's result, None)``, or ``(None, what went wrong)``; ``"interrupted"``
    after Ctrl-C. ``name`` prefixes the job's temporary names.
    """
    import torch.multiprocessing as tmp

    job = f"{name}{os.getpid()}x{secrets.token_hex(3)}"
    result, error = None, None
    with tempfile.TemporaryDirectory(prefix=f"fusedpar_{name}_") as tmpdir:
        how = {"device": device, "timeout": timeout,
               "init_method": f"file://{os.path.join(tmpdir, 'rendezvous')}",
               "result_file": os.path.join(tmpdir, "result.json")}
        env = {
            # CPU ranks run the Triton kernels in the interpreter, which must be chosen before
            # the children import fusedpar; CUDA ranks must not use it
            "TRITON_INTERPRET": "1" if device == "cpu" and interpret else None,
            # shm segments are named fusedpar_<job>_...: this job's own, for the cleanup below
            "TORCHELASTIC_RUN_ID": job,
        }
        ctx = None
        try:
            with _environ(env):
                ctx = tmp.start_processes(_spawned_rank, args=(world, target, spec, how),
                                          nprocs=world, join=False, daemon=True,
                                          start_method="spawn")
            error = _wait_for_ranks(ctx, timeout)
            if error is None:
                with open(how["result_file"]) as f:
                    result = json.load(f)
        except KeyboardInterrupt:
            error = "interrupted"
        finally:
            if ctx is not None:
                _kill(ctx.processes)
                for path in ctx.error_files:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
            for path in glob.glob(f"/dev/shm/fusedpar_{job}_*"):
                with contextlib.suppress(OSError):
                    os.unlink(path)
    return result, error


@contextlib.contextmanager
def torchrun_rank(timeout: float):
    """Join the torchrun job's default process group; yields ``(device, backend)``.

    After a restart (``--max-restarts``) the job's store still holds the previous attempt's
    keys, among them the dead ranks' gloo addresses (pytorch#135712): the group's keys go
    under a prefix naming the attempt."""
    import torch.distributed as dist

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    store, rank, world = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout)))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"fusedpar/attempt_{attempt}", store),
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout))
    try:
        yield device, backend
    finally:
        fusedpar.comm.release_buffers()
        dist.destroy_process_group()
