"""`k3verify ...`: an argparse dispatcher over the modules in k3verify.commands.

Exit codes (design.md): 0 every check passed, 1 a check failed, 2 the run could not
be made (bad input) with a one-line reason on stderr.

Done here once for every command: --json puts exactly one JSON document on stdout and
everything else on stderr (commands.json_output); output locations (--report-dir, --out)
are refused before any work when they cannot be written or hold another run's report;
an OSError (a write that failed after all) is one line and exit 2, not a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import pkgutil
import sys
from types import ModuleType
from typing import Sequence

from optimized_stack.errors import K3Error

from k3verify import __version__, commands
from k3verify.errors import CheckFailed, UsageError
from k3verify.io import check_writable_dir, check_writable_file

PROG = "k3verify"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
# A reader of stdout that went away: quiet exit 1, as cat does and as rich's Console already does for
# the tables (on_broken_pipe), so every command ends the same way whichever writer met the pipe.
EXIT_BROKEN_PIPE = 1
_REQUIRED = ("NAME", "HELP", "add_arguments", "run")


def discover_commands() -> dict[str, ModuleType]:
    """NAME -> module for every public module in k3verify.commands, sorted by name.

    A module that fails to import or lacks the interface is a bug in that command,
    so it raises here rather than quietly vanishing from --help.
    """
    found: dict[str, ModuleType] = {}
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        missing = [attr for attr in _REQUIRED if not hasattr(module, attr)]
        if missing:
            raise TypeError(f"command module {module.__name__} must define {', '.join(_REQUIRED)}; missing {', '.join(missing)}")
        if module.NAME in found:
            raise TypeError(f"command name {module.NAME!r} defined twice: {found[module.NAME].__name__} and {module.__name__}")
        found[module.NAME] = module
    return found


def build_parser(cmds: dict[str, ModuleType]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Correctness and numerics gate for Kimi K3 inference. Exit 0 ok, 1 a check failed, 2 bad input.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in cmds.items():
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _first_positional(argv: Sequence[str]) -> str | None:
    """The command word: the global options (-h, --version) take no values, so it is the first non-option."""
    for arg in argv:
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return arg
    return None


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _unknown_command(word: str, known: Sequence[str]) -> int:
    close = difflib.get_close_matches(word, known, n=3, cutoff=0.5)
    if close:
        hint = "did you mean " + " or ".join(repr(c) for c in close) + "?"
    else:
        hint = "choose from " + ", ".join(known)
    return _error(f"unknown command {word!r}; {hint}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if sys.stdout is None:                  # started with fd 1 closed (`k3verify toggles >&-`), as cat refuses:
        # nothing has run, so nothing is lost; a file opened later could even take fd 1.
        return _error("stdout is closed: nothing could be printed (to discard the output: >/dev/null)")
    from optimized_stack.numerics import mkl_state
    if mkl_state().get("error"):            # a bad K3_MKL_CBWR: the reference's bits would be unpinned
        return _error(str(mkl_state()["error"]))
    cmds = discover_commands()
    parser = build_parser(cmds)

    word = _first_positional(argv)
    if word is not None and word not in cmds:
        return _unknown_command(word, list(cmds))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and argparse errors: keep main() returning an int
        return exc.code if isinstance(exc.code, int) else (EXIT_OK if exc.code is None else EXIT_USAGE)
    if args.command is None:
        parser.print_usage(sys.stderr)
        return _error("a command is required; choose from " + ", ".join(cmds))

    commands.record_argv(argv)
    json_mode = bool(getattr(args, "json", False))
    try:
        with commands.json_output(json_mode) as sink:
            check_outputs(args)
            code = args._run(args)
        sys.stdout.flush()                 # the real stdout again: a reader that went away shows here, not at exit
    except BrokenPipeError:                # `k3verify ... | head -1`: the reader has what it wanted
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except (K3Error, UsageError) as exc:
        return _error(_one_line(exc))
    except FileNotFoundError as exc:
        return _error(f"file not found: {exc.filename}" if exc.filename else _one_line(exc))
    except OSError as exc:                 # the environment, not the code: e.g. a disk that filled up
        where = f" ({exc.filename})" if exc.filename else ""
        return _error(f"{type(exc).__name__}: {exc.strerror or exc}{where}")
    except CheckFailed as exc:
        print(f"{PROG}: check failed: {_one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    if not isinstance(code, int) or code not in (EXIT_OK, EXIT_FAILED, EXIT_USAGE, 130):  # 130: Ctrl-C (serve)
        raise TypeError(f"command {args.command!r} must return 0, 1 or 2, got {code!r}")
    if sink is not None and code != EXIT_USAGE and sink.count != 1:
        raise TypeError(f"command {args.command!r} --json must print exactly one JSON document, printed {sink.count}")
    return code


def check_outputs(args) -> None:
    """Refuse output locations before any work, so a long run cannot die at its end.

    --report-dir (or the default reports/ it would go under) must be a writable directory,
    and a new run must not land in a directory that holds another run's report (the rule:
    k3verify.report.claim_report_dir; `all --resume` continues its own run). --out is a file."""
    from k3verify.report import claim_report_dir

    if hasattr(args, "report_dir"):
        check_writable_dir(args.report_dir or commands.REPORTS_DIR, "--report-dir")
        if args.report_dir is not None and not getattr(args, "resume", None):
            claim_report_dir(args.report_dir, None)
    if getattr(args, "out", None) is not None:
        check_writable_file(args.out, "--out")


def _quiet_stdout() -> None:
    """Point fd 1 at /dev/null, so the interpreter's last flush of a broken pipe is silent too
    (Python's documented recipe for SIGPIPE); a stdout without a file descriptor needs nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
