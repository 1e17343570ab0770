"""A real single-node Slurm cluster for tests: munged, slurmctld and slurmd on localhost, with every
file (key, sockets, state, logs, config) under one temporary directory. Needs Debian's slurm-wlm
and munge (tests/helpers/setup_slurm.sh installs them) and root (slurmd starts job steps as their user)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, Optional

from tests.conftest import _free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol")


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.path.exists(p)), None)


def unavailable_reason() -> Optional[str]:
    """Why a cluster cannot start here, or None."""
    missing = [d for d in DAEMONS if _which(d) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not found); tests/helpers/setup_slurm.sh installs "
                "Debian's slurm-wlm and munge, which needs root and apt-get")
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd runs job steps as the submitting user)"
    return None


class LocalSlurm:
    def __init__(self, root: Path):
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        self.env: Dict[str, str] = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))

    def start(self, timeout: float = 60) -> "LocalSlurm":
        r = self.root
        for d in ("state", "spool", "log", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "munge" / "munge.key").write_bytes(os.urandom(1024))
        os.chmod(r / "munge" / "munge.key", 0o600)
        socket_path = r / "munge" / "munge.socket"
        subprocess.run([_which("munged"), "--force", f"--key-file={r}/munge/munge.key", f"--socket={socket_path}",
                        f"--pid-file={r}/munge/munged.pid", f"--log-file={r}/log/munged.log",
                        f"--seed-file={r}/munge/seed"], check=True)
        cpus = os.cpu_count() or 1
        (r / "slurm.conf").write_text(f"""\
ClusterName=megatron-rlhf-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")
        conf = str(r / "slurm.conf")
        subprocess.run([_which("slurmctld"), "-f", conf], check=True, env=self.env)
        subprocess.run([_which("slurmd"), "-f", conf, "-N", self.node], check=True, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = subprocess.run([_which("sinfo"), "-h", "-o", "%t"], capture_output=True, text=True, env=self.env)
            if state.stdout.strip() == "idle":
                return self
            time.sleep(0.5)
        raise RuntimeError(f"the local Slurm node did not become idle in {timeout:.0f}s:\n{self.logs()}")

    def wait_for_job(self, job_id: str, timeout: float) -> tuple:
        """(JobState, ExitCode) of ``job_id`` once it has ended, polled every half second."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            shown = subprocess.run([_which("scontrol"), "show", "job", "-o", job_id], capture_output=True, text=True,
                                   env=self.env).stdout
            fields = dict(f.split("=", 1) for f in shown.split() if "=" in f)
            if fields.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return fields["JobState"], fields.get("ExitCode")
            time.sleep(0.5)
        raise RuntimeError(f"job {job_id} did not end in {timeout:.0f}s:\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / "log" / name
            if path.exists():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-30:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """scontrol shutdown stops slurmctld and slurmd; munged gets SIGTERM; any left, SIGKILL."""
        subprocess.run([_which("scontrol"), "shutdown"], env=self.env, capture_output=True)
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
            try:
                pid = int((self.root / pid_file).read_text().strip())
            except (OSError, ValueError):
                continue
            if pid_file.startswith("munge"):
                _signal(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while _signal(pid, 0) and time.monotonic() < deadline:
                time.sleep(0.2)
            _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> bool:
    """Send ``sig``; whether the process was there."""
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
