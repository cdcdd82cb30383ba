"""Every file that must survive a crash is written through `leap_io.durable`.

The scan reads the project's source with `ast` and fails on every place that moves a file into place
or flushes one to disk by hand: `os.replace`, `os.rename`, `os.renames`, `shutil.move`, `os.fsync` and
`os.fdatasync` (however os and shutil are imported), and `.replace` / `.rename` called with exactly one
argument and no keyword, or on the class `Path` with two. That arity is `Path.replace(target)` and
`Path.rename(target)`: `str.replace` and `bytes.replace` take two or three arguments, `datetime.replace`
and `dataclasses.replace` keywords. Only `leap_io/durable.py` does these things, and the moves and
flushes listed in `ALLOWED`, each with the reason it is no durable write of a whole file.
"""

from __future__ import annotations

import ast
import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from leap_io import durable
from leap_io.durable import write_bytes_durably, write_durably

ROOT = Path(__file__).resolve().parents[1]
DURABLE = "leap_io/durable.py"
SKIPPED_FOLDERS = {"tests", ".venv", ".git", "build", "node_modules"}
FILE_MOVES = {("os", "replace"), ("os", "rename"), ("os", "renames"), ("shutil", "move"), ("os", "fsync"),
              ("os", "fdatasync")}
PATH_MOVES = {"replace", "rename"}

ALLOWED: dict[tuple[str, str], str] = {
    ("harness/model_prep.py", "tmp.rename(dest)"):
        "moves the converted model's folder into place whole; a folder of files saved by transformers, "
        "not one file that leap_io.durable writes",
    ("flows/drift.py", "os.replace(path, aside)"):
        "sets an unreadable drift state file aside for inspection, under another name; a move, no write",
    ("serving/feedback/segments.py", "os.fsync(handle.fileno())"):
        "flushes what was appended to a stream that stays open (the new feedback segment's header, a "
        "quarantine log line); an append, not a whole file written aside and renamed",
    ("serving/feedback/segments.py", "os.fsync(self._handle.fileno())"):
        "flushes each record batch appended to the open feedback segment, so a crash leaves a readable "
        "prefix; an append, not a whole file written aside and renamed",
}


def project_sources() -> Iterator[Path]:
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if not SKIPPED_FOLDERS.intersection(relative.parts[:-1]) and not relative.parts[0].startswith("."):
            yield path


def _module_names(tree: ast.Module) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """({local name: "os" or "shutil"} for the modules, {local name: (module, function)} for the
    functions of FILE_MOVES imported by name)."""
    modules = {"os": "os", "shutil": "shutil"}
    functions: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ("os", "shutil"):
                    modules[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "shutil"):
            for alias in node.names:
                if (node.module, alias.name) in FILE_MOVES:
                    functions[alias.asname or alias.name] = (node.module, alias.name)
    return modules, functions


def hand_written_moves(source: str) -> list[tuple[int, str]]:
    """(line, call) of every file move or flush in `source` (see the module's docstring for the rule)."""
    tree = ast.parse(source)
    modules, functions = _module_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        call = node.func
        if isinstance(call, ast.Name):
            hit = call.id in functions
        elif isinstance(call, ast.Attribute):
            owner = modules.get(call.value.id) if isinstance(call.value, ast.Name) else None
            one_target = (len(node.args) == 1 and not node.keywords
                          and not isinstance(node.args[0], ast.Starred))
            unbound = isinstance(call.value, ast.Name) and call.value.id == "Path" and len(node.args) == 2
            hit = (owner, call.attr) in FILE_MOVES or (
                owner is None and call.attr in PATH_MOVES and (one_target or unbound))
        else:
            hit = False
        if hit:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_rule_tells_file_moves_from_string_edits():
    source = (
        "import os\nimport os as system\nimport shutil\nfrom os import replace as swap, fsync\n"
        "os.replace(a, b)\nsystem.rename(a, b)\nshutil.move(a, b)\nswap(a, b)\nfsync(fd)\nos.fdatasync(fd)\n"
        "tmp.replace(final)\nfolder.joinpath(name).rename(target)\nPath.replace(tmp, final)\n"
        "text.replace('a', 'b')\nstamp.replace(tzinfo=None)\ndataclasses.replace(config, k=1)\n"
        "data.replace(b'\\0', b' ')\nos.path.join(a, b)\nfrozen.rename(**names)\n")
    assert [line for line, _ in hand_written_moves(source)] == [5, 6, 7, 8, 9, 10, 11, 12, 13]


def test_no_module_moves_or_flushes_a_file_by_hand():
    offenders, used = [], set()
    for path in project_sources():
        relative = path.relative_to(ROOT).as_posix()
        if relative == DURABLE:
            continue
        for line, call in hand_written_moves(path.read_text(encoding="utf-8")):
            if (relative, call) in ALLOWED:
                used.add((relative, call))
            else:
                offenders.append(f"{relative}:{line}: {call}")
    assert not offenders, ("write these files through leap_io.durable (write_durably, write_bytes_durably, "
                           "write_text_durably), or add the move to ALLOWED with its reason:\n  "
                           + "\n  ".join(offenders))
    assert not set(ALLOWED) - used, f"ALLOWED names moves that no longer exist: {sorted(set(ALLOWED) - used)}"


# ---------------------------------------------------------------------------- write_bytes_durably

@pytest.fixture
def creation_modes(monkeypatch) -> list[int]:
    """The permission bits of every file `leap_io.durable` creates, taken the moment it exists."""
    modes: list[int] = []
    real_open = os.open

    def spying_open(path, flags, mode=0o777, *args, **kwargs):
        fd = real_open(path, flags, mode, *args, **kwargs)
        if flags & os.O_CREAT:
            modes.append(os.fstat(fd).st_mode & 0o777)
        return fd

    monkeypatch.setattr(durable.os, "open", spying_open)
    return modes


def test_a_secret_is_readable_by_its_owner_alone_from_its_first_byte(tmp_path, creation_modes):
    secret = tmp_path / "admin.token"
    secret.write_text("old token\n")
    secret.chmod(0o644)
    previous = os.umask(0)  # the mode must not depend on the umask being strict
    try:
        write_bytes_durably(secret, b"new token\n", mode=0o600)
    finally:
        os.umask(previous)
    assert creation_modes == [0o600]
    assert secret.read_bytes() == b"new token\n"
    assert secret.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["admin.token"]


def test_a_failed_write_keeps_the_old_content_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "fleet.env"
    target.write_bytes(b"OLD=1\n")

    def disk_error(fd: int) -> None:
        raise OSError(errno.EIO, "input/output error")

    monkeypatch.setattr(durable.os, "fsync", disk_error)
    with pytest.raises(OSError, match="input/output error"):
        write_bytes_durably(target, b"NEW=2\n", mode=0o600)
    assert target.read_bytes() == b"OLD=1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.env"]


def test_a_writer_that_fails_half_way_leaves_the_old_file_whole(tmp_path):
    target = tmp_path / "rows.parquet"
    target.write_bytes(b"whole old file")

    def half_then_full_disk(partial: Path) -> None:
        partial.write_bytes(b"half of a new")
        raise OSError(errno.ENOSPC, "no space left on device")

    with pytest.raises(OSError, match="no space left"):
        write_durably(target, half_then_full_disk)
    assert target.read_bytes() == b"whole old file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.parquet"]
