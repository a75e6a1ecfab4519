"""The files of pools whose controller is gone, removed when a pool starts.

ipyparallel writes each cluster's record (`security/cluster-<id>.json`), its connection files
(`security/ipcontroller-<id>-client.json`, `-engine.json`) and its logs (`log/ipcontroller-<id>-*`,
`log/ipengine-<id>-*`,
`log/engines<id>.json`) in the profile directory, and removes them when the cluster is stopped.
A pool ended any other way (its kernel killed, the watcher ending it, reaper.py) leaves them, and
they piled up: dozens of `cluster-*.json` after a day of tests. ipyparallel's own
`clean_cluster_files` removes every log and connection file of the profile, running clusters'
included; this removes only those of clusters whose controller process no longer runs.
"""

from __future__ import annotations

import glob
import json
import os

import psutil

__all__ = ["remove_stale"]


def remove_stale(profile_dir: str) -> list[str]:
    """Remove the files of every cluster of `profile_dir` whose controller has exited; the
    cluster ids removed."""
    removed = []
    for record in glob.glob(os.path.join(profile_dir, "security", "cluster-*.json")):
        cluster_id = os.path.basename(record)[len("cluster-") : -len(".json")]
        pid = _controller_pid(record)
        if pid is None or psutil.pid_exists(pid):
            continue  # running (or a file being written): not ours to judge
        for path in _files_of(profile_dir, cluster_id) + [record]:
            try:
                os.remove(path)
            except OSError:
                pass
        removed.append(cluster_id)
    return removed


def _controller_pid(record: str) -> int | None:
    try:
        with open(record) as f:
            pid = json.load(f)["controller"]["state"]["pid"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if isinstance(pid, int) else None


def _files_of(profile_dir: str, cluster_id: str) -> list[str]:
    patterns = [
        ("security", f"ipcontroller-{cluster_id}-*.json"),
        ("log", f"ipcontroller-{cluster_id}-*.log"),
        ("log", f"ipengine-{cluster_id}-*.log"),
        ("log", f"engines{cluster_id}.json"),
    ]
    return [
        p for folder, name in patterns for p in glob.glob(os.path.join(profile_dir, folder, name))
    ]
