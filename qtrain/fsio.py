"""Files qtrain writes: atomic writes, temp names, leftovers of dead processes, free space, fault points.

The rules every writer in qtrain follows (checkpoints, HF exports, run markers):

* A file is written under a temp name in its final directory (`.NAME.tmp-HOST-PID`), fsynced, and renamed
  onto its name: a reader sees the old file or the new one, never half of one.
* A directory is deleted by renaming it out of its namespace first (`step_N.del-HOST-PID`), then removing
  it file by file: a kill mid-delete leaves a name nothing reads, swept at the next start.
* Temp names carry the host and process id of their writer, so `is_stale` can tell the leftovers of a dead
  process from the files of a live one (`sweep_temp_files`).
* Before a large write, `ensure_free_space` compares the bytes it needs with the free bytes of the
  filesystem and raises `DiskSpaceError` naming both, instead of failing half-way with ENOSPC.

`fault_point(name)` marks each moment between two file operations. It does nothing unless the test-only
environment variable QTRAIN_FAULT is set to `PATTERN:N` (an fnmatch pattern of point names and a 1-based
count): then the process kills itself with SIGKILL at the N-th point whose name matches, which is how the
fault-injection suite (tests/reliability) stops a run inside each write, rename and unlink window. With
QTRAIN_FAULT_ACTION=stop it stops itself with SIGSTOP there instead (a test then holds a live process at that point,
and lets it go on with SIGCONT).
QTRAIN_FAULT_TRACE=FILE appends the name of every point reached to FILE (to enumerate the windows).
"""
from __future__ import annotations

import errno
import fnmatch
import glob
import json
import os
import re
import shutil
import signal
import socket
import stat
from pathlib import Path
from typing import Any, Callable

# ---------------------------------------------------------------------------------------------- fault points

_fault: dict[str, Any] | None = None


def _fault_config() -> dict[str, Any]:
    global _fault
    if _fault is None:
        spec = os.environ.get("QTRAIN_FAULT", "")
        pattern, _, n = spec.rpartition(":")
        _fault = {"pattern": pattern if spec else None, "n": int(n) if spec else 0, "hits": 0,
                  "trace": os.environ.get("QTRAIN_FAULT_TRACE") or None,
                  "signal": signal.SIGSTOP if os.environ.get("QTRAIN_FAULT_ACTION") == "stop" else signal.SIGKILL}
    return _fault


def fault_point(name: str) -> None:
    """A moment between two file operations (see the module docstring); free unless QTRAIN_FAULT is set."""
    cfg = _fault_config()
    if cfg["trace"]:
        with open(cfg["trace"], "a", encoding="utf-8") as f:
            f.write(name + "\n")
    if cfg["pattern"] and fnmatch.fnmatchcase(name, cfg["pattern"]):
        cfg["hits"] += 1
        if cfg["hits"] == cfg["n"]:
            os.kill(os.getpid(), cfg["signal"])


# ---------------------------------------------------------------------------------------------- errors

class FileSystemError(ValueError):
    """A path qtrain cannot write as asked (full, read-only, a file where a directory should be); names it."""


class DiskSpaceError(FileSystemError):
    """Not enough free space for a write; the message names the path, the bytes needed and the bytes free."""


def describe_write_error(e: BaseException) -> str:
    """The cause of a failed write in a few words (an OSError's strerror; what safetensors' own error wraps)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return re.sub(r"^Error while serializing: (I/O error: )?", "", str(e)).replace(" (os error ", " (errno ")


def format_bytes(n: int | float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} bytes"


# ---------------------------------------------------------------------------------------------- durability

def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or directory: a rename is only durable once the bytes and the directory entries are."""
    fd = os.open(Path(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- owner tags

def owner_tag() -> str:
    """`HOST-PID` of this process: what temp names carry so a later start can tell whether their writer lives."""
    host = re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}"


_TAG = re.compile(r"^(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)$")


def is_stale(tag: str) -> bool:
    """Whether the writer named by a tag is gone: another host's, an unparsable one, this process's own
    (a pid recycled after a restart), or a pid of this host that no longer runs."""
    m = _TAG.match(tag)
    if m is None:
        return True
    here, pid = owner_tag().rsplit("-", 1)[0], int(m.group("pid"))
    if m.group("host") != here or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


def temp_path(final: str | os.PathLike) -> Path:
    """Where `final` is written before the rename that publishes it: a hidden sibling with this owner's tag."""
    final = Path(final)
    return final.parent / f".{final.name}.tmp-{owner_tag()}"


_TEMP_FILE = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<tag>[A-Za-z0-9_]+-\d+)$")


def sweep_temp_files(directory: str | os.PathLike) -> list[Path]:
    """Remove temp files (`.NAME.tmp-HOST-PID`) that dead writers left in `directory`; returns them."""
    removed = []
    d = Path(directory)
    if not d.is_dir():
        return removed
    for p in d.iterdir():
        m = _TEMP_FILE.match(p.name)
        if m and p.is_file() and not p.is_symlink() and is_stale(m.group("tag")):
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


# ---------------------------------------------------------------------------------------------- writing

def default_file_mode() -> int:
    """0666 & ~umask: the permissions of any file this user creates (`open(..., "w")`, `cp`, `touch`). Writers
    that make their files private on their own (safetensors creates 0600 files) are brought back to it."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:  # Linux >= 4.7: reads the umask without setting it
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None], *, point: str = "file") -> Path:
    """`write(tmp)` creates the temp file; it is fsynced and renamed onto `path`. On any error the temp file
    is removed and `path` is left as it was. Fault points: `<point>.tmp` (written, not yet renamed) and
    `<point>.done` (renamed)."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        write(tmp)
        fsync_path(tmp)
        fault_point(f"{point}.tmp")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    fault_point(f"{point}.done")
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, point: str = "file") -> Path:
    return atomic_write(path, lambda tmp: tmp.write_bytes(data), point=point)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, point: str = "file") -> Path:
    return atomic_write_bytes(path, (json.dumps(obj, indent=2, allow_nan=True) + "\n").encode("utf-8"), point=point)


MARKER_MAX_BYTES = 64 << 20  # a marker or manifest qtrain writes is a few kilobytes


def read_json(path: str | os.PathLike) -> Any | None:
    """A JSON file qtrain wrote, or None when it is missing or unreadable (a marker that is not there): also
    when it is not a regular file (a FIFO would block the read), too large or nested too deeply to be ours."""
    try:
        return parse_json_input(read_bounded(path, "", MARKER_MAX_BYTES), str(path))
    except (OSError, ValueError):
        return None


def find_link(path: str | os.PathLike) -> Path | None:
    """`path` itself when it is a symbolic link, else the first symbolic link inside it (links are not
    followed), else None. qtrain never creates links, so one there was made by the user."""
    path = Path(path)
    if path.is_symlink():
        return path
    for root, dirs, files in os.walk(path):  # os.walk lists a link to a directory in `dirs` but never enters it
        for name in dirs + files:
            if os.path.islink(os.path.join(root, name)):
                return Path(root) / name
    return None


def remove_tree(path: str | os.PathLike, *, point: str = "rmtree") -> None:
    """Delete a directory tree file by file (fault point `<point>.unlink` after each file): callers first
    rename the tree out of its namespace, so a kill half-way leaves only a name that is swept later.
    A tree that is or holds a symbolic link is refused whole (FileSystemError, nothing deleted): the link is
    the user's, and deleting through it would delete their files; callers check with `find_link` first."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if (link := find_link(path)) is not None:
        raise FileSystemError(f"{path}: not deleted: {link} is a symbolic link, which qtrain neither follows "
                              f"nor removes")
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            os.unlink(os.path.join(root, name))
            fault_point(f"{point}.unlink")
        for name in dirs:
            os.rmdir(os.path.join(root, name))  # a link made since the check: rmdir refuses it (ENOTDIR)
    os.rmdir(path)


# ---------------------------------------------------------------------------------------------- inputs

class InputError(ValueError):
    """An input file qtrain refuses to read (not a regular file, too large, too deeply nested); names it."""


SHOWN_CHARS = 200
# JSON / YAML / TOML inputs nest a few levels (a config.json's rope_scaling, a config file's sections); deeper
# nesting is refused before a recursive parser (json, PyYAML's composer, tomllib, repr) can overflow the stack
MAX_NESTING = 64
# a config.json, generation_config.json or tokenizer_config.json: kilobytes in practice (a large id2label table
# makes a few megabytes); anything larger is not one
CONFIG_MAX_BYTES = 16 << 20


def _label(what: str, path: str | os.PathLike) -> str:
    """How a message names an input: `--config PATH`, or the path alone when it says what the file is."""
    return f"{what} {shorten(str(path))}" if what else shorten(str(path))


def shorten(value: Any, limit: int = SHOWN_CHARS) -> str:
    """`value` as text for a one-line message, cut to `limit` characters: a hostile value is never echoed whole."""
    text = value if isinstance(value, str) else repr(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def check_regular_file(path: str | os.PathLike, what: str) -> Path:
    """Refuse anything but a regular file (a FIFO or device would block or never end a read; a directory
    cannot be read); symlinks to regular files are fine. Returns the path."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise InputError(f"{_label(what, path)}: no such file") from None
    except OSError as e:
        raise InputError(f"{_label(what, path)}: cannot be read ({describe_write_error(e)})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a pipe, socket or device)"
        raise InputError(f"{_label(what, path)}: is {kind}")
    return p


def read_bounded(path: str | os.PathLike, what: str, max_bytes: int) -> bytes:
    """The bytes of a small input file (a config, a manifest), refused when it is not a regular file or is
    larger than `max_bytes`: a hostile file never makes qtrain read gigabytes or block on a pipe."""
    p = check_regular_file(path, what)
    size = os.stat(p).st_size
    if size > max_bytes:
        raise InputError(f"{_label(what, path)}: {format_bytes(size)} is larger than the "
                         f"{format_bytes(max_bytes)} such a file may have")
    try:
        with open(p, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise InputError(f"{_label(what, path)}: cannot be read ({describe_write_error(e)})") from None
    if len(data) > max_bytes:
        raise InputError(f"{_label(what, path)}: grew past {format_bytes(max_bytes)} while being read")
    return data


# a JSON string, or an unterminated one up to the end of the text: never fails a match, so never backtracks
# (a text of many unterminated strings would otherwise take quadratic time)
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")


def json_nesting(text: str) -> int:
    """How deeply arrays and objects nest in JSON text, counted without parsing it (brackets outside strings;
    linear time, no recursion): what `parse_json_input` checks before the recursive parser runs."""
    import numpy as np

    brackets = _NOT_BRACKETS.sub("", _JSON_STRING.sub("", text)).encode("ascii")
    if not brackets:
        return 0
    b = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((b == ord("[")) | (b == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0))


def data_nesting(obj: Any, limit: int = MAX_NESTING) -> int:
    """How deeply lists and dicts nest in parsed data (walked with a stack, not recursion); stops counting
    past `limit` (returns limit + 1)."""
    deepest, stack = 0, [(obj, 0)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, (list, tuple, dict)):
            depth += 1
            if depth > limit:
                return depth
            deepest = max(deepest, depth)
            stack.extend((v, depth) for v in (x.values() if isinstance(x, dict) else x))
    return deepest


def parse_json_input(data: bytes, where: str, *, max_nesting: int = MAX_NESTING) -> Any:
    """JSON bytes from an input file (named `where` in messages) -> the parsed value; InputError for text that
    is not UTF-8, nests deeper than `max_nesting` (refused before parsing) or is not valid JSON."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if json_nesting(text) > max_nesting:
        raise InputError(f"{where}: nested more than {max_nesting} levels deep; refusing to read it (no file "
                         f"of this kind nests so deeply: corrupt or hostile?)")
    try:
        return json.loads(text)
    except ValueError as e:
        raise InputError(f"{where}: not valid JSON ({shorten(str(e))})") from None


def read_json_input(path: str | os.PathLike, what: str, max_bytes: int, *, max_nesting: int = MAX_NESTING) -> Any:
    """A small JSON input file (config.json, an index, a generation or tokenizer config) parsed, refused with
    an InputError naming it when it is not a regular file, larger than `max_bytes`, nested too deeply or not
    JSON: `read_bounded` then `parse_json_input`."""
    return parse_json_input(read_bounded(path, what, max_bytes), _label(what, path), max_nesting=max_nesting)


MAX_PATTERN_CHARS = 4096  # PATH_MAX: a longer pattern names no file
MAX_PATTERN_PART_CHARS = 1024  # one path component (NAME_MAX is 255; character classes make patterns longer)
MAX_GLOB_ENTRIES = 1_000_000  # directory entries one pattern may look at


def expand_glob(pattern: str, what: str) -> list[str]:
    """The paths a shell pattern (`*`, `?`, `[...]`; no `**` recursion, hidden names only when the pattern's part
    starts with a dot, as `glob.glob`) matches, sorted. Its cost is bounded, unlike `glob.glob`'s: the pattern is
    at most MAX_PATTERN_CHARS long (each part MAX_PATTERN_PART_CHARS, which bounds fnmatch's translation, quadratic
    in a part's length), and the walk looks at most MAX_GLOB_ENTRIES directory entries; beyond either an InputError.
    A pattern without magic is returned as it is when that path exists."""
    if len(pattern) > MAX_PATTERN_CHARS or any(len(p) > MAX_PATTERN_PART_CHARS for p in pattern.split(os.sep)):
        raise InputError(f"{what} {shorten(pattern)}: longer than any path ({MAX_PATTERN_CHARS} characters, "
                         f"{MAX_PATTERN_PART_CHARS} per folder or file name)")
    if not glob.has_magic(pattern):
        return [pattern] if os.path.lexists(pattern) else []
    head, parts = ("/" if pattern.startswith("/") else ""), [p for p in pattern.split(os.sep) if p]
    found, seen = [head], 0
    for i, part in enumerate(parts):
        last, nxt = i == len(parts) - 1, []
        if not glob.has_magic(part):
            nxt = [os.path.join(d, part) for d in found if os.path.lexists(os.path.join(d, part))]
        else:
            match = re.compile(fnmatch.translate(part)).match
            for d in found:
                try:
                    with os.scandir(d or ".") as it:
                        for entry in it:
                            seen += 1
                            if seen > MAX_GLOB_ENTRIES:
                                raise InputError(f"{what} {shorten(pattern)}: looks through more than "
                                                 f"{MAX_GLOB_ENTRIES:,} directory entries; name fewer files")
                            if (entry.name.startswith(".") and not part.startswith(".")) or not match(entry.name):
                                continue
                            if last or entry.is_dir():
                                nxt.append(os.path.join(d, entry.name))
                except (NotADirectoryError, FileNotFoundError, PermissionError):
                    continue
        found = nxt
    return sorted(found)


# ---------------------------------------------------------------------------------------------- checks

def user_cache_home() -> Path:
    """The user's cache folder: `$XDG_CACHE_HOME`, else `~/.cache` (qtrain's caches live in its `qtrain/`)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"))


def existing_ancestor(path: str | os.PathLike) -> Path:
    """`path` itself or its nearest ancestor that exists (where a mkdir of `path` would start)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes (for this user) of the filesystem that holds, or would hold, `path`."""
    return shutil.disk_usage(existing_ancestor(path)).free


def ensure_free_space(path: str | os.PathLike, need: int, what: str) -> None:
    """Raise DiskSpaceError when the filesystem of `path` has fewer than `need` free bytes."""
    free = free_bytes(path)
    if free < need:
        raise DiskSpaceError(f"{what} needs {format_bytes(need)}, but {existing_ancestor(path)} has only "
                             f"{format_bytes(free)} free; free some space or choose another directory")


def check_writable_dir(path: str | os.PathLike, option: str) -> None:
    """Refuse a directory path qtrain could not create or write into: a file on the way, or no write
    permission where it would be created. Nothing is created here."""
    p = Path(path)
    _check_no_broken_link(p, option, path)
    if p.exists() and not p.is_dir():
        raise FileSystemError(f"{option} {path}: exists and is not a directory")
    anc = existing_ancestor(p)
    if not anc.is_dir():
        raise FileSystemError(f"{option} {path}: {anc} is a file, so the directory cannot be created")
    if not _can_write(anc):
        where = "is not writable" if anc == Path(os.path.abspath(p)) else f"cannot be created ({anc} is not writable)"
        raise FileSystemError(f"{option} {path}: {where}")


def check_writable_file(path: str | os.PathLike, option: str) -> None:
    """Refuse a file path qtrain could not create or append to (a directory there, or no permission)."""
    p = Path(path)
    _check_no_broken_link(p, option, path, dangling_ok=True)  # appending through a link creates its target
    if p.is_dir():
        raise FileSystemError(f"{option} {path}: is a directory, not a file")
    if p.exists():
        if not _can_write(p):
            raise FileSystemError(f"{option} {path}: is not writable")
        return
    check_writable_dir(p.parent, f"{option} {path}: its folder")


def _check_no_broken_link(p: Path, option: str, path: str | os.PathLike, *, dangling_ok: bool = False) -> None:
    """Refuse a path that is, or passes through, a symlink leading nowhere (a loop, or a missing target): it
    looks absent, so the other checks pass, and creating it fails only when the output is written (mkdir of a
    dangling link: EEXIST). `dangling_ok`: the path itself may be a link to a file not made yet."""
    p = Path(os.path.abspath(p))
    for q in [*reversed(p.parents), p]:
        if not os.path.islink(q):
            continue
        try:
            os.stat(q)
            continue
        except OSError as e:
            loop = e.errno == errno.ELOOP
        if q == p and dangling_ok and not loop:
            continue
        where = "" if q == p else f"{shorten(str(q))} "
        if loop:
            raise FileSystemError(f"{option} {shorten(str(path))}: {where}is a symlink loop (following it never "
                                  f"reaches a file or directory); remove it or point it somewhere")
        raise FileSystemError(f"{option} {shorten(str(path))}: {where}is a symlink to {shorten(os.readlink(q))}, "
                              f"which does not exist; create that first, or remove the link")


def _can_write(p: Path) -> bool:
    """Write permission as this process's effective user has it (root passes unless the filesystem is
    read-only)."""
    mode = os.W_OK | (os.X_OK if p.is_dir() else 0)
    if os.access in os.supports_effective_ids:
        return os.access(p, mode, effective_ids=True)
    return os.access(p, mode)
