"""The kernel's walls around a sandboxed call (agents/sandbox, ``rollout.sandbox.kind: isolated``).

bubblewrap (Debian's and Ubuntu's ``bubblewrap``, Flatpak's sandbox) makes the namespaces: mount
(a read-only root holding only the interpreter, its libraries and the system's shared libraries;
no run directory, no /tmp, no home, no host socket), PID (the code sees only itself; everything
dies with the call), network (a loopback that is down), IPC, UTS and cgroup; its own process
dies with the worker that started it. The first code inside (boot.py) then mounts the
code's working directory, a tmpfs bounded in bytes and inodes (bubblewrap cannot bound inodes),
gives up every capability (and, where the trainer runs as root, becomes ``nobody``), sets no new
privileges and loads the seccomp filter made here (libseccomp through ``pyseccomp``): no new
process or program, no namespace, mount, ptrace, BPF, keyring, io_uring or kernel-module call.

As root bubblewrap needs CAP_SYS_ADMIN (a container run with it, or ``--privileged``); as
another user it needs unprivileged user namespaces (refused by Docker's default seccomp profile
and by Ubuntu 24.04's AppArmor rule unless bwrap has a profile). ``isolation_problem`` says which
is missing before a run starts.
"""

from __future__ import annotations

import errno
import functools
import itertools
import os
import shutil
import sys
import sysconfig
from typing import List, Optional

WORKDIR = "/sandbox"  # the code's directory inside (a tmpfs mounted by the boot)
BOOT_INSIDE = "/sandbox_boot.py"
BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot.py")
# Capabilities the boot needs for its own set-up and drops before the code runs.
SETUP_CAPABILITIES = ("CAP_SYS_ADMIN", "CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP")
CLONE_THREAD = 0x00010000
# Refused with EPERM after set-up: a new process or program, namespaces and mounts, other
# processes' memory, and the kernel interfaces a sandbox has no use for.
DENIED_SYSCALLS = (
    "fork", "vfork", "execve", "execveat",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "mount_setattr", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "open_by_handle_at", "name_to_handle_at", "iopl", "ioperm", "personality",
    "syslog", "setdomainname", "sethostname", "settimeofday", "clock_settime", "adjtimex", "mknod", "mknodat",
    # Memory outside its address space (RLIMIT_AS counts none of it): anonymous files, SysV shared
    # memory, message queues and semaphores, POSIX message queues.
    "memfd_create", "memfd_secret", "shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl",
    "semget", "semop", "semtimedop", "semctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive",
    "mq_notify", "mq_getsetattr",
)
# The socket families the network namespace walls in (AF_UNIX, AF_INET, AF_INET6); any other
# (AF_VSOCK's port space is the VM's, netlink reaches kernel subsystems, packet sockets, ...)
# answers EAFNOSUPPORT, as on a kernel without it.
SOCKET_FAMILIES = (1, 2, 10)
SANDBOX_UID_BASE = 1 << 30  # as root: each call's own user, so RLIMIT_NPROC counts its threads alone
_calls = itertools.count()
# The interpreter's environment inside: one BLAS thread, and at most two malloc arenas (each thread's
# own arena would reserve 64 MB of address space, so a few threads would reach memory_mb).
INSIDE_ENVIRONMENT = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                      "MALLOC_ARENA_MAX": "2"}


def call_uid() -> int:
    """The user a call's code runs as where the trainer is root: a user of its own (owning no host
    file; this process's calls in flight apart by a counter, other processes' by their pid)."""
    return SANDBOX_UID_BASE + (os.getpid() % (1 << 16)) * 256 + next(_calls) % 256


def bwrap_path() -> Optional[str]:
    return shutil.which("bwrap")


def library_paths() -> List[str]:
    """The directories the code may import from: the standard library (with its extension
    modules) and the interpreter's installed packages (editable installs elsewhere are not here)."""
    paths = sysconfig.get_paths()
    found = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)]
    found += [p for p in sys.path if p.endswith("lib-dynload")]
    return sorted({os.path.realpath(p) for p in found if os.path.isdir(p)})


def interpreter() -> str:
    return os.path.realpath(sys.executable)


def _read_only_paths() -> List[str]:
    """What the sandbox shows of the host, read-only: the system's shared libraries, the
    interpreter's installation and its libraries; nested paths once (their parent shows them)."""
    wanted = ["/usr/lib", "/usr/lib64", "/usr/lib32", "/etc/ld.so.cache", os.path.realpath(sys.base_prefix),
              os.path.dirname(interpreter()), *library_paths()]
    shown: List[str] = []
    for path in sorted({p for p in wanted if os.path.exists(p)}, key=len):
        if not any(path == s or path.startswith(s.rstrip("/") + "/") for s in shown):
            shown.append(path)
    return shown


def _ancestors(path: str) -> List[str]:
    """``path`` and each directory above it, but the root."""
    found = []
    while path not in ("/", ""):
        found.append(path)
        path = os.path.dirname(path)
    return found


def bwrap_command(settings_json: str) -> List[str]:
    """The command line of one isolated call: bubblewrap, then the interpreter on the boot."""
    command = [bwrap_path() or "bwrap", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
               "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv"]
    for name, value in INSIDE_ENVIRONMENT.items():
        command += ["--setenv", name, value]
    if os.geteuid() != 0:  # an unprivileged trainer: a user namespace, root inside it until the boot drops
        command += ["--unshare-user", "--uid", "0", "--gid", "0"]
    for link in ("/lib", "/lib64", "/lib32"):  # merged /usr: links into /usr/lib*; else directories of their own
        if os.path.islink(link):
            command += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            command += ["--ro-bind", link, link]
    shown = _read_only_paths()
    for parent in sorted({os.path.dirname(p) for path in shown for p in _ancestors(path)} - {"/"}):
        command += ["--perms", "0755", "--dir", parent]  # not the host's modes: /root is 0700 to nobody
    for path in shown:
        command += ["--ro-bind", path, path]
    command += ["--proc", "/proc", "--dev", "/dev", "--dir", WORKDIR, "--ro-bind", BOOT, BOOT_INSIDE,
                "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/"]
    for capability in SETUP_CAPABILITIES:
        command += ["--cap-add", capability]
    return command + ["--", interpreter(), "-I", "-S", "-B", BOOT_INSIDE, settings_json]


@functools.lru_cache(maxsize=None)
def seccomp_program() -> bytes:
    """The seccomp filter (BPF) the boot loads before the code runs: every call allowed but
    DENIED_SYSCALLS (EPERM), a clone that is not a thread's, and a socket outside SOCKET_FAMILIES
    (EAFNOSUPPORT); clone3 answers ENOSYS so that the C library starts threads through clone,
    whose flags the filter can read."""
    import tempfile

    import pyseccomp as seccomp

    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in DENIED_SYSCALLS:
        try:
            rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
        except (ValueError, OSError, RuntimeError):  # not a system call of this architecture
            continue
    rules.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))
    for call in ("socket", "socketpair"):
        rules.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), call, seccomp.Arg(0, seccomp.GT, max(SOCKET_FAMILIES)))
        for family in sorted(set(range(max(SOCKET_FAMILIES))) - set(SOCKET_FAMILIES)):
            rules.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), call, seccomp.Arg(0, seccomp.EQ, family))
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as f:
        rules.export_bpf(f)
        f.seek(0)
        return f.read()


WAYS_OUT = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap); in a container run it with "
            "--cap-add SYS_ADMIN --security-opt seccomp=unconfined (or --privileged), on Ubuntu 24.04 as a user "
            "allow unprivileged user namespaces for bwrap (an AppArmor profile, or sysctl "
            "kernel.apparmor_restrict_unprivileged_userns=0); or run code elsewhere: rollout.sandbox.kind: remote "
            "with a SandboxFusion service (rollout.sandbox.url); rollout.sandbox.kind: unsafe_process runs it "
            "without isolation (an audit hook only)")


def missing_parts() -> Optional[str]:
    """What this machine lacks to make the walls (before trying them), or None."""
    if not sys.platform.startswith("linux"):
        return f"the isolated sandbox needs Linux namespaces; this is {sys.platform}"
    if bwrap_path() is None:
        return "bwrap (bubblewrap) is not on PATH"
    try:
        seccomp_program()
    except (ImportError, RuntimeError, OSError) as e:
        return f"the seccomp filter cannot be made ({e}; needs pyseccomp and the system's libseccomp2)"
    return None
