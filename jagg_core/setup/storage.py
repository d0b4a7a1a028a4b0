"""Shared file I/O of every stage: atomic file writes, the atomic folder swap, and prompt files.

One home, so the trainer, evaluation, the report, the bench, the world and the tasks all write the same way: a file
appears whole or not at all (temporary file in the same folder, fsync, ``os.replace``, the permissions of any
file the process writes), and a folder is replaced so that a complete copy is in place at every moment.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..errors import UserError
from .json_parse import parse_json
from .paths import held



__all__ = [
    "FolderLock",
    "MAX_READ_BYTES",
    "append_bytes",
    "file_sha256",
    "MAX_IMAGE_PIXELS",
    "move",
    "open_append",
    "open_image",
    "open_lock_file",
    "open_regular",
    "copy_tree",
    "read_head",
    "read_from",
    "read_regular",
    "read_text",
    "paths_digest",
    "read_score_records",
    "json_lines",
    "finite_json",
    "base_model_digest",
    "folder_digest",
    "LockedError",
    "PromptFileError",
    "atomic_write_bytes",
    "atomic_write_text",
    "copy_file",
    "read_prompt_json",
    "read_prompt_list",
    "read_prompts",
    "replace_dir",
    "temp_dir",
    "write_prompts_jsonl",
]

_UMASK = os.umask(0o022)
os.umask(_UMASK)

# What a stage reads (params, prompt files, a run's buffered metrics, a worker's outcome, evaluations' scores, a
# report's summaries, checkpoint manifests) is a regular file of bounded size: /dev/zero would be read until memory
# ran out, a FIFO would block for ever.
MAX_READ_BYTES = 256 << 20


class PromptFileError(UserError, ValueError):
    """A prompt file that cannot be read: missing, not UTF-8, malformed or empty. The message is for the user."""


class LockedError(UserError, RuntimeError):
    """Another process holds the folder's lock; the message names it."""


class FolderLock:
    """An exclusive lock on a folder (``<folder>/.lock``, ``flock``): one writer per run.

    The kernel releases the lock when its holder dies, so a stale lock file of a dead process is simply taken over;
    the file records the holder's pid and host for the message the next writer gets.
    """

    def __init__(self, folder: str | os.PathLike, what: str):
        self.path = Path(folder) / ".lock"
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> "FolderLock":
        import fcntl
        import socket

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_lock_file(self.path, LockedError, fix="remove it, then run again")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise LockedError(f"{self.what} is already being written by {holder} (lock {self.path}); wait for it to "
                              f"finish or stop it, then run again.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _open_regular(path: Path, flags: int, error: type[Exception], fix: str, create_mode: int = 0o666, *,
                  follow: bool = True) -> int:
    """A descriptor of the regular file ``path`` opened with ``flags``: for writing never through a link at ``path``
    itself (``O_NOFOLLOW``; a read follows one, as :func:`read_regular` does, unless not ``follow``), never blocking
    (``O_NONBLOCK``: a FIFO there is refused, not waited on), checked on the open descriptor (``fstat``: a device, a
    FIFO, a socket or a folder is refused), its folder held inside the project (``paths.held``), else one ``error``
    sentence."""
    import errno
    import stat

    tail = f"; {fix}" if fix else ""
    writes = flags & (os.O_WRONLY | os.O_RDWR)
    held(path.parent)
    try:
        nofollow = os.O_NOFOLLOW if writes or not follow else 0
        fd = os.open(path, flags | nofollow | os.O_NONBLOCK | os.O_CLOEXEC, create_mode)
    except FileNotFoundError:
        raise error(f"{path} does not exist{tail}.") from None
    except IsADirectoryError:
        raise error(f"{path} is a folder, not a file{tail}.") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise error(f"{path} is a symbolic link, which jagg does not {'write' if writes else 'read'} through"
                        f"{tail}.") from None
        if e.errno == errno.ENXIO:  # a FIFO opened for writing with no reader
            raise error(f"{path} is not a regular file (a device, a FIFO or a socket){tail}.") from None
        raise error(f"{path} cannot be opened ({e.strerror or e}){tail}.") from None
    try:
        info = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise error(f"{path} cannot be opened ({e.strerror or e}){tail}.") from None
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        if stat.S_ISDIR(info.st_mode):
            raise error(f"{path} is a folder, not a file{tail}.")
        raise error(f"{path} is not a regular file (a device, a FIFO or a socket){tail}.")
    return fd


def open_lock_file(path: str | os.PathLike, error: type[Exception], *, fix: str = "") -> int:
    """A read-write descriptor of the lock file ``path`` (created 0644 if absent) for ``flock``: a regular file,
    never a link's target (a link planted there would have its target truncated and written) and never a FIFO (the
    open would block), else one ``error`` sentence."""
    return _open_regular(Path(path), os.O_RDWR | os.O_CREAT, error, fix, 0o644)


def open_append(path: str | os.PathLike, error: type[Exception], *, fix: str = ""):  # noqa: ANN201  (BinaryIO)
    """``path`` opened to append bytes (created with any written file's permissions), a regular file and never
    through a link (a log planted as a link would have its target appended to), else one ``error`` sentence; for a
    child process's log. The caller closes it."""
    return os.fdopen(_open_regular(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, error, fix), "ab")


def append_bytes(path: str | os.PathLike, data: bytes, error: type[Exception], *, fix: str = "") -> None:
    """The project's one way to append to a file (a log of records, e.g. the buffered MLflow metrics): ``data`` at the
    end of the regular file ``path`` (created if absent; never through a link, never a FIFO), fsynced; else one
    ``error`` sentence."""
    with open_append(path, error, fix=fix) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, mode: int | None = None) -> None:
    """The project's one way to write a file: ``data`` into a new temporary file in ``path``'s folder (created with
    ``O_CREAT | O_EXCL | O_NOFOLLOW``: never an existing file, never through a link), fsynced, then renamed over
    ``path``. The rename replaces whatever is at ``path`` — a symlink planted there is replaced, never followed — and
    a reader sees the old file or the new one whole. ``mode``: the file's permissions (default: any written file's,
    0666 less the umask; 0600 for what only its owner may read)."""
    path = Path(path)
    held(path.parent)  # a folder that a link leads out of the project is refused before anything is made in it
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # O_EXCL | O_NOFOLLOW
    try:
        os.fchmod(fd, 0o666 & ~_UMASK if mode is None else mode)  # mkstemp makes 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str, *, mode: int | None = None) -> None:
    atomic_write_bytes(path, text.encode(), mode=mode)


def copy_file(src: str | os.PathLike, dest: str | os.PathLike, error: type[Exception], *,
              limit: int = MAX_READ_BYTES) -> None:
    """``src`` (read as :func:`read_regular` reads: a bounded regular file, else one ``error`` sentence) written to
    ``dest`` by :func:`atomic_write_bytes`: a link planted at ``dest`` is replaced, not written through."""
    atomic_write_bytes(dest, read_regular(src, error, limit=limit))


def copy_tree(src: str | os.PathLike, dest: str | os.PathLike, error: type[Exception], *,
              limit: int = 1 << 34) -> None:
    """The folder ``src`` copied to the new folder ``dest``: each file read as :func:`open_regular` reads (a regular
    file, never a link, at most ``limit`` bytes: a FIFO would block ``shutil.copytree``, a link to /dev/zero fill the
    disk), written by :func:`atomic_write_bytes`; else one ``error`` sentence."""
    src, dest = Path(src), Path(dest)
    for path in sorted(src.rglob("*")):
        if path.is_dir() and not path.is_symlink():
            held(dest / path.relative_to(src)).mkdir(parents=True, exist_ok=True)
            continue
        with open_regular(path, error, limit=limit, follow=False) as f:
            atomic_write_bytes(dest / path.relative_to(src), f.read())


def move(src: str | os.PathLike, dest: str | os.PathLike) -> None:
    """``os.replace(src, dest)``, the project's one rename: ``dest``'s folder held inside the project (a rename never
    follows a link at ``dest`` itself: it replaces it)."""
    os.replace(src, held(Path(dest).parent) / Path(dest).name)


def temp_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """A new empty folder in ``parent`` (for :func:`replace_dir`), with the permissions of any folder the process makes
    (``mkdtemp`` makes 0700: a checkpoint or a base model whose files are 0644 in a folder only its owner can open)."""
    tmp = Path(tempfile.mkdtemp(dir=held(parent), prefix=prefix))
    os.chmod(tmp, 0o777 & ~_UMASK)
    return tmp


def replace_dir(src: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Move the complete folder ``src`` to ``dest`` (same file system), replacing what is there.

    The previous ``dest`` is renamed aside first and put back if the second rename fails, so one complete copy is
    in place at every moment; it is deleted only once ``src`` is in place.
    """
    src, dest = Path(src), held(Path(dest).parent) / Path(dest).name
    if not dest.exists():
        os.replace(src, dest)
        return
    trash = dest.parent / f".trash-{dest.name}-{os.getpid()}"
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(dest, trash)
    try:
        os.replace(src, dest)
    except BaseException:
        os.replace(trash, dest)
        raise
    shutil.rmtree(trash, ignore_errors=True)


def read_regular(path: str | os.PathLike, error: type[Exception], *, limit: int = MAX_READ_BYTES,
                 fix: str = "") -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes (checked on the open descriptor, opened
    without blocking), or one ``error`` sentence naming it: missing, a folder, a device, a FIFO or a socket,
    too large, unreadable. ``fix`` is appended to each sentence (what to do)."""
    import stat

    path = Path(path)
    tail = f"; {fix}" if fix else ""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise error(f"{path} does not exist{tail}.") from None
    except IsADirectoryError:
        raise error(f"{path} is a folder, not a file{tail}.") from None
    except OSError as e:
        raise error(f"{path} cannot be read ({e.strerror or e}){tail}.") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise error(f"{path} is a folder, not a file{tail}.")
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{path} is not a regular file (a device, a FIFO or a socket){tail}.")
        if info.st_size > limit:
            raise error(f"{path} is larger than {limit:,} bytes, more than such a file holds{tail}.")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            # read to the end, never more than limit + 1 bytes, never a buffer of `limit` bytes at once (a limit as
            # large as a checkpoint's weights); /proc's files say size 0 and hold more
            chunks, total = [], 0
            while total <= limit:
                chunk = f.read(min(limit + 1 - total, max(info.st_size - total, 0) + (1 << 16)))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
            data = b"".join(chunks)
    except OSError as e:
        raise error(f"{path} cannot be read ({e.strerror or e}){tail}.") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > limit:
        raise error(f"{path} is larger than {limit:,} bytes, more than such a file holds{tail}.")
    return data


def read_text(path: str | os.PathLike, error: type[Exception], *, limit: int = MAX_READ_BYTES, fix: str = "") -> str:
    """:func:`read_regular`'s bytes as UTF-8 text, or one ``error`` sentence (not UTF-8 included)."""
    try:
        return read_regular(path, error, limit=limit, fix=fix).decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{path} is not UTF-8 text{'; ' + fix if fix else ''}.") from None


def read_head(path: str | os.PathLike, size: int, error: type[Exception], *, fix: str = "") -> bytes:
    """The first ``size`` bytes (fewer if the file is shorter) of the regular file ``path``, whatever its length (a
    database's header), opened as :func:`read_regular` opens: never blocking, a FIFO or a device one sentence."""
    return read_from(path, 0, size, error, fix=fix)


def read_from(path: str | os.PathLike, offset: int, size: int, error: type[Exception], *, fix: str = "") -> bytes:
    """At most ``size`` bytes of the regular file ``path`` from byte ``offset`` on (fewer where it ends sooner: a file
    another process appends to, read as it grows), opened as :func:`read_regular` opens: never blocking, a FIFO or a
    device one sentence."""
    fd = _open_regular(Path(path), os.O_RDONLY, error, fix)
    try:
        return os.pread(fd, size, offset)
    except OSError as e:
        raise error(f"{path} cannot be read ({e.strerror or e}){'; ' + fix if fix else ''}.") from None
    finally:
        os.close(fd)


def file_sha256(path: str | os.PathLike, error: type[Exception], *, fix: str = "") -> str:
    """The SHA-256 of the regular file ``path`` (any size: read in 1 MiB blocks), opened as :func:`read_head` opens,
    or one ``error`` sentence."""
    fd = _open_regular(Path(path), os.O_RDONLY, error, fix)
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "rb") as f:
            fd = -1
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError as e:
        raise error(f"{path} cannot be read ({e.strerror or e}){'; ' + fix if fix else ''}.") from None
    finally:
        if fd >= 0:
            os.close(fd)
    return h.hexdigest()


def open_regular(path: str | os.PathLike, error: type[Exception], *, limit: int = MAX_READ_BYTES, fix: str = "",
                 follow: bool = True):  # noqa: ANN201  (BinaryIO)
    """``path`` opened to read, as a file object for a loader that takes one (``torch.load``, ``json.load``, safetensors'
    ``load``): the regular file :func:`read_regular` would read (never blocking, at most ``limit`` bytes by ``fstat``,
    its folder held inside the project), a link at ``path`` followed only where ``follow``; else one ``error``
    sentence. The caller closes it (``with``)."""
    fd = _open_regular(Path(path), os.O_RDONLY, error, fix, follow=follow)
    size = os.fstat(fd).st_size
    if size > limit:
        os.close(fd)
        raise error(f"{path} is larger than {limit:,} bytes, more than such a file holds{'; ' + fix if fix else ''}.")
    return os.fdopen(fd, "rb")


# An image's pixels (width x height) at most: a 67-byte PNG declaring 30000 x 30000 was a DecompressionBombError
# traceback (PIL warns at 89 M pixels and raises at 179 M); 8192 x 8192 is four times the largest image jagg makes.
MAX_IMAGE_PIXELS = 1 << 26


def open_image(path: str | os.PathLike, error: type[Exception], *, max_pixels: int = MAX_IMAGE_PIXELS,
               limit: int = 64 << 20, fix: str = ""):  # noqa: ANN201  (PIL.Image.Image)
    """The image file ``path`` as a loaded RGB PIL image: a regular file of at most ``limit`` bytes, never a link (an
    image linked to a file outside the project was scored as the model's own) and never blocking (a FIFO hung the
    report), its folder held inside the project, declaring at most ``max_pixels`` pixels (checked on its header,
    before it is decoded); else one ``error`` sentence."""
    import warnings

    from PIL import Image

    tail = f"; {fix}" if fix else ""
    with open_regular(path, error, limit=limit, fix=fix, follow=False) as f:
        data = f.read()
    too_many = f"more than the {max_pixels:,} pixels an image may have{tail}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit below says it
            im = Image.open(io.BytesIO(data))
            w, h = im.size
            if w * h <= max_pixels:
                return im.convert("RGB")
    except Image.DecompressionBombError:
        raise error(f"{path} declares more pixels than PIL decodes, {too_many}.") from None
    except Image.UnidentifiedImageError:  # its message names the in-memory buffer, not the file
        raise error(f"{path} is not a readable image (not a format PIL knows){tail}.") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:  # truncated, damaged
        raise error(f"{path} is not a readable image ({type(e).__name__}: {str(e)[:200]}){tail}.") from None
    raise error(f"{path} declares {w} x {h} pixels, {too_many}.")


def read_prompts(path: str | os.PathLike) -> list[str]:
    """Prompts of a ``.jsonl`` file of ``{"prompt": ...}`` lines (or a ``.txt`` file, one per line)."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise PromptFileError(f"the prompt file {path} does not exist; run the prepare stage (`jagg prepare`).")
    try:
        lines = read_regular(path, PromptFileError, fix="regenerate it with `jagg prepare`").decode(
            "utf-8").splitlines()
    except UnicodeDecodeError:
        raise PromptFileError(f"{path} is not UTF-8 text.") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                obj = parse_json(line, ValueError, f"{path}:{n}")
                prompt = obj["prompt"] if isinstance(obj, dict) else None
            except (ValueError, KeyError):
                prompt = None
            if not isinstance(prompt, str):
                raise PromptFileError(f"{path}:{n} is not a JSON object with a string 'prompt'; fix or regenerate it.")
            prompts.append(prompt)
        else:
            prompts.append(line.strip())
        _check_prompt(prompts[-1], f"{path}:{n}")
    if not prompts:
        raise PromptFileError(f"{path} has no prompts; regenerate it with `jagg prepare`.")
    return prompts


def _check_prompt(prompt: str, where: str) -> None:
    """Text a tokenizer can take: not empty, valid Unicode (JSON's ``"\\ud800"`` is a lone surrogate)."""
    if not prompt.strip():
        raise PromptFileError(f"{where} is an empty prompt; remove the line or regenerate the file.")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise PromptFileError(f"{where} holds a lone surrogate ({prompt[:40]!r}), not Unicode text; fix or regenerate "
                              f"the file.") from None


def write_prompts_jsonl(path: str | os.PathLike, prompts: Sequence[str]) -> None:
    """``path`` as one ``{"prompt": ...}`` line per prompt, atomically (what :func:`read_prompts` reads)."""
    atomic_write_text(path, "".join(json.dumps({"prompt": p}) + "\n" for p in prompts))


def read_prompt_json(path: str | os.PathLike) -> Any:
    """A prompt file's JSON (a benchmark style file, a test list), or one :class:`PromptFileError` sentence."""
    path = Path(path)
    return parse_json(read_regular(path, PromptFileError, fix="put the prompt file back"), PromptFileError, str(path))


def read_prompt_list(path: str | os.PathLike) -> list[str]:
    """A JSON list of prompt strings (a benchmark style file, ``benchmark/<style>.json``)."""
    prompts = read_prompt_json(path)
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise PromptFileError(f"{path} must hold a non-empty JSON list of prompt strings.")
    return prompts


# Weight files up to this size in all are hashed as one stream; a larger folder (a real model of tens of GB) file by
# file, each file's SHA-256 remembered by its size, mtime, ctime and inode (a `touch` re-hashes it and finds the
# same content: the digest is of the content only, never of a time).
CONTENT_DIGEST_LIMIT = 1 << 30


def _digest_cache(path: Path) -> Path:
    base = Path(os.environ.get("JAGG_DIGEST_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or
                                                              Path.home() / ".cache") / "jagg" / "digests")
    return base / (hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32] + ".json")


def _file_content_sha256(path: Path) -> str:
    """A file's SHA-256, remembered (best effort) by its size, mtime and inode so a large model is read once."""
    st = path.stat()
    key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]  # ctime: no one sets it back
    cache = _digest_cache(path)
    try:
        known = parse_json(read_regular(cache, ValueError, limit=1 << 12), ValueError, str(cache))
        if known.get("key") == key and isinstance(known.get("sha256"), str):
            return known["sha256"]
    except (OSError, ValueError, AttributeError):
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cache, json.dumps({"key": key, "sha256": h.hexdigest()}))
    except (OSError, UserError):  # best effort: a cache folder that cannot be written, or one a link leads out of
        pass
    return h.hexdigest()


def folder_digest(folder: str | os.PathLike, *, content_limit: int = CONTENT_DIGEST_LIMIT) -> str:
    """A digest of a model folder's weights and configs (``*.safetensors``, ``*.bin``, ``*.json``): what a run
    trained from, so that a replaced or damaged base model is noticed (16 hex digits). A pretraining card (its wall
    time) is not part of it."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*")
                   if p.is_file() and p.suffix in (".safetensors", ".bin", ".json") and p.name != "card.json")
    by_content = sum(p.stat().st_size for p in files) <= content_limit
    h = hashlib.sha256(b"content" if by_content else b"files")
    for p in files:
        st = p.stat()
        h.update(str(p.relative_to(folder)).encode() + b"\0")
        if by_content:
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        else:
            h.update(f"{st.st_size}:{_file_content_sha256(p)}".encode())
    return h.hexdigest()[:16]


def paths_digest(path: str | os.PathLike) -> str:
    """The content of a file, or of every regular file under a folder (links followed, as a loader follows a Hugging
    Face snapshot's), by relative name: what a scorer's weights are (evaluation's score cache). Each file's SHA-256 is
    remembered by its size, mtime, ctime and inode, so a large model is read once and a file replaced at the same
    path, a new inode, is read again (16 hex digits)."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.relative_to(path) if p != path else p.name}\0{_file_content_sha256(p)}\0".encode())
    return h.hexdigest()[:16]


def base_model_digest(base_model: str | os.PathLike, model_path: str | None = None) -> str | None:
    """The digest of the model a profile starts from: its own pretrained base (the toy), else ``model.path`` where it
    is a local folder; None for a hub id (resolved from the HF cache; ``model.path`` itself names it)."""
    for folder in (Path(base_model), Path(model_path) if model_path else None):
        if folder is not None and folder.is_dir():
            return folder_digest(folder)
    return None


def finite_json(tree: Any) -> tuple[Any, int]:
    """``tree`` with every NaN or infinity replaced by ``None`` (JSON's null), and how many were: JSON has no such
    numbers (Python's ``json.dumps`` writes a bare ``NaN`` that other readers refuse), so a file says null and, beside
    it, in words, what a null stands for."""
    count = 0

    def walk(x: Any) -> Any:
        nonlocal count
        if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
            count += 1
            return None
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        return x

    return walk(tree), count


def json_lines(text: str) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of each non-blank line of a JSON-lines text; a line that is not JSON gives None (a
    write cut short, a damaged byte): the caller says what a whole record is and what to do with the others."""
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, parse_json(line, ValueError, f"line {n}")
        except ValueError:
            yield n, None


def read_score_records(path: str | Path, error: type[Exception], *, fix: str) -> list[dict[str, Any]]:
    """The rows ``jagg_core.evaluation.benchmark.score_records`` wrote to an evaluation step's ``scores.jsonl``, read
    bounded and regular (:func:`read_regular`: a FIFO there hung the report and evaluation, a link to /dev/zero read
    until memory ran out, a folder was an IsADirectoryError), each line checked (a file cut short was a
    JSONDecodeError traceback): any problem is one ``error`` sentence naming the file, ending with ``fix``."""
    path = Path(path)
    try:
        text = read_regular(path, error, fix=fix).decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{path} is not UTF-8 text; {fix}.") from None
    rows = []
    for n, row in json_lines(text):
        good = (isinstance(row, dict) and isinstance(row.get("style"), str) and isinstance(row.get("prompt"), str)
                and type(row.get("index")) is int and row["index"] >= 0
                and all(type(v) in (int, float) for k, v in row.items() if k not in ("style", "index", "prompt")))
        if not good:
            raise error(f"{path} line {n} is not one image's scores (a write cut short, or a damaged line); {fix}.")
        rows.append(row)
    return rows
