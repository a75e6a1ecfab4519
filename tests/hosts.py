"""Hosts made on this machine for the multi-host tests: network namespaces on a bridge, each
with an address of its own (TwoHosts), running an sshd each (SshHosts), or a slurmd each under
one slurmctld (SlurmNodes). Each namespace host that starts daemons gets a host name of its
own too (a UTS namespace), as real hosts have. Creating them needs root and `ip netns`; each
class's `missing()` says why they cannot be made here, for the tests to skip with."""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import psutil


class TwoHosts:
    """A bridge with this machine's side at .1 and two network namespaces at .2 and .3."""

    made = itertools.count()  # names of their own: a deleted namespace's links go lazily

    def __init__(self) -> None:
        tag = (os.getpid() + 7 * next(TwoHosts.made)) % 100_000
        self.subnet = f"10.{77 + tag % 100}.{tag % 250}"
        self.bridge = f"smpbr{tag}"
        self.namespaces = [f"smp{tag}-h{i}" for i in (1, 2)]
        self.veths = [f"smpv{tag}{i}" for i in (1, 2)]

    @property
    def address(self) -> str:
        return f"{self.subnet}.1"

    @property
    def addresses(self) -> list[str]:
        """The namespace hosts' addresses."""
        return [f"{self.subnet}.{i}" for i in (2, 3)]

    def create(self) -> None:
        run = ip
        run("link", "add", self.bridge, "type", "bridge")
        run("addr", "add", f"{self.address}/24", "dev", self.bridge)
        run("link", "set", self.bridge, "up")
        for i, (ns, veth) in enumerate(zip(self.namespaces, self.veths), start=2):
            run("netns", "add", ns)
            run("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            run("link", "set", veth, "master", self.bridge, "up")
            run("-n", ns, "addr", "add", f"{self.subnet}.{i}/24", "dev", "eth0")
            run("-n", ns, "link", "set", "eth0", "up")
            run("-n", ns, "link", "set", "lo", "up")

    def remove(self) -> None:
        for ns in self.namespaces:
            ip("netns", "delete", ns, check=False)
        ip("link", "delete", self.bridge, check=False)


def ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, timeout=30)


def namespaces_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "no iproute2 `ip` command"
    probe = f"smpprobe{os.getpid() % 100_000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


SSHD = "/usr/sbin/sshd"
SFTP_SERVER = "/usr/lib/openssh/sftp-server"  # scp speaks SFTP since OpenSSH 9


def ssh_missing() -> str | None:
    for path in (SSHD, SFTP_SERVER):
        if not os.path.exists(path):
            return f"no {path} (Debian: openssh-server; scripts/test.sh installs it as root)"
    if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        return "no ssh client (Debian: openssh-client)"
    return namespaces_unavailable()


class SshHosts(TwoHosts):
    """TwoHosts, each running its own sshd on its address, accepting a key made here, under a
    host name of its own (a UTS namespace: what the engines it starts report as their host)."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.names = [f"sagenb-host{i}" for i in (1, 2)]
        self.folder = folder
        self.daemons: list[subprocess.Popen] = []
        self.key = folder / "id_ed25519"
        self.remote_profile = folder / "remote-profile"
        self.ssh_args = [
            "-i", str(self.key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
        ]  # fmt: skip

    def create(self) -> None:
        super().create()
        for ns in self.namespaces:  # the engines reach the controller on this machine's side
            ip("-n", ns, "route", "add", "default", "via", self.address)
        keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", ""]
        subprocess.run([*keygen, "-f", str(self.key)], check=True)
        subprocess.run([*keygen, "-f", str(self.folder / "host_key")], check=True)
        (self.folder / "authorized_keys").write_text((self.folder / "id_ed25519.pub").read_text())
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation
        for ns, addr, name in zip(self.namespaces, self.addresses, self.names):
            config = self.folder / f"sshd-{addr}"
            config.write_text(
                f"ListenAddress {addr}\nHostKey {self.folder / 'host_key'}\n"
                f"AuthorizedKeysFile {self.folder / 'authorized_keys'}\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\nUsePAM no\n"
                f"StrictModes no\nSubsystem sftp {SFTP_SERVER}\n"
                f"PidFile {self.folder / f'sshd-{addr}.pid'}\n"
            )
            self.daemons.append(
                subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "unshare",
                        "--uts",
                        "sh",
                        "-c",
                        f'hostname {name} && exec {SSHD} -D -e -f "$0"',
                        str(config),
                    ],
                    stderr=subprocess.DEVNULL,
                )  # fmt: skip
            )
        for addr in self.addresses:  # each sshd answers before the pool starts
            deadline = time.monotonic() + 30
            while subprocess.run(
                ["ssh", *self.ssh_args, addr, "true"], capture_output=True, timeout=30
            ).returncode:
                assert time.monotonic() < deadline, f"sshd on {addr} did not answer"
                time.sleep(0.3)

    def remove(self) -> None:
        for daemon in self.daemons:
            daemon.kill()
            daemon.wait(timeout=30)
        super().remove()

    def engines(self) -> list[psutil.Process]:
        """The processes sshd started for the pool (engines and their nannies): they carry the
        remote profile in their environment."""
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.environ().get("IPP_PROFILE_DIR") == str(self.remote_profile):
                    found.append(proc)
            except psutil.Error:
                pass
        return found


# -- Slurm -----------------------------------------------------------------------------------
SLURM_DAEMONS = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged")


def slurm_missing() -> str | None:
    for path in SLURM_DAEMONS:
        if not os.path.exists(path):
            return f"no {path} (Debian: slurmctld, slurmd, munge; scripts/test.sh installs them)"
    if shutil.which("sbatch") is None:
        return "no sbatch (Debian: slurm-client)"
    return namespaces_unavailable()


class SlurmNodes(TwoHosts):
    """A Slurm cluster of two nodes: slurmctld on this machine's side of the bridge, a slurmd
    in each namespace (node1, node2; 2 CPUs each), munge for authentication, and a config
    written here that nothing else reads (SLURM_CONF points the commands at it)."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder
        self.daemons: list[subprocess.Popen] = []
        self.names = ["node1", "node2"]
        self.conf = folder / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def create(self) -> None:
        super().create()
        d = self.folder
        key = d / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        socket_path = d / "munge.socket"
        self._start(
            ["munged", "-F", "--force", f"--key-file={key}", f"--socket={socket_path}",
             f"--pid-file={d / 'munged.pid'}", f"--seed-file={d / 'munge.seed'}",
             f"--log-file={d / 'munged.log'}"],
        )  # fmt: skip
        (d / "state").mkdir()
        nodes = "\n".join(
            f"NodeName={name} NodeAddr={self.subnet}.{i} CPUs=2 State=UNKNOWN"
            for i, name in enumerate(self.names, start=2)
        )
        self.conf.write_text(
            f"ClusterName=sagenb\nSlurmctldHost={socket.gethostname()}({self.address})\n"
            f"SlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\nCredType=cred/munge\n"
            f"AuthInfo=socket={socket_path}\nStateSaveLocation={d / 'state'}\n"
            f"SlurmdSpoolDir={d}/spool-%n\nSlurmctldPidFile={d / 'slurmctld.pid'}\n"
            f"SlurmdPidFile={d}/slurmd-%n.pid\nSlurmctldLogFile={d / 'slurmctld.log'}\n"
            f"SlurmdLogFile={d}/slurmd-%n.log\nProctrackType=proctrack/linuxproc\n"
            "TaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n"
            "AccountingStorageType=accounting_storage/none\nJobCompType=jobcomp/none\n"
            "SchedulerType=sched/backfill\nSelectType=select/cons_tres\n"
            "SelectTypeParameters=CR_Core\nReturnToService=2\nMpiDefault=none\n"
            f"{nodes}\nPartitionName=debug Nodes={','.join(self.names)} Default=YES "
            "MaxTime=INFINITE State=UP\n"
        )
        # slurmd loads its cgroup plugin even with proctrack/linuxproc; this machine mounts
        # cgroup v1 controllers under a tmpfs that autodetection does not recognise
        (d / "cgroup.conf").write_text(
            "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nIgnoreSystemd=yes\n"
        )
        self._start(["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for ns, name in zip(self.namespaces, self.names):
            self._start(
                ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                 f'hostname {name} && exec slurmd -D -N {name} -f "$0"', str(self.conf)],
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while self.idle_nodes() < len(self.names):
            assert time.monotonic() < deadline, f"slurm nodes not up: {self.run('sinfo')}"
            time.sleep(0.5)

    def _start(self, argv: list[str]) -> None:
        env = {**os.environ, **self.env}
        self.daemons.append(
            subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )

    def run(self, *argv: str) -> str:
        done = subprocess.run(
            argv, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=30
        )
        return done.stdout + done.stderr

    def idle_nodes(self) -> int:
        return self.run("sinfo", "-h", "-N", "-o", "%T").split().count("idle")

    def jobs(self) -> list[str]:
        """squeue's lines: every job still known, completing ones included."""
        return self.run("squeue", "-h", "-o", "%i %j %T").splitlines()

    def remove(self) -> None:
        subprocess.run(["scancel", "--full", "-u", "root"], env={**os.environ, **self.env},
                       capture_output=True, timeout=30)  # fmt: skip
        for daemon in reversed(self.daemons):
            daemon.kill()
            daemon.wait(timeout=30)
        super().remove()
