"""A zygote: an interpreter that imports what every recipe imports (torch, Lightning, Hydra, lightning_par) once, then
forks one child per command it is sent, each child running ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) as
a fresh interpreter would: its own ``sys.argv``, ``sys.path``, working directory, environment, standard streams (files
the caller reads), ``__main__`` module and exit status. Run as a script by :mod:`tests.support.forked_run`, never
imported by the tests: only the standard library and the heavy imports below are in it.

Protocol, one JSON object per line: the caller writes ``{"argv", "cwd", "env", "stdout", "stderr", "status"}`` (file
names; the same name for stdout and stderr: stderr into stdout), optionally ``"append": true`` (append to the output
files instead of truncating them) and ``"new_session": true`` (the child calls ``setsid``, as
``subprocess.Popen(start_new_session=True)``: its own session and process group, which a caller can signal whole with
``os.killpg``) on this process's standard input; the zygote forks, answers ``{"pid": N}`` on its standard output, and once the child has
exited writes its exit status (``-N`` for a signal, as ``subprocess`` reports it) to the status file (atomically:
written to a temporary name, then renamed). The zygote ends when its standard input closes (the test session ended).

The child was never a fresh interpreter, so what differs is only what the parent did before the fork: the modules
imported here (their import-time output went to this process's stderr, not to the child's), with the environment this
zygote started with (:mod:`tests.support.forked_run` keeps one zygote per environment, so a test's variables that a
library reads at import, ``TRANSFORMERS_VERBOSITY`` say, are there when it imports). This process runs no OpenMP
region and starts no thread, so the fork is safe.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys


def _dedup(paths: list[str]) -> list[str]:
    """``paths`` without repeats, first occurrence kept (``site`` adds a directory already on the path once)."""
    seen: set[str] = set()
    return [p for p in paths if not (p in seen or seen.add(p))]


def _child(request: dict, base_path: list[str], ctl: tuple[int, int]) -> None:
    """The forked child: become ``python ARGV`` and never return."""
    code = 1
    try:
        for fd in ctl:
            os.close(fd)
        if request.get("new_session"):
            os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request.get("append") else os.O_TRUNC)
        out = os.open(request["stdout"], mode, 0o644)
        same = request["stderr"] == request["stdout"]  # stderr into stdout (subprocess.STDOUT)
        err = os.dup(out) if same else os.open(request["stderr"], mode, 0o644)
        for src, dst in ((null, 0), (out, 1), (err, 2)):
            os.dup2(src, dst)
            os.close(src)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = request["argv"]
        extra = [os.path.abspath(p) for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        import runpy

        if argv[0] == "-m":  # python -m MODULE ARGS: the working directory first on sys.path, argv[0] the module's file
            sys.path[:] = _dedup([os.getcwd(), *extra, *base_path])
            sys.argv = ["-m", *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # python SCRIPT ARGS: the script's directory first, __main__ the script, argv[0] as given
            import types
            from importlib.machinery import SourceFileLoader

            path = os.path.abspath(argv[0])
            sys.path[:] = _dedup([os.path.dirname(os.path.realpath(path)), *extra, *base_path])
            sys.argv = list(argv)
            main = types.ModuleType("__main__")
            main.__dict__.update(__file__=path, __cached__=None, __spec__=None,
                                 __loader__=SourceFileLoader("__main__", path), __builtins__=__builtins__)
            sys.modules["__main__"] = main
            with open(path, "rb") as f:
                source = f.read()
            exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)  # noqa: S102 - the test's script
        code = 0
    except SystemExit as exit_:  # what the interpreter does with sys.exit(x)
        if exit_.code is None:
            code = 0
        elif isinstance(exit_.code, int):
            code = exit_.code
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:  # an uncaught exception: its traceback on stderr (from the script's frame on), status 1
        kind, value, tb = sys.exc_info()
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        sys.excepthook(kind, value, tb)
        code = 1
    finally:  # the interpreter's shutdown: wait for non-daemon threads, run atexit, flush the streams
        try:
            import atexit
            import threading

            for thread in threading.enumerate():
                if thread is not threading.main_thread() and not thread.daemon:
                    thread.join()
            atexit._run_exitfuncs()
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
        finally:
            os._exit(code)


def main() -> None:
    script_dir = sys.path.pop(0)  # this file's directory: not the children's
    assert os.path.samefile(script_dir, os.path.dirname(os.path.abspath(__file__))), script_dir
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path if p not in {os.path.abspath(q) for q in pythonpath} and p not in pythonpath]

    # What `python recipes/train.py` imports before it does anything (the seconds a fresh interpreter spends), in its
    # order (lightning_par's warning filters then come after torch's and Lightning's in warnings.filters, as there).
    import hydra  # noqa: F401
    import omegaconf  # noqa: F401

    import lightning_par  # noqa: F401  (torch, Lightning)
    import lightning_par.train  # noqa: F401

    ctl_in, ctl_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)  # anything printed here goes to the test session's stderr, never into the protocol
    running: dict[int, str] = {}  # child pid -> its status file
    buffer = b""
    with os.fdopen(ctl_out, "w", buffering=1) as answers:
        while True:
            ready, _, _ = select.select([ctl_in], [], [], 0.02)
            while running:  # reap the children that exited; their status for the caller
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                target = running.pop(pid, None)
                if target is not None:
                    try:
                        with open(target + ".tmp", "w") as f:
                            f.write(str(os.waitstatus_to_exitcode(status)))
                        os.replace(target + ".tmp", target)
                    except OSError:  # the caller is gone (its temporary directory removed): nobody reads it
                        pass
            if not ready:
                continue
            chunk = os.read(ctl_in, 65536)
            if not chunk:  # the session ended: wait for the children still running, then exit
                for pid in running:
                    os.waitpid(pid, 0)
                return
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    _child(request, base_path, (ctl_in, ctl_out))
                running[pid] = request["status"]
                answers.write(json.dumps({"pid": pid}) + "\n")


if __name__ == "__main__":
    main()
