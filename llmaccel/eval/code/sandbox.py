"""Running untrusted generated programs: each in its own process, with limits.

Each program runs in a separate `python -I` process (isolated mode: no PYTHON* variables, no
user site-packages, no script directory on sys.path), in a fresh temporary directory as its
working directory, with an almost empty environment, stdin from /dev/null, in a new session
(its own process group, killed as a whole on timeout) and under resource limits set before
exec: address space (RLIMIT_AS, default 1 GiB), CPU seconds, size of any file written (its
stdout and stderr included), open files, no core dumps, and by default no new processes or
threads (RLIMIT_NPROC 0: a fork bomb fails at its first fork).

A small harness runs first in that process. It disables, by replacing them before the
program's first line, the network (`socket.socket`, `create_connection`, `getaddrinfo`, ...),
process creation (`os.system`, `os.fork`, `subprocess.Popen`, ...) and writes, deletions and
renames outside the working directory (`open`, `os.remove`, `shutil.rmtree`, ...). Then it
executes the program and reports how it ended through its exit status, plus a random token
printed only after the tests returned (so a program that calls `os._exit(0)` before its tests
ran does not pass).

That harness is best effort against accidents (a model's bug that loops, allocates without
end, deletes a file, opens a connection), NOT a security boundary: Python code can undo any
replacement (ctypes, reloading a module). Two OS-level measures hold even then, where
available: where `unshare -rn` works without root (Linux with unprivileged user namespaces),
the process runs in its own empty network namespace (no interface up: no connection to
anything, the host's loopback included); and when we run as root (containers), programs run
as "nobody", so they cannot touch root's files and RLIMIT_NPROC holds (it never limits root).
Otherwise a program has the calling user's rights over the file system. For code you do not
trust at all, run the evaluation in a container or VM without network.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from llmaccel.errors import LLMAccelError

logger = logging.getLogger(__name__)

STATUSES = ("passed", "failed", "timeout", "error", "memory")
# The harness's exit statuses (unlikely from a program by accident; 0 also needs the token).
EXIT_FAILED, EXIT_ERROR, EXIT_MEMORY = 101, 102, 103
STDERR_TAIL = 2000  # characters of stderr kept in a result
_MEMORY_MARKS = ("MemoryError", "Cannot allocate memory", "out of memory", "std::bad_alloc")

# Runs in the sandboxed process before the program: argv[1] is the folder of the token file,
# argv[2] "1" when processes are allowed. Replaces network, process and file functions by
# ones that raise PermissionError (best effort: see the module docstring).
HARNESS = r'''
import builtins, gc, io, os, sys

_DISABLED = "is disabled in the llmaccel code sandbox"


def _refuse(what):
    def refuse(*args, **kwargs):
        raise PermissionError(f"{what} {_DISABLED}")
    return refuse


def _socket_class(base):
    # A subclass, so that socket.py (imported later) still subclasses it; wrapping an
    # existing descriptor stays possible (socketpair(), e.g. asyncio's self-pipe).
    def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
        if fileno is None:
            raise PermissionError(f"network access {_DISABLED}")
        base.__init__(self, family, type, proto, fileno)
    return type(base.__name__, (base,), {"__init__": __init__, "__slots__": ()})


def _guard(root, allow_processes):
    # The C modules, before `socket` and `subprocess` are imported (cheap, and those
    # modules then take the replacements when the program imports them).
    import _socket
    _socket.socket = _socket.SocketType = _socket_class(_socket.socket)
    for name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr",
                 "getnameinfo", "dup"):
        if hasattr(_socket, name):
            setattr(_socket, name, _refuse(f"network access (socket.{name})"))
    if not allow_processes:
        import _posixsubprocess
        _posixsubprocess.fork_exec = _refuse("starting processes")
        for name in ("system", "popen", "fork", "forkpty", "execv", "execve", "execvp",
                     "execvpe", "execl", "execle", "execlp", "execlpe", "spawnv", "spawnve",
                     "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe",
                     "posix_spawn", "posix_spawnp", "kill", "killpg"):
            if hasattr(os, name):
                setattr(os, name, _refuse(f"os.{name}"))

    def inside(path, dir_fd=None):
        if isinstance(path, int):
            return True  # an already open descriptor
        try:
            path = os.fsdecode(os.fspath(path))
            if dir_fd is not None and not os.path.isabs(path):
                path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
            real = os.path.realpath(path)
        except (TypeError, ValueError, OSError):
            return False
        return real == root or real.startswith(root + os.sep)

    real_open = builtins.open

    def guarded_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and not inside(file):
            raise PermissionError(f"writing {file!r} outside the working directory {_DISABLED}")
        return real_open(file, mode, *args, **kwargs)

    builtins.open = io.open = guarded_open
    real_os_open = os.open
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def guarded_os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & writing and not inside(path, dir_fd):
            raise PermissionError(f"writing {path!r} outside the working directory {_DISABLED}")
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    os.open = guarded_os_open

    def checked(fn, name):
        # every path argument must lie inside the working directory (shutil.rmtree, move
        # and the like go through these)
        def call(*args, **kwargs):
            dir_fds = [kwargs.get(k) for k in ("dir_fd", "src_dir_fd", "dst_dir_fd")]
            for a in args:
                if isinstance(a, (str, bytes, os.PathLike)) and not any(
                        inside(a, fd) for fd in dict.fromkeys(dir_fds)):
                    raise PermissionError(f"{name}({a!r}) outside the working directory "
                                          f"{_DISABLED}")
            return fn(*args, **kwargs)
        return call

    for name in ("remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace",
                 "truncate", "chmod", "chown", "lchown", "link", "symlink", "utime", "mkdir",
                 "makedirs", "mkfifo", "mknod"):
        if hasattr(os, name):
            setattr(os, name, checked(getattr(os, name), f"os.{name}"))


def _main():
    os.closerange(3, 1 << 16)  # nothing of the parent's beyond stdin/stdout/stderr
    token_path = os.path.join(sys.argv[1], "token")
    with open(token_path, "rb") as f:
        token = f.read().strip()
    os.remove(token_path)
    with open("program.py", encoding="utf-8") as f:
        source = f.read()
    write, exit_now, stdout, stderr = os.write, os._exit, sys.stdout, sys.stderr
    _guard(os.path.realpath(os.getcwd()), sys.argv[2] == "1")
    status, error = 0, None
    program_globals = {"__name__": "__program__", "__builtins__": builtins}
    try:
        exec(compile(source, "program.py", "exec"), program_globals)
    except MemoryError:
        status = 103
    except AssertionError as e:
        status, error = 101, e
    except BaseException as e:
        status, error = 102, e
    if error is not None:
        import traceback
        traceback.print_exception(type(error), error, error.__traceback__)
        error = None
    for stream in (sys.stdout, sys.stderr, stdout, stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    if status == 103:
        program_globals.clear()
        gc.collect()
        write(2, b"\nMemoryError: the program ran out of memory\n")
    elif status == 0:
        write(1, b"\n" + token + b"\n")
    exit_now(status)


_main()
'''


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0          # wall clock; the process group is killed after it
    memory_mb: int = 1024            # RLIMIT_AS
    cpu_s: int | None = None         # RLIMIT_CPU (default: the timeout rounded up, plus 1)
    file_size_mb: int = 16           # RLIMIT_FSIZE: any file written, stdout/stderr included
    max_open_files: int = 64         # RLIMIT_NOFILE
    allow_processes: bool = False    # False: RLIMIT_NPROC 0 and process functions disabled
    network_namespace: bool | None = None  # `unshare -rn`; None: when it works here
    drop_root: bool = True           # run as "nobody" when we are root (and it can run Python)
    python: str | None = None        # the interpreter (default: this one; stdlib is enough)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise LLMAccelError(f"the sandbox timeout must be > 0 s, got {self.timeout_s}")
        if self.memory_mb < 64:
            raise LLMAccelError(f"the sandbox memory limit must be >= 64 MB (Python itself "
                                f"needs some), got {self.memory_mb}")


@dataclass(frozen=True)
class SandboxResult:
    passed: bool
    status: str          # passed | failed | timeout | error | memory
    stderr: str          # the last STDERR_TAIL characters (tracebacks, messages)
    seconds: float       # wall clock of the process
    returncode: int | None = None


def _switch_user(user: tuple[int, int] | None) -> Callable[[], None] | None:
    if user is None:
        return None
    uid, gid = user

    def switch() -> None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    return switch


def _works(cmd: list[str], user: tuple[int, int] | None) -> bool:
    """Whether cmd succeeds as `user` under the default limits (no new processes)."""
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=20, cwd="/",
                           preexec_fn=_preexec(_rlimits(SandboxLimits(timeout_s=20)), False,
                                               user))
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


@dataclass(frozen=True)
class SandboxIdentity:
    """Who runs the programs, with which interpreter, and whether in a network namespace."""
    python: str
    user: tuple[int, int] | None   # (uid, gid) switched to before exec; None: ours
    network_namespace: bool

    def describe(self) -> str:
        who = "as the calling user" if self.user is None else f"as uid {self.user[0]}"
        net = ", own network namespace" if self.network_namespace else ""
        return f"{self.python} {who}{net}"


def _nobody() -> tuple[int, int]:
    import pwd

    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def _same_version(python: str, user: tuple[int, int]) -> bool:
    want = "%d.%d" % sys.version_info[:2]
    return _works([python, "-I", "-c", f"import sys; assert '%d.%d' % sys.version_info[:2] "
                   f"== {want!r}"], user)


@functools.lru_cache(maxsize=8)
def sandbox_identity(python: str | None = None, drop_root: bool = True,
                     network_namespace: bool | None = None) -> SandboxIdentity:
    """Resolved once per setting. As root (common in containers) the programs run as "nobody",
    so they have no rights over root's files and RLIMIT_NPROC holds (it does not for root);
    when nobody cannot run this interpreter (a venv under /root), another python3 of the
    same major.minor version that nobody can run is used (the programs need only the
    standard library), else they run as root with a warning."""
    chosen = python or sys.executable
    user = None
    if drop_root and os.name == "posix" and os.geteuid() == 0:
        nobody = _nobody()
        if _works([chosen, "-I", "-c", "pass"], nobody):
            user = nobody
        elif python is None:
            for other in dict.fromkeys(filter(None, (
                    shutil.which("python%d.%d" % sys.version_info[:2]), shutil.which("python3"),
                    "/usr/bin/python3", "/usr/local/bin/python3"))):
                if os.path.exists(other) and _same_version(other, nobody):
                    chosen, user = other, nobody
                    break
        if user is None:
            logger.warning("running as root and user 'nobody' cannot run %s: the code sandbox "
                           "runs programs as root (SandboxLimits.python names another "
                           "interpreter)", chosen)
    use_ns = (network_namespace_available(user) if network_namespace is None
              else network_namespace)
    return SandboxIdentity(chosen, user, use_ns)


@functools.lru_cache(maxsize=2)
def network_namespace_available(user: tuple[int, int] | None = None) -> bool:
    """Whether `unshare -rn` (a user + network namespace, no root needed) works here, for
    `user` ((uid, gid); None: this process's user)."""
    exe = shutil.which("unshare")
    if not sys.platform.startswith("linux") or exe is None:
        return False
    return _works([exe, "-rn", "true"], user)


def _rlimits(limits: SandboxLimits) -> list[tuple[int, int, int]]:
    """(resource, soft, hard) triples, clamped to the hard limits we have (never raised)."""
    import resource

    cpu = limits.cpu_s if limits.cpu_s is not None else int(limits.timeout_s + 0.999) + 1
    wanted = [(resource.RLIMIT_AS, limits.memory_mb * 2**20, limits.memory_mb * 2**20),
              (resource.RLIMIT_CPU, cpu, cpu + 1),
              (resource.RLIMIT_FSIZE, limits.file_size_mb * 2**20, limits.file_size_mb * 2**20),
              (resource.RLIMIT_NOFILE, limits.max_open_files, limits.max_open_files),
              (resource.RLIMIT_CORE, 0, 0)]
    if not limits.allow_processes and hasattr(resource, "RLIMIT_NPROC"):
        wanted.append((resource.RLIMIT_NPROC, 0, 0))
    out = []
    for res, soft, hard in wanted:
        _, current_hard = resource.getrlimit(res)
        if current_hard != resource.RLIM_INFINITY:
            hard = min(hard, current_hard)
            soft = min(soft, hard)
        out.append((res, soft, hard))
    return out


def _preexec(rlimits: list[tuple[int, int, int]], strict: bool,
             user: tuple[int, int] | None) -> Callable[[], None]:
    import resource

    setrlimit = resource.setrlimit
    late = (getattr(resource, "RLIMIT_NPROC", None), resource.RLIMIT_AS)
    first = [r for r in rlimits if r[0] not in late]
    # NPROC after setuid (set before, exec would fail with EAGAIN); AS last: this forked
    # copy of a big process (torch, CUDA) may be over it, so nothing may allocate after it
    last = sorted((r for r in rlimits if r[0] in late), key=lambda r: r[0] == late[1])
    switch = _switch_user(user)

    def apply(limits: list[tuple[int, int, int]]) -> None:
        for res, soft, hard in limits:
            try:
                setrlimit(res, (soft, hard))
            except (ValueError, OSError):
                if strict:
                    raise

    def preexec() -> None:  # runs in the child between fork and exec: keep it minimal
        apply(first)
        if switch is not None:
            switch()
        apply(last)
    return preexec


def _tail(path: Path, chars: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4 * chars))
            return f.read().decode("utf-8", "replace")[-chars:]
    except OSError:
        return ""


def _classify(rc: int, timed_out: bool, token_seen: bool, stderr: str) -> tuple[str, str]:
    """(status, a note for stderr or "")."""
    if timed_out:
        return "timeout", "killed: wall-clock timeout"
    if rc == 0:
        if token_seen:
            return "passed", ""
        return "error", "the program exited before its tests finished"
    if rc == EXIT_FAILED:
        return "failed", ""
    if rc == EXIT_MEMORY:
        return "memory", ""
    if rc < 0:
        sig = -rc
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig
        if sig == getattr(signal, "SIGXCPU", -1):
            return "timeout", f"killed by {name}: CPU time limit"
        if any(m in stderr for m in _MEMORY_MARKS):
            return "memory", f"killed by {name}"
        return "error", f"killed by {name}"
    if any(m in stderr for m in _MEMORY_MARKS):
        return "memory", ""
    return "error", "" if rc == EXIT_ERROR else f"exit status {rc}"


def run_program(program: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run one program (a complete Python source) in its own sandboxed process."""
    if os.name != "posix":
        raise LLMAccelError("the code sandbox needs a POSIX system (Linux or macOS)")
    limits = limits or SandboxLimits()
    ident = sandbox_identity(limits.python, limits.drop_root, limits.network_namespace)
    user = ident.user
    base = Path(tempfile.mkdtemp(prefix="llmaccel-code-"))
    try:
        work, io_dir = base / "work", base / "io"
        work.mkdir()
        io_dir.mkdir(mode=0o700)
        (work / "program.py").write_text(program, encoding="utf-8")
        token = secrets.token_hex(16)
        (io_dir / "token").write_text(token)
        if user is not None:  # the program's user owns its folders (and nothing else)
            for d in (base, work, io_dir):
                os.chown(d, *user)
        cmd = [ident.python, "-I", "-c", HARNESS, str(io_dir),
               "1" if limits.allow_processes else "0"]
        if ident.network_namespace:
            cmd = ["unshare", "-rn", "--", *cmd]
        env = {"PATH": os.defpath, "HOME": str(work), "TMPDIR": str(work),
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        preexec = _preexec(_rlimits(limits), sys.platform.startswith("linux"), user)
        timed_out = False
        start = time.perf_counter()
        with open(io_dir / "stdout", "wb") as out, open(io_dir / "stderr", "wb") as err:
            try:
                proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=err, start_new_session=True,
                                        preexec_fn=preexec, close_fds=True)
            except (OSError, subprocess.SubprocessError) as e:
                raise LLMAccelError(f"cannot start the code sandbox: {e}") from e
            try:
                proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:  # the whole group: anything the program started goes too
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        seconds = time.perf_counter() - start
        stderr = _tail(io_dir / "stderr", STDERR_TAIL)
        token_seen = token in _tail(io_dir / "stdout", 200)
        status, note = _classify(proc.returncode, timed_out, token_seen, stderr)
        if note:
            stderr = (stderr + ("\n" if stderr and not stderr.endswith("\n") else "")
                      + note)[-STDERR_TAIL:]
        return SandboxResult(status == "passed", status, stderr, seconds, proc.returncode)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run_programs(programs: Sequence[str], limits: SandboxLimits | None = None,
                 workers: int | None = None,
                 on_result: Callable[[int, SandboxResult], None] | None = None
                 ) -> list[SandboxResult]:
    """Run many programs, `workers` at a time (default: CPU cores, at most 8), each in its own
    process; results in input order. `on_result(index, result)` is called as each ends."""
    workers = workers or max(1, min(8, os.cpu_count() or 1))
    results: list[SandboxResult | None] = [None] * len(programs)

    def one(i: int) -> None:
        results[i] = run_program(programs[i], limits)
        if on_result is not None:
            on_result(i, results[i])

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="code-sandbox") as pool:
        for f in [pool.submit(one, i) for i in range(len(programs))]:
            f.result()
    return results  # type: ignore[return-value]
