"""One side of `k3verify diff --base`: where its tree lives (git: REV in a temporary worktree,
or the checkout itself) and the process that runs it (driver.py with only that tree on
PYTHONPATH, this interpreter, so the same venv's packages)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import UsageError

DRIVER = Path(__file__).resolve().with_name("driver.py")
MERGE_BASE = "@merge-base"              # `--base` given without a value
MAIN_BRANCHES = ("main", "origin/main", "master", "origin/master")


# ---- git ------------------------------------------------------------------------------

def git(root: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        raise UsageError(f"git {' '.join(args)}: {exc}") from None
    if done.returncode != 0:
        msg = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise UsageError(f"git {' '.join(args)} in {root}: {msg}")
    return done.stdout.strip()


def checkout_root(repo: str | os.PathLike | None) -> Path:
    """The top of the git checkout holding `repo` (default: the current directory)."""
    start = Path(repo) if repo is not None else Path.cwd()
    if not start.is_dir():
        raise UsageError(f"--repo {start}: expected a directory inside a git checkout")
    try:
        return Path(git(start, "rev-parse", "--show-toplevel")).resolve()
    except UsageError:
        raise UsageError(f"{start.resolve()} is not inside a git checkout: `diff --base` compares the working "
                         f"tree with a git revision (pass --repo DIR)") from None


def resolve_base(root: Path, rev: str) -> dict[str, str]:
    """{"rev", "sha", "short", "how"}: the revision, or the merge base of HEAD with the main branch."""
    if rev == MERGE_BASE:
        for branch in MAIN_BRANCHES:
            try:
                git(root, "rev-parse", "--verify", "--quiet", f"{branch}^{{commit}}")
            except UsageError:
                continue
            sha = git(root, "merge-base", "HEAD", branch)
            return {"rev": sha, "sha": sha, "short": sha[:10], "how": f"merge base of HEAD with {branch}"}
        raise UsageError(f"--base: no main branch ({', '.join(MAIN_BRANCHES)}) in {root} to take the merge base "
                         f"with; pass --base REV")
    try:
        sha = git(root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except UsageError:
        raise UsageError(f"--base {rev!r}: not a commit of {root}") from None
    return {"rev": rev, "sha": sha, "short": sha[:10], "how": f"--base {rev}"}


def git_blob(root: Path, sha: str, path: str) -> bytes | None:
    done = subprocess.run(["git", "-C", str(root), "cat-file", "blob", f"{sha}:{path}"], capture_output=True)
    return done.stdout if done.returncode == 0 else None


@contextlib.contextmanager
def rev_worktree(root: Path, sha: str, scratch: Path) -> Iterator[Path]:
    """REV checked out in a detached temporary worktree; removed again whatever happens."""
    path = scratch / "rev"
    git(root, "worktree", "add", "--detach", "--quiet", str(path), sha)
    try:
        yield path
    finally:
        try:
            git(root, "worktree", "remove", "--force", str(path))
        except UsageError:
            shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(UsageError):
                git(root, "worktree", "prune")


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (a CI job's timeout) unwinds like Ctrl-C, so REV's worktree is still removed."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---- one tree's worker ------------------------------------------------------------------

class TreeWorker:
    """driver.py in its own interpreter with `tree` (only) on PYTHONPATH."""

    def __init__(self, tree: Path, where: str, model: str | None, device: str, log: Path,
                 progress: Callable[[str], None]):
        self.where, self.progress, self.log_path = where, progress, log
        env = {**os.environ, "PYTHONPATH": str(tree)}
        spec = {"tree": str(tree), "model": model, "device": device}
        self._log = open(log, "w", encoding="utf-8")
        self.proc = subprocess.Popen([sys.executable, "-P", str(DRIVER), json.dumps(spec)], cwd=tree, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self._answer()

    def _answer(self, on_unit: Callable[[str], None] | None = None) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait(timeout=30)
                self._log.flush()
                tail = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()][-1:]
                raise UsageError(f"{self.where}: the patch-diff worker exited ({self.proc.returncode}): "
                                 f"{tail[0] if tail else 'no output'}")
            msg = json.loads(line)
            if "unit_done" in msg:
                if on_unit:
                    on_unit(msg["unit_done"])
                continue
            if "progress" in msg:
                self.progress(f"{self.where}: {msg['progress']}")
                continue
            if not msg.get("ok"):
                if msg.get("kind") == "api":
                    raise UsageError(f"{self.where} lacks the API `diff --base` needs: {msg['message']}")
                raise UsageError(f"{self.where}: {msg.get('message')}")
            return msg

    def request(self, cmd: str, on_unit: Callable[[str], None] | None = None, **kw: Any) -> dict:
        """One request; `on_unit(id)` is called as each captured unit lands on disk."""
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._answer(on_unit)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.close()
            try:                             # an idle worker exits at once; a busy one is interrupted
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
