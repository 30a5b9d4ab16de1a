"""Session-wide test settings and shared fixtures."""

import pytest
import torch
import torch.distributed as dist

# The distributed tests fork their ranks from this process (lightning_par.launcher, start method "fork"). GNU OpenMP is
# not fork-safe: a child that enters a parallel region after this process ran one on several threads waits forever
# for the worker threads it did not inherit (seen in the full suite: a forked rank idle in libgomp inside CPU flash
# attention). With one intra-op thread here this process never starts an OpenMP thread pool; the ranks set their own
# thread count (threads_per_rank).
torch.set_num_threads(1)


@pytest.fixture
def no_process_group_left_behind():
    """Destroy the default process group a test started in this process (a ``Trainer`` at world 1 leaves it
    initialised), so later tests can check that nothing starts one before its time."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
