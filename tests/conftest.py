"""Session-wide test settings and shared fixtures."""

import gc
import os

import pytest
import torch
import torch.distributed as dist

# The distributed tests fork their ranks from this process (lightning_par.launcher, start method "fork"). GNU OpenMP is
# not fork-safe: a child that enters a parallel region after this process ran one on several threads waits forever
# for the worker threads it did not inherit (seen in the full suite: a forked rank idle in libgomp inside CPU flash
# attention). With one intra-op thread here this process never starts an OpenMP thread pool; the ranks set their own
# thread count (threads_per_rank).
torch.set_num_threads(1)
# Lightning's launchers raise the thread count of the process they run in (``_set_num_threads_if_needed``: cpu count
# over processes, unless OMP_NUM_THREADS is set): after an in-process Trainer run, this process would run OpenMP
# regions on 2 threads, and a world forked after that hangs in libgomp (seen in the full suite: a rank idle in
# libgomp inside Adam's sqrt, forked by an in-process recipe run). The ranks' own counts are set by the launcher.
os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """Destroy the default process group a test started in this process (a ``Trainer`` or ``Fabric`` at world 1 leaves
    it initialised), after every test: later tests check that nothing starts one before its time, and a world forked
    from a process holding a gloo group fails (measured: one in-process float8 Trainer run left its group, and every
    forked world after it in the suite errored or timed out). Also restores the environment: an in-process run sets
    MASTER_PORT (Lightning picks a free port and writes it to os.environ), and every later subprocess launch of the
    suite then inherited a port this process still held (EADDRINUSE in the registry and README example tests)."""
    environ = dict(os.environ)
    yield
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    if torch.get_num_threads() != 1:  # a test raised it: back to one before anything here runs multi-threaded
        torch.set_num_threads(1)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        # and free the group's objects here, where its threads are: a world forked while they wait in this process's
        # garbage inherits them (the launcher's ranks freeze what they inherit, see lightning_par.launcher._child)
        gc.collect()


@pytest.fixture(autouse=True)
def cuda_device(request) -> torch.device | None:
    """The tests marked ``gpu`` (a CUDA path): skipped without a CUDA device, except under ``LP_REQUIRE_CUDA=1``
    (``scripts/gpu_check.sh``), where a missing device fails them instead, so the GPU check cannot pass by skipping.
    Their CUDA device; None for the other tests."""
    if request.node.get_closest_marker("gpu") is None:
        return None
    if not torch.cuda.is_available():
        if os.environ.get("LP_REQUIRE_CUDA") == "1":
            pytest.fail("LP_REQUIRE_CUDA=1 but torch.cuda.is_available() is False: no CUDA device to test on.")
        pytest.skip("needs a CUDA device (run scripts/gpu_check.sh on a GPU machine)")
    return torch.device("cuda", 0)
