"""The sandboxed interpreter's first code (tools/sandbox.py): ``python -I -S -B sandbox_boot.py
LIMITS_JSON`` in a fresh session, its own temporary directory as the working directory, an empty
environment, the model's code on standard input.

Before the code runs it: sets its own resource limits (CPU seconds, address space, file size, no
new processes, no core files: soft and hard, so the code cannot raise them), leaves the host's
network where the kernel lets it make a network namespace (with no interface but a down
loopback), and installs an audit hook (which code cannot remove) that refuses: opening or
listing anything outside the working directory and the Python library, writing or changing
anything outside the working directory, sockets, new processes, signals to other processes,
ctypes, and changing limits. A refusal is a PermissionError in the code.
"""

import json
import os
import resource
import sys

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000


def _limit(kind: int, value: int) -> None:
    try:
        resource.setrlimit(kind, (value, value))
    except (ValueError, OSError):  # above the hard limit already set: keep the lower one
        soft, hard = resource.getrlimit(kind)
        resource.setrlimit(kind, (min(value, hard) if hard != resource.RLIM_INFINITY else value,) * 2)


def _leave_network() -> bool:
    """A network namespace of its own (as root, or through a user namespace)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
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
    limits = json.loads(sys.argv[1])
    home = os.path.realpath(os.getcwd())
    code = sys.stdin.read()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    _limit(resource.RLIMIT_CPU, int(limits["cpu_s"]))
    _limit(resource.RLIMIT_AS, int(limits["memory_mb"]) << 20)
    _limit(resource.RLIMIT_FSIZE, int(limits["file_mb"]) << 20)
    _limit(resource.RLIMIT_NPROC, 0)
    _limit(resource.RLIMIT_CORE, 0)
    if limits.get("network_namespace"):
        _leave_network()
    readable = [home, *limits["library"], "/dev/null", "/dev/urandom"]
    sys.path[:] = [home, *limits["library"]]
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
