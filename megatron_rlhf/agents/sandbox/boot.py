"""The sandboxed interpreter's first code (agents/sandbox): ``python -I -S -B boot.py
SETTINGS_JSON``, an empty environment, the model's code on standard input.

Isolated (inside bubblewrap's namespaces, isolation.py), before the code runs it:
mounts the code's directory (a tmpfs bounded in bytes and inodes), drops every capability (the
bounding set too; as the host's root it becomes ``nobody``), sets no new privileges and loads
the seccomp filter. A step that fails ends the call with SETUP_FAILED: the code never runs with
less than the walls. Then, in every kind: its own resource limits (CPU seconds, address space,
file size, open descriptors, threads, no core files: soft and hard, so the code cannot raise them) and an audit
hook (a second wall, never the first) that refuses reading outside its directory and the Python
library, writing outside its directory, sockets, new processes, signals, ctypes and limits; a
refusal is a PermissionError in the code. unsafe_process has only these, and a network
namespace where the kernel gives one.
"""

import json
import os
import resource
import sys

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
MS_NOSUID, MS_NODEV = 2, 4
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 24, 38, 22, 2
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
SETUP_FAILED = 125  # the exit status of a set-up step that failed (local.py reads it)
THREAD_STACK = 2 << 20  # a new thread's stack (the C library's default, 8 MB, would take a 64th of 512 MB)


def _limit(kind: int, value: int) -> None:
    try:
        resource.setrlimit(kind, (value, value))
    except (ValueError, OSError):  # above the hard limit already set: keep the lower one
        soft, hard = resource.getrlimit(kind)
        resource.setrlimit(kind, (min(value, hard) if hard != resource.RLIM_INFINITY else value,) * 2)


def _libc():
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)


def _check(ok: bool, what: str) -> None:
    if not ok:
        import ctypes

        print(f"sandbox set-up failed: {what} ({os.strerror(ctypes.get_errno())})", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)


def _enter_isolation(settings: dict) -> str:
    """The walls inside bubblewrap's namespaces; returns the code's directory."""
    ctypes, libc = _libc()
    home, uid = settings["workdir"], settings["uid"]
    options = f"size={settings['disk_mb']}m,nr_inodes={settings['inodes']},mode=0700".encode()
    _check(libc.mount(b"tmpfs", home.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) == 0, f"tmpfs on {home}")
    for capability in range(64):  # the bounding set: no program could regain a capability
        if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # EINVAL: none such
            _check(False, f"dropping capability {capability}")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if open("/proc/self/uid_map").read().split() == ["0", "0", "4294967295"]:  # the host's root: a user of its own
        os.chown(home, uid, uid)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # clears the permitted and effective capabilities
    # Else a user namespace's root (an unprivileged trainer) keeps its uid. Either way, no capability is left.
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    _check(libc.capset(header, (ctypes.c_uint32 * 6)()) == 0, "clearing capabilities")
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith("Cap"))
    _check(all(int(value, 16) == 0 for value in status.values()), "capabilities left")
    os.chdir(home)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0, "no new privileges")
    program = bytes.fromhex(settings["seccomp"])

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    fprog = SockFprog(len(program) // 8, program)
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) == 0, "seccomp filter")
    return home


def _leave_network() -> bool:
    """unsafe_process: a network namespace of its own (as root, or through a user namespace)."""
    _, libc = _libc()
    for flags in (CLONE_NEWNET, CLONE_NEWUSER | CLONE_NEWNET):
        if libc.unshare(flags) == 0:
            return True
    return False


def _within(path: str, roots) -> bool:
    return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def _hook(home: str, readable):
    deny_always = ("socket.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty",
                   "os.system", "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.", "resource.setrlimit",
                   "resource.prlimit", "os.setuid", "os.setgid", "pty.", "sys.addaudithook", "os.chroot",
                   "mmap.__new__", "os.startfile", "webbrowser.", "urllib.Request", "ftplib.", "smtplib.",
                   "http.client.")
    writes = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
              "os.truncate", "os.utime", "os.chflags", "os.setxattr", "os.removexattr", "shutil.")
    reads = ("os.listdir", "os.scandir", "glob.glob", "os.chdir", "os.getxattr", "os.listxattr")

    def resolved(path) -> str:
        if isinstance(path, int):
            return home  # a descriptor it already holds
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        return os.path.realpath(os.path.join(home, str(path)))

    def hook(event: str, args) -> None:
        if event.startswith(deny_always):
            raise PermissionError(f"the sandbox does not allow {event}")
        if event == "open":
            path, mode, flags = args
            writing = (mode and any(c in mode for c in "wax+")) or (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            where = resolved(path)
            if not _within(where, [home] if writing else readable):
                raise PermissionError(f"the sandbox does not allow {'writing' if writing else 'reading'} {where}")
        elif event.startswith(writes):
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not _within(resolved(path), [home]):
                    raise PermissionError(f"the sandbox does not allow {event} of {resolved(path)}")
        elif event.startswith(reads) and args and not _within(resolved(args[0] if args[0] is not None else "."), readable):
            raise PermissionError(f"the sandbox does not allow {event} of {resolved(args[0])}")

    return hook


def main() -> None:
    settings = json.loads(sys.argv[1])
    code = sys.stdin.read()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    if settings["walled"]:
        home = _enter_isolation(settings)
    else:
        home = os.path.realpath(os.getcwd())
        _limit(resource.RLIMIT_NPROC, 0)  # binds a user that is not root only
        _leave_network()
    os.environ["HOME"] = home
    _limit(resource.RLIMIT_CPU, int(settings["cpu_s"]))
    _limit(resource.RLIMIT_AS, int(settings["memory_mb"]) << 20)
    _limit(resource.RLIMIT_FSIZE, int(settings["file_mb"]) << 20)
    _limit(resource.RLIMIT_CORE, 0)
    # Pipes and sockets hold kernel buffers RLIMIT_AS does not count (up to about 1 MB each): their
    # number is bounded with every other descriptor's.
    _limit(resource.RLIMIT_NOFILE, int(settings["open_files"]))
    import threading

    threading.stack_size(THREAD_STACK)  # each thread's stack counts against memory_mb
    if settings["walled"]:  # counts threads too: the filter lets it start no process
        _limit(resource.RLIMIT_NPROC, int(settings["threads"]))
    readable = [home, *settings["library"], "/dev/null", "/dev/urandom"]
    sys.path[:] = [home, *settings["library"]]
    sys.argv = ["main.py"]
    sys.addaudithook(_hook(home, readable))
    try:
        exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        sys.stdout.flush()
        if e.code not in (None, 0):
            print(f"[exit code {e.code}]", file=sys.stderr)
        os._exit(0 if e.code in (None, 0) else 1)
    except BaseException as e:
        _print_exception(e)
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()


def _print_exception(e: BaseException) -> None:
    """The traceback of the model's code only (this file's frames left out)."""
    import traceback

    shown = traceback.TracebackException.from_exception(e)
    shown.stack = traceback.StackSummary.from_list([f for f in shown.stack if f.filename != __file__])
    print("".join(shown.format()), end="", file=sys.stderr)


if __name__ == "__main__":
    main()
