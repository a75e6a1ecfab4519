"""Fixtures: one real ipyparallel pool of 2 engines, shared, always torn down."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from sagenb.pool import cluster

from .reference import POOL_THREADS

# The one-process references computed in this process use the engines' torch threads
# (tests/reference.py says why; check_equal also follows a run's own count).
torch.set_num_threads(POOL_THREADS)

# The interrupt tests press the notebook's interrupt button: SIGINT to this process, which a
# Jupyter kernel (and an interactive Python) turns into KeyboardInterrupt. A Python started in
# the background by a non-interactive shell (`cmd &` in a script, some CI runners) inherits
# SIGINT ignored (POSIX, for background jobs without job control), so those tests would wait
# for an interrupt that never comes: give this process the handler a kernel has.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REGRESSION_CELL = """
import torch
from torch import nn
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
X = torch.randn(192, 8)
Y = X @ torch.randn(8, 1) + 0.1 * torch.randn(192, 1)
dataset = torch.utils.data.TensorDataset(X, Y)
loss_fn = nn.functional.mse_loss
"""

# `%load_ext sagenb` starts a pool in the background: off for the suite, whose tests share the
# pool below (a second pool would take the cores it needs); tests/test_prewarm.py turns it on.
os.environ["SAGENB_PREWARM"] = "0"

SGD_MOMENTUM = """
def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)
"""


@pytest.fixture(scope="session")
def _stop_pool_at_end():
    yield
    cluster.stop_pool()


@pytest.fixture
def pool(_stop_pool_at_end) -> cluster.EnginePool:
    """The shared pool of 2 engines (started again if a test stopped or resized it)."""
    current = cluster.current_pool()
    if current is not None:
        current.heal()  # engines a failed test lost are replaced when the pool is next used
    if current is None or current.size != 2:
        current = cluster.start_pool(2)
    return current


@pytest.fixture
def pool4(_stop_pool_at_end) -> cluster.EnginePool:
    """A pool of 4 engines (hybrid and tensor x data parallel), started when needed."""
    current = cluster.current_pool()
    if current is not None:
        current.heal()
    return current if current is not None and current.size == 4 else cluster.start_pool(4)


# Modules whose tests start pools or kernels of their own (and stop the shared pool first).
OWN_POOLS = (
    "test_multi_host",
    "test_notebooks",
    "test_browser",
    "test_pool_lifetime",
    "test_binder",
    "test_busy_pool",
)


# Fixtures that start (or stop, at the session's end) engine pools; a test using any of them,
# directly or through another fixture (tests/test_prewarm.py's load_ext, test_multi_host's
# mpi_pool...), needs engines.
POOL_FIXTURES = {"pool", "pool4", "_stop_pool_at_end"}


def needs_pool(item) -> bool:
    """Whether `item` starts engines or kernels: through a pool fixture, by living in a module
    of OWN_POOLS, or by its own `@pytest.mark.pool` (a test that starts a pool in a subprocess
    or through `%smp_cluster`, which no fixture shows)."""
    if POOL_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    return item.module.__name__.rsplit(".", 1)[-1] in OWN_POOLS or bool(
        list(item.iter_markers("pool"))
    )


def pytest_collection_modifyitems(items):
    """Mark every test that needs engines `pool` (`-m "not pool"`: the fast lane, seconds), and
    run the tests on the shared 2-engine pool first, then those on 4 engines, then those with
    pools of their own: each switch restarts engines (8-16 s), so group, don't alternate."""
    for item in items:
        if needs_pool(item) and not list(item.iter_markers("pool")):
            item.add_marker(pytest.mark.pool)

    def group(item) -> int:
        if "pool4" in getattr(item, "fixturenames", ()):
            return 1
        return 2 if item.module.__name__.rsplit(".", 1)[-1] in OWN_POOLS else 0

    items.sort(key=group)  # stable: file order within a group


@pytest.fixture(autouse=True)
def _unmarked_tests_start_no_pool(request):
    """A test not marked `pool` must start no pool (stopping one is allowed: bad input
    checks do): one that starts engines unmarked would make the fast lane slow. Mark it."""
    if request.node.get_closest_marker("pool") is not None:
        yield
        return
    before = cluster.current_pool()
    yield
    after = cluster.current_pool()
    if (after is not None and after is not before) or cluster.starting() is not None:
        pytest.fail(
            f"{request.node.nodeid} started an engine pool but is not marked pool: use the "
            "`pool` fixture or decorate it with @pytest.mark.pool (tests/conftest.py)",
            pytrace=False,
        )


@pytest.fixture(scope="module")
def shell():
    """An IPython shell with sagenb's magics loaded (SAGENB_PREWARM=0 here: no pool starts)."""
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "sagenb")
    return ip
