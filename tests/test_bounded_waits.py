"""No wait on the pool without a bound (sagenb/pool/waits.py).

ipyparallel's `AsyncResult.get()`, `wait()`, `apply_sync` and a future's `result()` wait for
ever by default, and a dead controller never answers them: a run once hung so on the restore of
its engines. This lists every such call in sagenb/ and fails on one that has no timeout, unless
it is in ALLOWED with the reason it is bounded all the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

SAGENB = Path(__file__).resolve().parent.parent / "sagenb"
#: methods that wait until something answers: unbounded without an argument or a timeout
WAITS = {"get", "wait", "result", "join"}
#: ipyparallel calls that wait on the controller or the engines, whatever their arguments
#: (the cluster's `*_sync` twins of its coroutines, and a view's blocking apply)
IPYPARALLEL_SYNC = ("apply_sync", "_cluster_sync", "_engines_sync", "_client_sync")

#: (module, call as written) -> why it cannot wait for ever
ALLOWED = {
    # engine side: waits on peers, each bounded by the process group's --collective-timeout
    ("engine/loop.py", "self._work.wait()"): "the targets' count all-reduce (process group)",
    ("engine/strategies/pipeline/prefetch_schedule.py", "work.wait()"): "a gloo send/recv",
    ("engine/strategies/pipeline/prefetch_schedule.py", "done.result()"): (
        "the sending thread posts a step's sends at once; each then waits in work.wait()"
    ),
    ("engine/strategies/pipeline/prefetch_schedule.py", "handed.get()"): (
        "the sending thread's idle wait for work, in a daemon thread: not a wait on a peer"
    ),
    ("engine/wire/traffic.py", "group.allreduce([buffer]).wait()"): "a gloo all-reduce",
    ("engine/wire/traffic.py", "group.barrier().wait()"): "a gloo barrier",
    # notebook side
    ("pool/startup.py", "cluster.start_cluster_sync()"): (
        "launches processes; ipyparallel waits for the controller's connection files within "
        "its connection_info_timeout"
    ),
    ("pool/startup.py", "cluster.connect_client_sync()"): "connection_info_timeout, as above",
    ("pool/startup.py", "cluster.start_engines_sync(n=missing)"): (
        "launches engines and returns; their registration is awaited by waits.until"
    ),
    ("pool/cluster.py", "start.thread.join()"): (
        "the background start, every wait of which is bounded (registration, warm-up)"
    ),
    ("pool/cluster.py", "start.result()"): "BackgroundStart.result: a value, no wait",
    ("pool/reaper.py", "watcher.wait()"): (
        "a daemon thread that replaces the watcher process when it dies: waits by design"
    ),
    ("pool/reaper.py", "hosts.join()"): "remote.end_remote bounds each ssh command (30 s)",
}


def _unbounded(call: ast.Call) -> bool:
    if not isinstance(call.func, ast.Attribute):
        return False
    name = call.func.attr
    if name.endswith(IPYPARALLEL_SYNC):
        return True
    timeout = next((k.value for k in call.keywords if k.arg == "timeout"), None)
    if name == "wait_for_engines":
        return timeout is None
    if name not in WAITS or call.args:
        return False
    return timeout is None or (isinstance(timeout, ast.Constant) and timeout.value is None)


def unbounded_waits(source: str) -> list[str]:
    """The calls in `source` that may wait for ever, as written."""
    return sorted(
        {
            ast.unparse(node)
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and _unbounded(node)
        }
    )


def test_the_checker_tells_a_bounded_wait_from_an_unbounded_one():
    planted = (
        "ar.get()\nar.get(timeout=None)\nar.wait()\nview.apply_sync(f)\n"
        "c.stop_cluster_sync()\nclient.wait_for_engines(2)\nfuture.result()\n"
        "ar.get(timeout=5)\nar.get(5)\nar.wait(0.1)\nd.get('key')\n"
        "client.wait_for_engines(2, timeout=9)\nfuture.result(timeout=0)\nt.join(3)\n"
    )
    assert unbounded_waits(planted) == sorted(
        [
            "ar.get()",
            "ar.get(timeout=None)",
            "ar.wait()",
            "view.apply_sync(f)",
            "c.stop_cluster_sync()",
            "client.wait_for_engines(2)",
            "future.result()",
        ]
    )


def test_every_wait_in_sagenb_has_a_bound():
    found = {
        (str(path.relative_to(SAGENB)), call)
        for path in SAGENB.rglob("*.py")
        for call in unbounded_waits(path.read_text())
    }
    assert sorted(found - set(ALLOWED)) == []  # give it a timeout (pool.result, waits.until)
    assert sorted(set(ALLOWED) - found) == []  # an allowance no call needs any more
