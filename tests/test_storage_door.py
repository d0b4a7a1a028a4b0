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
# module -> its functions that open, load, copy or move a file by its path (issue 71, item 1: the check saw only
# open(); `Image.open` hung `jagg report` on a FIFO, a PNG declaring 30000 x 30000 pixels was a traceback).
LOADERS = {
    "Image": {"open"}, "PIL.Image": {"open"}, "torch": {"load"}, "np": {"load", "fromfile"},
    "numpy": {"load", "fromfile"}, "pickle": {"load"}, "json": {"load"}, "sqlite3": {"connect"},
    "tarfile": {"open"}, "gzip": {"open"}, "bz2": {"open"}, "lzma": {"open"}, "zipfile": {"ZipFile"},
    "shutil": {"copy", "copy2", "copyfile", "copyfileobj", "copytree", "move"}, "os": {"replace", "rename", "renames"},
}
BARE = {"safe_open", "load_file", "save_file"}  # safetensors' readers and writer by a path, imported by name
# A loader given what the door already opened or read is the door's: its first argument a call of one of these, or
# a name a `with open_regular(...) as f:` bound.
DOOR = {"read_regular", "read_text", "read_head", "read_from", "open_regular", "BytesIO"}

# (file, function, call) -> why that call may touch a file itself. At most 6 entries.
ALLOWED = {
    # /proc/self/clear_refs written with "5" to reset the process's peak RSS (VmHWM) before a memory probe: a kernel
    # control file, written in place by definition (an atomic replace would create a new file beside it, which the
    # kernel never reads), and no link can be planted in /proc/self
    ("jagg_core/bench/memory.py", "_reset_peak_rss", ".write_text()"): "a kernel control file: written in place, never "
                                                                "replaced",
    # RoundStore.open is jagg's own method (bench/rounds.py), not a file's: it takes the rounds folder's FolderLock
    # and reads the kept rounds through storage.read_regular
    ("jagg_core/bench/run.py", "_run_bench", ".open()"): "RoundStore.open: a method of jagg's, reading through storage",
    # safetensors' safe_open takes only a path (memory-mapped, one tensor at a time, for weights as large as the
    # model); check_checkpoint lstat's the file as a regular file of the manifest's size and hashes it just before
    ("jagg_core/trainer/checkpoint.py", "_finite_safetensors", "safe_open()"): "a path only; lstat'ed and hashed "
                                                                               "first",
}
# Calls of a whole family that jagg cannot route, each with its reason.
FAMILY_EXCEPTIONS = {
    # diffusers' and transformers' loaders of a model folder open its files themselves and take only its path; a
    # folder may be a Hugging Face snapshot of links into the cache. build.check_model_files checks the folder's
    # files (present, complete) before any worker starts; jagg's own weights (checkpoints, exports) are read by the
    # door.
    ".from_pretrained()": "third-party loaders of a model folder: a path only; the folder is checked first",
}


def _name(node: ast.AST) -> str | None:
    """``a.b.c`` of a dotted name, or None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _name(node.value)):
        return f"{base}.{node.attr}"
    return None


def _touches(call: ast.Call) -> str | None:
    """The file-touching call ``call`` is, by the rule's name for it, or None."""
    f = call.func
    if isinstance(f, ast.Name):
        return "open()" if f.id == "open" else f"{f.id}()" if f.id in BARE else None
    if not isinstance(f, ast.Attribute):
        return None
    owner = _name(f.value)
    if f.attr in LOADERS.get(owner, ()):
        return f"{owner}.{f.attr}()"
    if f.attr == "open" and owner in MODULES:
        return f"{owner}.open()"
    if f.attr in METHODS or f.attr in ("open", "rename") or f.attr in BARE:  # Path.open, Path.rename, st.safe_open
        return f".{f.attr}()"
    if f.attr == "from_pretrained":
        return ".from_pretrained()"
    return None


def _door_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and (_name(node.func) or "").rsplit(".", 1)[-1] in DOOR


def file_touches(root: Path = REPO) -> list[tuple[str, int, str, str]]:
    """(file, line, function, call) of every file-touching call outside storage.py in jagg_core, tasks and flows."""
    found = []
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel == STORAGE:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), rel)

            def walk(node: ast.AST, function: str, opened: frozenset) -> None:
                for child in ast.iter_child_nodes(node):
                    inner, names = function, opened
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        inner, names = child.name, frozenset()
                    if isinstance(child, (ast.With, ast.AsyncWith)):
                        names = names | {i.optional_vars.id for i in child.items if _door_call(i.context_expr)
                                         and isinstance(i.optional_vars, ast.Name)}
                    if isinstance(child, ast.Call) and (what := _touches(child)):
                        first = child.args[0] if child.args else None
                        through_door = _door_call(first) or isinstance(first, ast.Name) and first.id in names
                        if not (through_door and what != "open()"):
                            found.append((rel, child.lineno, function, what))
                    walk(child, inner, names)

            walk(tree, "<module>", frozenset())
    return found


def test_every_file_touch_goes_through_storage():
    """No open / os.open / io.open / read_text / read_bytes / write_text / write_bytes, no Path.open, Image.open,
    torch.load, np.load, pickle.load, json.load(f), sqlite3.connect, tarfile / gzip / bz2 / lzma.open, ZipFile,
    shutil.copy* / move, os.replace / rename, Path.rename, safetensors' safe_open / load_file / save_file on a path
    outside storage.py but the short lists above, each with its reason: storage's reader is bounded and regular (a
    FIFO does not block), its writer atomic and never through a link, its appender and lock opener O_NOFOLLOW and
    regular-checked, its image reader pixel-bounded, its renames held inside the project; a loader is given what the
    door opened (``with storage.open_regular(path, ...) as f: torch.load(f)``) or read."""
    assert len(ALLOWED) <= 6, "the allow-list is at most 6 entries; route a call through storage.py instead"
    bad = [f"{rel}:{line}: {what} in {function}() touches a file outside jagg_core/setup/storage.py; read through "
           f"storage.read_regular/read_text/open_regular/open_image, write through storage.atomic_write_*, append "
           f"through storage.append_bytes/open_append, rename with storage.move, copy with storage.copy_file/"
           f"copy_tree, open a lock file with storage.open_lock_file"
           for rel, line, function, what in file_touches()
           if (rel, function, what) not in ALLOWED and what not in FAMILY_EXCEPTIONS]
    assert not bad, "\n".join(bad)


def test_allow_list_names_only_calls_that_exist():
    """An entry whose call has been routed goes from the list (the list only shrinks)."""
    used = {(rel, function, what) for rel, _, function, what in file_touches()}
    assert not set(ALLOWED) - used, f"allow-list entries with no file-touching call left: {set(ALLOWED) - used}"


def test_the_check_finds_each_kind_of_call(tmp_path):
    """The walk sees each form the rule names (not a check that passes because it sees nothing), and a loader
    given what the door opened or read passes."""
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "x.py").write_text(
        "import os, io\nfrom pathlib import Path\n"
        "def f(p):\n    open(p)\n    os.open(p, 0)\n    io.open(p)\n    Path(p).read_text()\n"
        "    Path(p).read_bytes()\n    Path(p).write_text('')\n    Path(p).write_bytes(b'')\n"
        "class C:\n    def g(self, p):\n        return open(p)\n"
        "def h(p, q):\n    Path(p).open()\n    Image.open(p)\n    PIL.Image.open(p)\n    torch.load(p)\n"
        "    np.load(p)\n    numpy.load(p)\n    json.load(p)\n    pickle.load(p)\n    sqlite3.connect(p)\n"
        "    tarfile.open(p)\n    gzip.open(p)\n    zipfile.ZipFile(p)\n    shutil.copy(p, q)\n"
        "    shutil.copytree(p, q)\n    shutil.move(p, q)\n    os.replace(p, q)\n    os.rename(p, q)\n"
        "    Path(p).rename(q)\n    safe_open(p, 'pt')\n    load_file(p)\n    X.from_pretrained(p)\n"
        "def door(p):\n    with storage.open_regular(p, E) as f:\n        torch.load(f)\n        json.load(f)\n"
        "    Image.open(io.BytesIO(b''))\n    st_load(read_regular(p, E))\n    torch.load(BytesIO(b''))\n"
        "    torch.load(g)\n")
    got = [(line, function, what) for _, line, function, what in file_touches(tmp_path)]
    assert got == [(4, "f", "open()"), (5, "f", "os.open()"), (6, "f", "io.open()"), (7, "f", ".read_text()"),
                   (8, "f", ".read_bytes()"), (9, "f", ".write_text()"), (10, "f", ".write_bytes()"),
                   (13, "g", "open()"), (15, "h", ".open()"), (16, "h", "Image.open()"),
                   (17, "h", "PIL.Image.open()"), (18, "h", "torch.load()"), (19, "h", "np.load()"),
                   (20, "h", "numpy.load()"), (21, "h", "json.load()"), (22, "h", "pickle.load()"),
                   (23, "h", "sqlite3.connect()"), (24, "h", "tarfile.open()"), (25, "h", "gzip.open()"),
                   (26, "h", "zipfile.ZipFile()"), (27, "h", "shutil.copy()"), (28, "h", "shutil.copytree()"),
                   (29, "h", "shutil.move()"), (30, "h", "os.replace()"), (31, "h", "os.rename()"),
                   (32, "h", ".rename()"), (33, "h", "safe_open()"), (34, "h", "load_file()"),
                   (35, "h", ".from_pretrained()"), (43, "door", "torch.load()")]


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
