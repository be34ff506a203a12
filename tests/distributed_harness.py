"""Run a function on every rank of a real gloo process group on the CPU, and collect what each returns.

Processes start with the ``forkserver`` method (a clean process that imported torch and ropekit
once, forked per rank: no OpenMP state inherited from the test process, no import per rank) and
meet through a ``file://`` store under the test's own directory (no port to race for). Each rank
writes its result, or its traceback, with ``torch.save`` (a multiprocessing queue carrying tensors
breaks when a rank exits before the parent reads). Collectives time out after 60 s and the whole
launch after ``timeout``; then every rank's problem is reported, not only the first.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed.tensor", "ropekit", "ropekit.distributed", "ropekit.nn", "distributed_ranks"]


def _entry(rank: int, world: int, rendezvous: str, out_dir: str, fn: Callable[[int, int], object]) -> None:
    """One rank: join the group, run ``fn(rank, world)``, save its result or the traceback."""
    torch.set_num_threads(1)  # up to 4 ranks share 2 cores
    try:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        outcome = {"ok": fn(rank, world)}
    except BaseException:
        outcome = {"error": traceback.format_exc()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()  # peers blocked in a collective fail at once instead of timing out
    torch.save(outcome, os.path.join(out_dir, f"rank{rank}.pt"))


def run_ranks(fn: Callable[[int, int], object], world: int, work_dir: Path, *, timeout: float = 240.0) -> list:
    """``[fn(0, world), ..., fn(world - 1, world)]``, each run in its own process of one gloo group.

    ``fn`` must be importable by reference (a module-level function). Fails the test with every
    rank's traceback, exit code or hang.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # ignored once the server runs (one server per test process)
    procs = [context.Process(target=_entry, args=(r, world, str(work_dir / "rendezvous"), str(work_dir), fn))
             for r in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, proc in enumerate(procs) if proc.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    results, problems = [], []
    for r, proc in enumerate(procs):
        path = work_dir / f"rank{r}.pt"
        if not path.exists():
            killed = ", killed after the timeout" if r in hung else ""
            problems.append(f"rank {r} wrote no result (exit code {proc.exitcode}{killed})")
            continue
        outcome = torch.load(path, weights_only=False)
        if "error" in outcome:
            problems.append(f"rank {r} raised:\n{outcome['error']}")
        else:
            results.append(outcome["ok"])
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
    return results
