"""One door for files (issue 61, mechanism 1): every read, write, append and lock file of jagg_core, tasks and flows
goes through jagg_core/setup/storage.py, checked here by walking their source (ast), and storage's helpers refuse a
planted link, a FIFO (without blocking) and a device in one sentence."""

from __future__ import annotations

import ast
import fcntl
import os
from pathlib import Path

import pytest

from jagg_core.setup import storage

REPO = Path(__file__).resolve().parents[1]
STORAGE = "jagg_core/setup/storage.py"
SCANNED = ("jagg_core", "tasks", "flows")
METHODS = {"read_text", "read_bytes", "write_text", "write_bytes"}  # pathlib's: no bound, no regular-file check
MODULES = {"os", "io", "builtins", "codecs"}  # os.open, io.open, builtins.open, codecs.open

# (file, function) -> why that call may touch a file itself. At most 6 entries.
ALLOWED = {
    # /proc/self/clear_refs written with "5" to reset the process's peak RSS (VmHWM) before a memory probe: a kernel
    # control file, written in place by definition (an atomic replace would create a new file beside it, which the
    # kernel never reads), and no link can be planted in /proc/self
    ("jagg_core/bench/memory.py", "_reset_peak_rss"): "a kernel control file: written in place, never replaced",
}


def _touches(call: ast.Call) -> str | None:
    """The file-touching call ``call`` is, by the rule's name for it, or None."""
    f = call.func
    if isinstance(f, ast.Name) and f.id == "open":
        return "open()"
    if isinstance(f, ast.Attribute):
        if f.attr in METHODS:
            return f".{f.attr}()"
        if f.attr == "open" and isinstance(f.value, ast.Name) and f.value.id in MODULES:
            return f"{f.value.id}.open()"
    return None


def file_touches(root: Path = REPO) -> list[tuple[str, int, str, str]]:
    """(file, line, function, call) of every file-touching call outside storage.py in jagg_core, tasks and flows."""
    found = []
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel == STORAGE:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), rel)

            def walk(node: ast.AST, function: str) -> None:
                for child in ast.iter_child_nodes(node):
                    inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
                    if isinstance(child, ast.Call) and (what := _touches(child)):
                        found.append((rel, child.lineno, function, what))
                    walk(child, inner)

            walk(tree, "<module>")
    return found


def test_every_file_touch_goes_through_storage():
    """No open / os.open / io.open / read_text / read_bytes / write_text / write_bytes outside storage.py but the
    short list above, each with its reason: storage's reader is bounded and regular (a FIFO does not block), its
    writer atomic and never through a link, its appender and lock opener O_NOFOLLOW and regular-checked."""
    assert len(ALLOWED) <= 6, "the allow-list is at most 6 entries; route a call through storage.py instead"
    bad = [f"{rel}:{line}: {what} in {function}() touches a file outside jagg_core/setup/storage.py; read through "
           f"storage.read_regular/read_text, write through storage.atomic_write_*, append through "
           f"storage.append_bytes/open_append, open a lock file with storage.open_lock_file"
           for rel, line, function, what in file_touches() if (rel, function) not in ALLOWED]
    assert not bad, "\n".join(bad)


def test_allow_list_names_only_calls_that_exist():
    """An entry whose call has been routed goes from the list (the list only shrinks)."""
    used = {(rel, function) for rel, _, function, _ in file_touches()}
    assert not set(ALLOWED) - used, f"allow-list entries with no file-touching call left: {set(ALLOWED) - used}"


def test_the_check_finds_each_kind_of_call(tmp_path):
    """The walk sees each form the rule names (not a check that passes because it sees nothing)."""
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "x.py").write_text(
        "import os, io\nfrom pathlib import Path\n"
        "def f(p):\n    open(p)\n    os.open(p, 0)\n    io.open(p)\n    Path(p).read_text()\n"
        "    Path(p).read_bytes()\n    Path(p).write_text('')\n    Path(p).write_bytes(b'')\n"
        "class C:\n    def g(self, p):\n        return open(p)\n")
    got = [(line, function, what) for _, line, function, what in file_touches(tmp_path)]
    assert got == [(4, "f", "open()"), (5, "f", "os.open()"), (6, "f", "io.open()"), (7, "f", ".read_text()"),
                   (8, "f", ".read_bytes()"), (9, "f", ".write_text()"), (10, "f", ".write_bytes()"),
                   (13, "g", "open()")]


# --- storage's helpers: a planted link, a FIFO, a device ---------------------------------------------------------

class Refused(Exception):
    pass


def within(seconds: float, fn):
    """``fn()``'s result (or its exception, raised here) from a forked child with a deadline and a memory bound: a
    call still blocked after ``seconds`` (a FIFO waited on) fails the test and the child is killed; one that reads
    without end (/dev/zero) meets a MemoryError at 1 GiB more than the process holds, not the machine's memory."""
    import pickle
    import resource
    import select
    import signal
    import time

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no return from here
        try:
            os.close(r)
            try:
                vm = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                          if line.startswith("VmSize:")) * 1024
                resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
                out = ("value", fn())
            except BaseException as e:  # noqa: BLE001
                out = ("error", e)
            try:
                data = pickle.dumps(out)
            except Exception:  # noqa: BLE001  (an exception that does not pickle: its type and sentence)
                data = pickle.dumps(("error", RuntimeError(f"{type(out[1]).__name__}: {out[1]}")))
            with os.fdopen(w, "wb") as f:
                f.write(data)
        finally:
            os._exit(0)
    os.close(w)
    deadline, data = time.monotonic() + seconds, b""
    with os.fdopen(r, "rb", buffering=0) as f:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([f], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"blocked for more than {seconds} s (a FIFO waited on?)")
            chunk = f.read(1 << 16)
            if not chunk:
                break
            data += chunk
    os.waitpid(pid, 0)
    if not data:
        pytest.fail("the child died without an answer")
    kind, value = pickle.loads(data)
    if kind == "error":
        raise value
    return value


def test_lock_file_refuses_a_link_and_a_fifo(tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("precious\n")
    os.symlink(target, tmp_path / "a.lock")
    with pytest.raises(Refused, match="is a symbolic link"):
        storage.open_lock_file(tmp_path / "a.lock", Refused)
    assert target.read_text() == "precious\n"
    os.mkfifo(tmp_path / "b.lock")
    with pytest.raises(Refused, match="not a regular file"):
        within(5, lambda: storage.open_lock_file(tmp_path / "b.lock", Refused))
    fd = storage.open_lock_file(tmp_path / "c.lock", Refused)  # created, a regular file that flock takes
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert (tmp_path / "c.lock").is_file()
    finally:
        os.close(fd)


def test_append_refuses_a_link_and_a_fifo(tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("precious\n")
    os.symlink(target, tmp_path / "log")
    with pytest.raises(Refused, match="is a symbolic link"):
        storage.append_bytes(tmp_path / "log", b"x\n", Refused)
    assert target.read_text() == "precious\n"
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(Refused, match="not a regular file"):
        within(5, lambda: storage.append_bytes(tmp_path / "fifo", b"x\n", Refused))
    storage.append_bytes(tmp_path / "new.jsonl", b"a\n", Refused)
    storage.append_bytes(tmp_path / "new.jsonl", b"b\n", Refused)
    assert (tmp_path / "new.jsonl").read_bytes() == b"a\nb\n"
    with storage.open_append(tmp_path / "new.jsonl", Refused) as f:
        f.write(b"c\n")
    assert (tmp_path / "new.jsonl").read_bytes() == b"a\nb\nc\n"


def test_readers_refuse_a_fifo_and_a_device(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    for read in (lambda p: storage.read_text(p, Refused), lambda p: storage.read_head(p, 16, Refused),
                 lambda p: storage.file_sha256(p, Refused)):
        with pytest.raises(Refused, match="not a regular file"):
            within(5, lambda: read(tmp_path / "fifo"))
        with pytest.raises(Refused, match="not a regular file"):
            within(5, lambda: read(Path("/dev/zero")))
    (tmp_path / "real").write_bytes(b"x")
    os.symlink(tmp_path / "real", tmp_path / "link")
    # a read follows a link to a regular file, as read_regular does (a store or a model kept on another disk)
    assert storage.read_text(tmp_path / "link", Refused) == "x" and storage.read_head(tmp_path / "link", 1, Refused)
    assert storage.file_sha256(tmp_path / "link", Refused) == storage.file_sha256(tmp_path / "real", Refused)
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(Refused, match="is not UTF-8 text"):
        storage.read_text(tmp_path / "bad.txt", Refused)
    (tmp_path / "db").write_bytes(b"SQLite format 3\x00" + b"\0" * 100)
    assert storage.read_head(tmp_path / "db", 16, Refused) == b"SQLite format 3\x00"
    import hashlib
    assert storage.file_sha256(tmp_path / "db", Refused) == hashlib.sha256((tmp_path / "db").read_bytes()).hexdigest()


def test_read_regular_with_a_large_limit_reads_the_file_not_the_limit(tmp_path):
    """A limit as large as a checkpoint's weights (4 TiB) reads a small file whole without a buffer of the limit's
    size (the read asked for limit + 1 bytes at once); /proc's files, of size 0 in stat, are read whole too."""
    (tmp_path / "w").write_bytes(b"x" * 100_000)
    assert storage.read_regular(tmp_path / "w", Refused, limit=1 << 42) == b"x" * 100_000
    assert b"Name:" in storage.read_regular("/proc/self/status", Refused)
    with pytest.raises(Refused, match="larger than 99,999 bytes"):
        storage.read_regular(tmp_path / "w", Refused, limit=99_999)
