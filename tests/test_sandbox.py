"""The Python sandbox (megatron_rlhf/agents/sandbox) tried as a hostile policy would.

Every escape below first takes the audit hook out of the way, as model code reached it from
Python objects (UNHOOK: the hook's closure rewritten to allow everything), so what holds is the
kernel's walls alone (bubblewrap's namespaces, no capabilities, seccomp, the bounded tmpfs). Each
case checks the host side (nothing planted changed, no file appeared, every host process alive,
no connection reached a listener) and that the model reads why. Then: the refusal where namespaces
cannot be made, the opt-out, the remote SandboxFusion client against a local stand-in service.
"""

import dataclasses
import http.server
import json
import os
import platform
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from megatron_rlhf.config.schema import SandboxConfig
from megatron_rlhf.agents.function import ToolError
from megatron_rlhf.agents.sandbox import SandboxResult, readiness_problem, run_python
from tests.helpers.agent_configs import TOOLS_CONFIG

LIMITS = SandboxConfig(cpu_s=1, wall_s=2, memory_mb=512, file_mb=1, output_bytes=4096, disk_mb=4, inodes=64)
UNSAFE = SandboxConfig(kind="unsafe_process", cpu_s=1, wall_s=2, memory_mb=512, file_mb=1, output_bytes=4096)

# What model code did to today's audit hook: found it among the interpreter's objects and emptied
# what it denies (its closure cells), after which every audited call passes.
UNHOOK = textwrap.dedent("""
    import gc
    for f in gc.get_objects():
        if type(f).__name__ == "function" and f.__name__ == "hook" and f.__closure__:
            for cell in f.__closure__:
                value = cell.cell_contents
                if isinstance(value, tuple):
                    cell.cell_contents = ()
                elif isinstance(value, list):
                    cell.cell_contents = ["/"]
                elif isinstance(value, str):
                    cell.cell_contents = "/"
""")


def attempt(label: str, code: str) -> str:
    """Model code that tries ``code`` and prints ESCAPED <label> if it ran, else what stopped it."""
    body = textwrap.indent(textwrap.dedent(code).strip(), "    ")
    return f"try:\n{body}\n    print('ESCAPED', {label!r}, flush=True)\nexcept BaseException as e:\n" \
           f"    print({label + ':'!r}, type(e).__name__, e, flush=True)\n"


def _tree(root):
    """Every regular file under ``root`` and its bytes."""
    paths = [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]
    return {p: open(p, "rb").read() for p in paths if os.path.isfile(p)}


@pytest.fixture
def host(tmp_path):
    """A run's directory beside the sandbox: a planted secret, a checkpoint pointer, and a host
    process that must outlive every call."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("iter_0000001")
    (run / "ground_truth.jsonl").write_text('{"answer": 42}\n')
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield run
    sleeper.kill()
    sleeper.wait()


def _escape(run, code: str, settings: SandboxConfig = LIMITS) -> SandboxResult:
    before = _tree(run.parent)
    result = run_python(UNHOOK + code, settings)
    assert "ESCAPED" not in result.output, result.output
    assert _tree(run.parent) == before
    return result


def _sandboxes() -> set:
    """The processes of any sandboxed call on this machine (bubblewrap's and the interpreters')."""
    return {pid for pid in os.listdir("/proc") if pid.isdigit()
            and any(b in _cmdline(pid) for b in (b"sandbox/boot.py", b"/sandbox_boot.py"))}


def _escape_leaving_nothing(run, code: str) -> SandboxResult:
    """_escape, and no process of the call left once it returned (another test's are not counted)."""
    before = _sandboxes()
    result = _escape(run, code)
    left = _sandboxes() - before
    assert not left, [_cmdline(p) for p in left]
    return result


def _cmdline(pid) -> bytes:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""


def test_with_the_hook_gone_the_unsafe_process_reads_the_run_and_the_isolated_one_does_not(host):
    # Why the hook is not the wall: the same code reads the planted ground truth under today's
    # design, and finds no such file inside the walls.
    secret = host / "ground_truth.jsonl"
    code = f"print(open({str(secret)!r}).read())"
    assert "does not allow reading" in run_python(code, UNSAFE).output
    assert '{"answer": 42}' in run_python(UNHOOK + code, UNSAFE).output
    result = _escape(host, attempt("read", code))
    assert "FileNotFoundError" in result.output


def test_the_walls_are_in_place_once_the_code_runs(host):
    result = _escape(host, "print(open('/proc/self/status').read()); import os; print('cwd', os.getcwd())")
    status = dict(line.split(":\t", 1) for line in result.output.splitlines() if ":\t" in line)
    assert all(int(status[k], 16) == 0 for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"))
    assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2"
    if os.geteuid() == 0:  # a user of the call's own, which no host file or process belongs to
        import pwd

        from megatron_rlhf.agents.sandbox.isolation import SANDBOX_UID_BASE

        real, effective = map(int, status["Uid"].split()[:2])
        assert real == effective >= SANDBOX_UID_BASE
        with pytest.raises(KeyError):
            pwd.getpwuid(real)
    assert "cwd /sandbox" in result.output


PROCESS_ROUTES = {
    "fork": "import os\nif os.fork() == 0:\n    os._exit(0)",
    "subprocess (_posixsubprocess.fork_exec)": "import subprocess\nsubprocess.run(['/bin/sh', '-c', 'true'])",
    "_posixsubprocess.fork_exec itself": "import subprocess\nsubprocess.Popen([sys.executable, '-c', 'pass'])",
    "posix_spawn": "import os\nos.posix_spawn(sys.executable, [sys.executable, '-c', 'pass'], {})",
    "multiprocessing spawn": "import multiprocessing\nctx = multiprocessing.get_context('spawn')\n"
                             "p = ctx.Process(target=print, args=('child',))\np.start()\np.join()",
    "os.system": "import os\nrc = os.system(sys.executable + ' -c \"print(1234 * 5)\"')\n"
                 "assert rc == 0, f'os.system returned {rc}'",
    "pty.fork": "import pty\nif pty.fork()[0] == 0:\n    os._exit(0)",
    "exec into a shell": "import os\nos.execv('/bin/sh', ['sh'])",
}


@pytest.mark.parametrize("route", list(PROCESS_ROUTES))
def test_no_process_is_started_by_any_route(host, route):
    result = _escape_leaving_nothing(host, "import os, sys\n" + attempt(route, PROCESS_ROUTES[route]))
    # os.system: the C library answers a shell it could not start with exit status 127.
    assert any(w in result.output for w in ("Operation not permitted", "os.system returned 32512")), result.output
    assert "6170" not in result.output


def test_nothing_outlives_the_call(host):
    # A thread that keeps running and a call that ends at its wall time: nothing of the call is
    # left on the host after it returns.
    code = "import threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()\ntime.sleep(60)"
    result = _escape_leaving_nothing(host, code)
    assert result.status == "timeout"


READS = {
    "the run's directory": "open(RUN + '/ground_truth.jsonl').read()",
    "through /proc/1/root": "open('/proc/1/root' + RUN + '/ground_truth.jsonl').read()",
    "through the parent's root": "open(f'/proc/{os.getppid()}/root' + RUN + '/ground_truth.jsonl').read()",
    "the project's files": f"open({os.path.abspath('README.md')!r}).read()",
    "/etc/passwd": "open('/etc/passwd').read()",
    "a listing of the run's parent": "print(os.listdir(os.path.dirname(RUN)))",
}


@pytest.mark.parametrize("route", list(READS))
def test_no_file_outside_is_read(host, route):
    result = _escape(host, f"import os\nRUN = {str(host)!r}\n" + attempt(route, READS[route]))
    assert "No such file" in result.output or "Permission denied" in result.output, result.output


WRITES = {
    "open()": "open(RUN + '/new.txt', 'w').write('x')",
    "sqlite3 (opens in C)": "import sqlite3\nsqlite3.connect(RUN + '/db.sqlite').execute('create table t (x)')",
    "readline's history": "import readline\nreadline.write_history_file(RUN + '/history')",
    "mkfifo": "os.mkfifo(RUN + '/fifo')",
    "a .pth file in the interpreter's library": "import sysconfig\n"
        "open(os.path.join(sysconfig.get_paths()['purelib'], 'evil.pth'), 'w').write('import os')",
    "the standard library": "open(os.path.join(os.path.dirname(os.__file__), 'evil.py'), 'w').write('x')",
    "/dev/shm": "open('/dev/shm/x', 'w').write('x')",
    "the root": "open('/x', 'w').write('x')",
}


@pytest.mark.parametrize("route", list(WRITES))
def test_nothing_outside_its_directory_is_written(host, route):
    import sysconfig

    library = [sysconfig.get_paths()["purelib"], os.path.dirname(os.__file__)]
    before = {p: sorted(os.listdir(p)) for p in library}
    result = _escape(host, f"import os\nRUN = {str(host)!r}\n" + attempt(route, WRITES[route]))
    assert any(w in result.output for w in ("Read-only file system", "No such file", "unable to open", "Permission denied",
                                            "Operation not permitted")), result.output
    assert {p: sorted(os.listdir(p)) for p in library} == before


def test_no_host_process_is_signalled(host):
    sleeper = [int(p) for p in os.listdir("/proc") if p.isdigit() and b"time.sleep(120)" in _cmdline(p)]
    targets = [os.getpid(), *sleeper]
    code = f"import os, signal\nTARGETS = {targets!r}\n" + attempt("kill", "for pid in TARGETS:\n    os.kill(pid, 9)") \
        + attempt("pidfd", "for pid in TARGETS:\n    signal.pidfd_send_signal(os.pidfd_open(pid), 9)") \
        + attempt("kill -1", "os.kill(-1, signal.SIGKILL)\nprint('alone')")
    result = _escape(host, code)
    assert "kill: ProcessLookupError" in result.output and "pidfd: ProcessLookupError" in result.output
    for pid in targets:
        os.kill(pid, 0)  # alive


def test_disk_bytes_and_inodes_are_bounded(host):
    code = attempt("bytes", "n = 0\nwhile True:\n    open(f'b{n}', 'wb').write(b'x' * (512 << 10))\n    n += 1") \
        + "print('bytes written:', sum(os.path.getsize(f) for f in os.listdir('.')))\n" \
        + "import shutil\nfor f in os.listdir('.'):\n    os.remove(f)\n" \
        + attempt("inodes", "n = 0\nwhile True:\n    open(f'i{n}', 'w').close()\n    n += 1") \
        + "print('empty files:', len(os.listdir('.')))\n"
    result = _escape(host, "import os\n" + code)
    assert result.output.count("No space left on device") == 2, result.output
    written = int(result.output.split("bytes written:")[1].split()[0])
    empty = int(result.output.split("empty files:")[1].split()[0])
    assert LIMITS.disk_mb << 19 < written <= LIMITS.disk_mb << 20 and LIMITS.inodes // 2 < empty < LIMITS.inodes


def test_no_host_socket_or_network_is_reached(host):
    listener = socket.create_server(("127.0.0.1", 0))
    unix_path = str(host / "trainer.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    unix.listen()
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0megatron-rlhf-test-{os.getpid()}")
    abstract.listen()
    port = listener.getsockname()[1]
    code = "import socket\n" + attempt("tcp", f"socket.create_connection(('127.0.0.1', {port}), timeout=2)") \
        + attempt("internet", "socket.create_connection(('1.1.1.1', 53), timeout=2)") \
        + attempt("unix", f"s = socket.socket(socket.AF_UNIX)\ns.connect({unix_path!r})") \
        + attempt("abstract", f"s = socket.socket(socket.AF_UNIX)\ns.connect('\\0megatron-rlhf-test-{os.getpid()}')")
    try:
        result = _escape(host, code)
        for server in (listener, unix, abstract):
            server.setblocking(False)
            with pytest.raises(BlockingIOError):
                server.accept()
    finally:
        for server in (listener, unix, abstract):
            server.close()
    # Its own network namespace: a loopback of its own where nothing listens, no route out, and
    # abstract UNIX sockets of its own namespace only.
    assert "tcp: ConnectionRefusedError" in result.output and "internet: OSError [Errno 101] Network is unreachable" \
        in result.output
    assert "unix: FileNotFoundError" in result.output and "abstract: ConnectionRefusedError" in result.output


KERNEL_CALLS = {
    "a user namespace": "libc.unshare(0x10000000)",
    "mount": "libc.mount(b'tmpfs', b'/tmp', b'tmpfs', 0, None)",
    "ptrace the init": "libc.ptrace(16, 1, 0, 0)",
    "io_uring": "libc.syscall(425, 8, ctypes.create_string_buffer(120))",  # io_uring_setup: 425 on every architecture
    "bpf": f"libc.syscall({ {'x86_64': 321, 'aarch64': 280}[platform.machine()] }, 0, 0, 0)",
}


def test_the_kernel_calls_an_escape_needs_are_refused(host):
    code = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    for name, call in KERNEL_CALLS.items():
        code += f"print({name!r}, {call}, ctypes.get_errno())\n"
    result = _escape(host, code)
    for name in KERNEL_CALLS:
        line = next(line for line in result.output.splitlines() if line.startswith(name + " "))
        assert line.split()[-2:] == ["-1", "1"], line  # -1, EPERM


HELD_MEMORY = {
    "memfd": "fd = os.memfd_create('held')\nos.ftruncate(fd, 1 << 30)",
    "sysv shared memory": "assert libc.shmget(0, 1 << 30, 0o1600) >= 0, ctypes.get_errno()",
    "sysv message queue": "assert libc.msgget(0, 0o1600) >= 0, ctypes.get_errno()",
    "posix message queue": "assert libc.mq_open(b'/held', os.O_CREAT | os.O_RDWR, 0o600, None) >= 0, ctypes.get_errno()",
    "posix shared memory": "open('/dev/shm/held', 'wb').write(b'x' * (1 << 20))",
    "vsock": "socket.socket(40, socket.SOCK_STREAM)",  # AF_VSOCK: the VM's port space, outside any namespace
    "netlink": "socket.socket(16, socket.SOCK_RAW, 0)",  # AF_NETLINK
    "packet": "socket.socket(17, socket.SOCK_RAW, 0)",  # AF_PACKET
    "socketpair of another family": "socket.socketpair(40)",
}
# Kernel buffers by every route that still exists: pipes grown to 1 MB and socket pairs, each
# filled until it would block, as many as the descriptors allow; threads until refused.
BUFFERS = """
held, ends = 0, []
def fill(w):
    global held
    os.set_blocking(w, False)
    try:
        while True:
            held += os.write(w, b'x' * 65536)
    except BlockingIOError:
        pass
try:
    while True:
        r, w = os.pipe()
        ends += [r, w]
        try:
            fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ
        except OSError:
            pass
        fill(w)
        a, b = socket.socketpair()
        ends += [a, b]
        fill(a.fileno())
except OSError as e:
    print('descriptors', len(ends), 'held', held, type(e).__name__, e.errno)
started = 0
try:
    for _ in range(1000):
        threading.Thread(target=time.sleep, args=(1,), daemon=True).start()
        started += 1
except RuntimeError:
    pass
print('threads', started)
"""


def test_memory_outside_the_address_space_and_other_socket_families_are_walled_in(host):
    """The host memory a call could hold that RLIMIT_AS does not count, by each route: anonymous
    files, SysV and POSIX IPC, /dev/shm refused; pipes and sockets bounded by open_files; socket
    families the network namespace does not wall in (vsock, netlink, packet) refused; threads
    started up to ``threads`` (the main one counts), not fewer."""
    code = "import ctypes, fcntl, os, socket, threading, time\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    code += "".join(attempt(name, route) for name, route in HELD_MEMORY.items()) + BUFFERS
    result = _escape(host, code)
    lines = {line.split(":")[0]: line for line in result.output.splitlines() if ":" in line}
    for name in ("memfd", "sysv shared memory", "sysv message queue", "posix message queue"):
        assert name in lines and ("PermissionError" in lines[name] or lines[name].endswith(" 1")), result.output
    assert "Read-only file system" in lines["posix shared memory"] or "No such file" in lines["posix shared memory"]
    for name in ("vsock", "netlink", "packet", "socketpair of another family"):
        assert "[Errno 97] Address family not supported" in lines[name], result.output
    figures = {line.split()[0]: line.split() for line in result.output.splitlines() if line.startswith(("descriptors", "threads"))}
    descriptors, held = int(figures["descriptors"][1]), int(figures["descriptors"][3])
    assert figures["descriptors"][-1] == "24" and descriptors <= LIMITS.open_files  # EMFILE
    assert held <= LIMITS.open_files * (1 << 20), held
    assert int(figures["threads"][1]) == LIMITS.threads - 1, result.output


# -- what the model reads when its code misbehaves (the hook answers first where it can) -----------

MISBEHAVING = {
    "reads the run's files": ("print(open({secret!r}).read())", "error", "does not allow reading"),
    "writes outside its directory": ("open({run!r} + '/new.txt', 'w').write('x')", "error", "does not allow writing"),
    "opens a socket": ("import socket; socket.create_connection(('127.0.0.1', 9))", "error", "does not allow socket"),
    "forks repeatedly": ("import os\nwhile True:\n    os.fork()", "error", "does not allow os.fork"),
    "allocates 8 GiB": ("x = bytearray(8 << 30)", "error", "MemoryError"),
    "sleeps forever": ("import time; time.sleep(3600)", "timeout", "wall-time limit"),
    "spins forever": ("while True:\n    pass", "killed", "CPU-time"),
    "prints 100 MB": ("import sys\nfor _ in range(1000):\n    sys.stdout.write('x' * 100000)", "output_limit", "printed more"),
    "kills its parent": ("import os, signal; os.kill(os.getppid(), signal.SIGKILL)", "error", "does not allow os.kill"),
    "writes a big file in its directory": ("open('big', 'wb').write(b'x' * (4 << 20))", "error", "File too large"),
}


@pytest.mark.parametrize("kind", ["isolated", "unsafe_process"])
@pytest.mark.parametrize("case", list(MISBEHAVING))
def test_code_that_misbehaves_is_stopped_and_the_model_reads_why(host, case, kind):
    code, status, words = MISBEHAVING[case]
    before = _tree(host.parent)
    settings = LIMITS if kind == "isolated" else UNSAFE
    if status == "killed":  # the CPU-time limit must come first on a busy machine too
        settings = dataclasses.replace(settings, wall_s=settings.cpu_s * 4)
    result = run_python(code.format(run=str(host), secret=str(host / "ground_truth.jsonl")), settings)
    assert result.status == status and words in result.output, (result.status, result.output[-400:])
    assert _tree(host.parent) == before
    assert result.seconds < settings.wall_s + 3


def test_the_python_tool_returns_what_the_code_printed_or_an_error_the_model_reads():
    from megatron_rlhf.agents.sandbox import python

    assert python("import math\nprint(math.factorial(5))") == "120\n"
    with pytest.raises(ToolError, match="ZeroDivisionError"):
        python("print(1 / 0)")
    assert run_python("open('a.txt', 'w').write('kept'); print(open('a.txt').read())", LIMITS).output == "kept\n"
    result = run_python("def f():\n    raise ValueError('bad input')\nf()", LIMITS)
    assert result.status == "error" and "boot.py" not in result.output and 'File "main.py", line 3' in result.output


# -- where the walls cannot be made ---------------------------------------------------------------

def _fake_bwrap(tmp_path, said: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "bwrap").write_text(f"#!/bin/sh\necho '{said}' >&2\nexit 1\n")
    (bin_dir / "bwrap").chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def test_a_machine_without_namespaces_is_named_and_no_call_runs_weaker(tmp_path, monkeypatch):
    said = "bwrap: No permissions to create new namespace, likely because the kernel does not allow non-privileged user namespaces"
    monkeypatch.setenv("PATH", _fake_bwrap(tmp_path, said))
    problem = readiness_problem(LIMITS)
    assert problem.startswith("bubblewrap cannot make the sandbox's namespaces here") and "No permissions" in problem
    result = run_python("print('ran')", LIMITS)
    assert result.status != "ok" and "ran\n" not in result.output
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    (tmp_path / "bin" / "bwrap").unlink()
    assert readiness_problem(LIMITS) == "bwrap (bubblewrap) is not on PATH"
    assert run_python("print('ran')", LIMITS).status == "unavailable"


# -- the remote sandbox (SandboxFusion's /run_code) -------------------------------------------------

class _StandIn(http.server.BaseHTTPRequestHandler):
    """A SandboxFusion stand-in: answers /run_code from a script, counts calls in flight, drops
    the first ``drop`` connections."""

    def do_POST(self):
        service = self.server.service
        with service["lock"]:
            service["calls"] += 1
            if service["drop"] > 0:
                service["drop"] -= 1
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            service["in_flight"] += 1
            service["most"] = max(service["most"], service["in_flight"])
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        service["requests"].append(request)
        time.sleep(service["delay"])
        answer = service["answer"](request["code"])
        with service["lock"]:
            service["in_flight"] -= 1
        body = answer if isinstance(answer, bytes) else json.dumps(answer).encode()  # bytes: sent as they are
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _finished(stdout, code=0, status="Finished"):
    return {"status": "Success" if code == 0 else "Failed", "compile_result": None,
            "run_result": {"status": status, "execution_time": 0.01, "return_code": code, "stdout": stdout, "stderr": ""}}


@pytest.fixture
def service(monkeypatch):
    from megatron_rlhf.agents.sandbox import remote

    monkeypatch.setattr(remote, "RETRY_PAUSE_S", 0.01)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    server.service = {"lock": threading.Lock(), "calls": 0, "drop": 0, "in_flight": 0, "most": 0, "requests": [],
                      "delay": 0.0, "answer": lambda code: _finished("42\n")}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


def test_the_remote_sandbox_runs_code_as_the_local_one_answers(service):
    url = f"http://127.0.0.1:{service.server_address[1]}"
    settings = SandboxConfig(kind="remote", url=url, wall_s=5, output_bytes=64)
    done = run_python("print(6 * 7)", settings)
    assert (done.status, done.output) == ("ok", "42\n")
    assert service.service["requests"][0] == {"code": "print(6 * 7)", "language": "python", "run_timeout": 5,
                                              "compile_timeout": 5, "memory_limit_MB": 1024}
    answers = {"fails": _finished("Traceback ...\nValueError\n", code=1), "slow": _finished("", 137, "TimeLimitExceeded"),
               "loud": _finished("x" * 100), "broken": {"status": "SandboxError", "message": "no runner"}}
    service.service["answer"] = lambda code: answers[code]
    assert [run_python(code, settings).status for code in answers] == ["error", "timeout", "output_limit", "unavailable"]
    assert readiness_problem(settings) is not None  # the trial call is answered "broken" here
    # A service that answers what SandboxFusion never does: named, an answer to the model, no traceback.
    odd = {"null": b"null", "page": b"<html>502 Bad Gateway</html>", "list": b"[1, 2]"}
    service.service["answer"] = lambda code: odd[code]
    said = {code: run_python(code, settings) for code in odd}
    assert {code: r.status for code, r in said.items()} == {code: "unavailable" for code in odd}
    assert "its answer is null, not the JSON object SandboxFusion answers" in said["null"].output
    assert "its answer is not JSON (is " in said["page"].output and "502 Bad Gateway" in said["page"].output
    assert "its answer is [1, 2], not the JSON object" in said["list"].output


def test_the_remote_sandbox_retries_a_dropped_connection_and_bounds_calls_in_flight(service):
    import concurrent.futures

    url = f"http://127.0.0.1:{service.server_address[1]}"
    service.service["drop"] = 2
    assert run_python("print(6 * 7)", SandboxConfig(kind="remote", url=url, retries=2)).output == "42\n"
    assert service.service["calls"] == 3
    service.service["drop"], service.service["delay"] = 0, 0.2
    settings = SandboxConfig(kind="remote", url=url, max_concurrent_calls=2)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: run_python("print(1)", settings), range(8)))
    assert all(r.status == "ok" for r in results) and service.service["most"] == 2
    service.service["drop"] = 5
    failed = run_python("print(1)", SandboxConfig(kind="remote", url=url, retries=1))
    assert failed.status == "unavailable" and "after 2 tries" in failed.output


def test_a_remote_sandbox_that_is_not_there_is_an_answer_to_the_model_not_a_failure(monkeypatch):
    from megatron_rlhf.agents import sandbox

    monkeypatch.setattr(sandbox.remote, "RETRY_PAUSE_S", 0.01)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = SandboxConfig(kind="remote", url=f"http://127.0.0.1:{port}", retries=1)
    assert "refused" in readiness_problem(settings)
    sandbox.configure(settings)
    try:
        with pytest.raises(ToolError, match="the remote sandbox did not run the code after 2 tries"):
            sandbox.python("print(1)")
    finally:
        sandbox.configure(SandboxConfig())


# -- a run's start-up ---------------------------------------------------------------------------------

def _check_only(tmp_path, extra: str = "", **environment):
    config = tmp_path / "tools.yaml"
    config.write_text(TOOLS_CONFIG.format(repo=os.getcwd()) + extra)
    return subprocess.run([sys.executable, "-m", "megatron_rlhf.train", "--config", str(config), "--check-only",
                           "--world-size", "2", "--output-dir", str(tmp_path / "out")], capture_output=True, text=True,
                          env={**os.environ, **environment})


def test_a_run_whose_tools_run_code_is_refused_before_start_up_where_the_walls_cannot_be_made(tmp_path):
    path = _fake_bwrap(tmp_path, "bwrap: Creating new namespace failed: Operation not permitted")
    refused = _check_only(tmp_path, PATH=path)
    assert refused.returncode == 2 and refused.stderr.count("error:") == 1 and "Traceback" not in refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert "rollout.sandbox.kind: isolated, but bubblewrap cannot make the sandbox's namespaces here" in line
    assert "Creating new namespace failed" in line and "kind: remote" in line and "--cap-add SYS_ADMIN" in line
    opted_out = _check_only(tmp_path, "  sandbox: {kind: unsafe_process}\n", PATH=path)
    assert opted_out.returncode == 0, opted_out.stderr
    assert "rollout.sandbox.kind: unsafe_process: model-written code runs without the kernel's isolation" in opted_out.stderr


def test_calls_without_isolation_are_counted_in_the_metrics():
    from megatron_rlhf.agents.protocol import Turn, checked_step
    from megatron_rlhf.agents.tool_environment import ToolEnvironment
    from megatron_rlhf.agents.sandbox import configure

    try:
        env = ToolEnvironment(["megatron_rlhf.agents.sandbox:python"], "tags", sandbox={"kind": "unsafe_process"})
        # As the environment workers take it: the protocol's checks of a step's result (a count
        # without the tool_ prefix failed every trajectory that called python).
        result = checked_step(env.step(Turn("<python>print(2 + 3)</python>", [], 0, True)))
        assert result.observation[0]["content"] == "5\n" and result.info["counts"]["tool_unsafe_calls"] == 1
        isolated = ToolEnvironment(["megatron_rlhf.agents.sandbox:python"], "tags", sandbox={})
        assert "tool_unsafe_calls" not in isolated.step(Turn("<python>print(1)</python>", [], 0, True)).info["counts"]
    finally:
        configure(SandboxConfig())


def test_a_remote_sandbox_that_never_answers_is_refused_at_start_up_after_one_short_try(service, monkeypatch):
    """A service that takes the connection and never answers: the start-up trial tries once with
    its own short time-out (it took the run's wall time plus the wait, times every retry: minutes)."""
    from megatron_rlhf.agents import sandbox

    monkeypatch.setattr(sandbox, "REMOTE_TRIAL_S", 0.2)
    monkeypatch.setattr(sandbox.remote, "WAIT_BEYOND_S", 0.3)
    service.service["delay"] = 3.0  # longer than the trial waits
    url = f"http://127.0.0.1:{service.server_address[1]}"
    started = time.monotonic()
    said = readiness_problem(SandboxConfig(kind="remote", url=url, wall_s=30, retries=3))
    assert said.startswith(f"a trial call to {url} failed") and "timed out" in said
    assert time.monotonic() - started < 2.0 and service.service["calls"] == 1


def test_a_process_holding_over_a_thousand_descriptors_still_reads_its_sandbox():
    """A trainer holds many descriptors (process groups, files): the sandbox's output is read with
    poll, which takes any descriptor number (select refuses 1024 and above)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1200
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"the hard limit of open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        assert run_python("print(6 * 7)", LIMITS).output == "42\n"
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
