"""Spawned worker processes that act as the ranks of a gloo world, reused across tests.

``pool.run(fn, *args)`` runs the module-level function ``fn(*args)`` on every rank and
returns the per-rank results (rank order). If any rank raises, dies or overruns the
deadline (after a rank raised: ``FAILURE_GRACE_S`` more seconds), the pool is torn down (its state can no longer be trusted) and the error,
with each failing rank's traceback, is raised; the registry starts a new pool next time.
A pool whose ranks hold more than ``MAX_GROUPS`` process groups is retired the same way
after the task (see ``MAX_GROUPS``).
"""

from __future__ import annotations

import datetime
import glob
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback


def leftover_shm() -> list[str]:
    """Symmetric-memory files of the ranks this process spawned that still exist."""
    from fusedpar.comm.symmetric import shm_job_prefix

    return glob.glob(f"/dev/shm/{shm_job_prefix(os.getpid())}*")


#: Process groups a rank may hold before its pool is retired. Tests create groups (meshes,
#: pipeline stages, subgroups) and cannot destroy them: torch's DTensor caches keep meshes
#: that compare equal to later ones. Each idle gloo group costs about 1% of a core: after a
#: few hundred tests the ranks of one pool kept the machine's two cores busy; a new pool
#: costs seconds.
MAX_GROUPS = 50


#: Seconds the other ranks get to report after one rank raised: then the pool is torn down
#: (a rank waiting for the failed one would otherwise hold the test until its timeout).
FAILURE_GRACE_S = 15


class WorkerDied:
    """In ``run(..., tolerate_death=True)`` results: a rank whose process exited."""

    def __init__(self, rank: int, exitcode):
        self.rank, self.exitcode = rank, exitcode

    def __repr__(self):
        return f"WorkerDied(rank={self.rank}, exitcode={self.exitcode})"


class PoolError(AssertionError):
    pass


def _worker_main(rank, world_size, init_file, tasks, results, shared_gpu=False):
    import torch
    import torch.distributed as dist

    if shared_gpu:
        # every rank on cuda:0 (where there is one): NCCL refuses ranks sharing a GPU, so
        # gloo; torch symmetric memory accepts them with this opt-in
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        backend = "gloo"
    else:
        # with a GPU, one group serves both: gloo for CPU tensors, NCCL for CUDA tensors
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            payload = pickle.dumps(fn(*args, **kwargs))
            results.put((rank, True, payload, _group_count()))
        except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
            results.put((rank, False, traceback.format_exc(), _group_count()))
    dist.destroy_process_group()


def _group_count() -> int:
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map)  # torch lists its groups only privately


class WorkerPool:
    """W spawned ranks in one gloo world (``shared_gpu``: all on cuda:0, see ``_worker_main``)."""

    def __init__(self, world_size: int, rendezvous_dir, shared_gpu: bool = False):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        init_file = os.path.join(str(rendezvous_dir), f"init_{world_size}_{time.time_ns()}")
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_worker_main, daemon=True,
                        args=(r, world_size, init_file, self.tasks[r], self.results, shared_gpu))
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn, *args, timeout: float = 240, tolerate_death: bool = False, **kwargs):
        if self.broken:
            raise PoolError("pool is broken")
        for q in self.tasks:
            q.put((fn, args, kwargs))
        results: dict[int, object] = {}
        failures: list[str] = []
        groups = 0
        deadline = time.monotonic() + timeout
        try:
            while len(results) < self.world_size:
                try:
                    rank, ok, payload, count = self.results.get(timeout=0.2)
                except queue.Empty:
                    dead = [r for r, p in enumerate(self.procs)
                            if p.exitcode is not None and r not in results]
                    for r in dead:
                        results[r] = WorkerDied(r, self.procs[r].exitcode)
                        if not tolerate_death:
                            failures.append(f"rank {r} died with exit code {self.procs[r].exitcode}")
                    if time.monotonic() > deadline:
                        missing = [r for r in range(self.world_size) if r not in results]
                        failures.append(f"ranks {missing} did not finish within {timeout} s")
                        break
                    continue
                groups = max(groups, count)
                if ok:
                    results[rank] = pickle.loads(payload)
                else:
                    results[rank] = None
                    failures.append(f"rank {rank} raised:\n{payload}")
                    # the others may wait in a collective the raising rank never joins:
                    # the task has failed anyway, so wait only for their own errors
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        except BaseException:  # a test's timeout (pytest-timeout's signal) or an interrupt: the
            self.close(wait_s=0)  # ranks still run this task, whose results the next would get
            raise
        if failures or any(isinstance(v, WorkerDied) for v in results.values()) \
                or groups > MAX_GROUPS:
            # ranks still in the task will not take the stop request: kill them at once
            self.close(wait_s=0 if len(results) < self.world_size else 5)
        if failures:
            raise PoolError(f"{fn.__qualname__} failed on a {self.world_size}-rank pool:\n"
                            + "\n".join(failures))
        return [results[r] for r in range(self.world_size)]

    def close(self, wait_s: float = 5):
        """Stop the ranks: each gets ``wait_s`` to exit after its task, then is killed."""
        self.broken = True
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=wait_s)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


class PoolRegistry:
    def __init__(self, rendezvous_dir, shared_gpu: bool = False):
        self.rendezvous_dir = rendezvous_dir
        self.shared_gpu = shared_gpu
        self.pools: dict[int, WorkerPool] = {}

    def __call__(self, world_size: int) -> WorkerPool:
        pool = self.pools.get(world_size)
        if pool is None or pool.broken:
            pool = self.pools[world_size] = WorkerPool(world_size, self.rendezvous_dir,
                                                       self.shared_gpu)
        return pool

    def close(self):
        for pool in self.pools.values():
            pool.close()
