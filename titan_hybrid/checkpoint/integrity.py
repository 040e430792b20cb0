"""Crash-consistent, verified checkpoint folders.

The rule: a folder named `step-N` is complete. A save writes `step-N.partial`, adds
`checksums.json` (size and CRC-32 of every file in it, `.metadata` included) and only then
renames the folder to `step-N`, a single atomic rename on one filesystem. A save killed at any
moment therefore leaves a `.partial` folder, never a `step-N` that a restart would take for
complete. Before a restart resumes from `step-N` it checks the folder against its checksums (or,
for folders written without them, checks that every file DCP's metadata points into exists and
is long enough); a damaged folder is reported and the next older one is tried.

Checksums and verification are spread over the ranks (rank r handles files r, r+W, ...), so
the cost per rank shrinks with the number of ranks like the save itself.

CRC-32 rather than a cryptographic hash: the threat is a torn write, a truncated copy or a bad
disk, not an adversary, and zlib's CRC-32 runs at several GB/s where SHA-256 does about one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path

import torch.distributed as dist

from titan_hybrid.runtime.errors import JobError

CHECKSUMS_FILE = "checksums.json"
PARTIAL_SUFFIX = ".partial"
STEP_FOLDER = re.compile(r"^step-(\d+)$")
HF_INDEX_FILE = "model.safetensors.index.json"
_CHUNK = 8 << 20


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_rank0() -> bool:
    return _world()[0] == 0


def _gather_dicts(mine: dict, group=None) -> dict:
    """Union of every rank's dict (every rank gets it)."""
    rank, world = _world()
    if world == 1:
        return mine
    every_rank: list = [None] * world
    dist.all_gather_object(every_rank, mine, group=group)
    return {key: value for part in every_rank for key, value in part.items()}


def agree(value):
    """Rank 0's `value` on every rank: decisions every rank must take the same way (which
    folders exist, whether one is intact) are made once, so no rank runs other collectives."""
    if _world()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def files_of(folder: Path) -> list[str]:
    """Every file under `folder` (relative, sorted), the checksum file itself excluded."""
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*")
                  if path.is_file() and path.name != CHECKSUMS_FILE)


def file_entry(path: Path) -> dict[str, int]:
    return {"bytes": path.stat().st_size, "crc32": file_crc32(path)}


def checksum_folder(folder: Path, known: dict[str, dict[str, int]] | None = None,
                    group=None) -> dict[str, dict[str, int]]:
    """{relative path: {"bytes": size, "crc32": crc}} of every file, computed collectively.
    `known`: entries this rank computed already (a background save's own files), used while
    the file still has that size; the other files are shared out between the ranks."""
    rank, world = _world()
    names = files_of(folder)
    listings = _gather_dicts({rank: names}, group)
    if any(listing != names for listing in listings.values()):
        raise JobError(f"checkpoint folder '{folder.parent}' is not the same on every rank (ranks "
                       "list different files): checkpoint.folder must be on a filesystem "
                       "shared by all ranks")
    known = {name: entry for name, entry in (known or {}).items()
             if name in names and (folder / name).stat().st_size == entry["bytes"]}
    every_known = _gather_dicts(known, group)
    rest = [name for name in names if name not in every_known]
    mine = {name: file_entry(folder / name) for name in rest[rank::world]}
    return {**every_known, **_gather_dicts(mine, group)}


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def commit(partial: Path, final: Path, known: dict[str, dict[str, int]] | None = None,
           group=None) -> None:
    """Checksum a fully written `partial` folder and rename it to `final` (collective over
    `group`, default: all ranks: every rank calls it after its part of the save returned).
    `known`: see checksum_folder."""
    barrier(group)  # every rank's files are written
    sums = checksum_folder(partial, known, group)
    if is_rank0():
        _write_durably(partial / CHECKSUMS_FILE, json.dumps(sums, indent=0, sort_keys=True))
        _fsync_folder(partial)
        replaced = final.with_name(final.name + ".replaced")
        if final.exists():  # a damaged folder of the same step, found at start-up
            shutil.rmtree(replaced, ignore_errors=True)
            final.rename(replaced)
        partial.rename(final)
        _fsync_folder(final.parent)
        shutil.rmtree(replaced, ignore_errors=True)
    barrier(group)


def _storage_extents(metadata) -> dict[str, int]:
    """{file: bytes DCP's metadata says it holds at least}."""
    extents: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        extents[info.relative_path] = max(extents.get(info.relative_path, 0), end)
    return extents


def _read_metadata(folder: Path):
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(str(folder)).read_metadata()


def structural_problem(folder: Path) -> str | None:
    """Cheap check (no reading of tensor bytes): None, or what is wrong."""
    sums_path = folder / CHECKSUMS_FILE
    if sums_path.exists():
        try:
            sums = json.loads(sums_path.read_text())
        except (OSError, ValueError) as error:
            return f"unreadable {CHECKSUMS_FILE} ({error})"
        for name, expected in sorted(sums.items()):
            path = folder / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != expected["bytes"]:
                return (f"{name} has {path.stat().st_size} bytes, {expected['bytes']} were "
                        "written")
        return None
    if (folder / HF_INDEX_FILE).exists():
        return None
    if not (folder / ".metadata").exists():
        return "no .metadata (the save did not finish)"
    try:
        metadata = _read_metadata(folder)
    except Exception as error:  # any unpickling failure means the same thing here
        return f"unreadable .metadata ({type(error).__name__}: {error})"
    for name, end in sorted(_storage_extents(metadata).items()):
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size < end:
            return f"{name} is truncated ({path.stat().st_size} bytes, metadata needs {end})"
    return None


def _problem_and_checksums(folder: Path) -> tuple[str | None, dict | None]:
    try:
        problem = structural_problem(folder)
        sums_path = folder / CHECKSUMS_FILE
        if problem is not None or not sums_path.exists():
            return problem, None
        return None, json.loads(sums_path.read_text())
    except OSError as error:
        return f"unreadable ({error})", None


def verify(folder: Path) -> str | None:
    """Full check of a checkpoint folder (collective): None if intact, else the reason.

    Rank 0 checks the structure (sizes, metadata) and every rank then reads its share of the
    files for their CRC-32 against checksums.json; every rank returns the same verdict.
    Folders written without checksums (torchtitan's own saves) get the structural check only.
    """
    problem, sums = agree(_problem_and_checksums(folder) if is_rank0() else None)
    if problem is not None or sums is None:
        return problem
    rank, world = _world()
    mine = {}
    for name in sorted(sums)[rank::world]:
        try:
            if file_crc32(folder / name) != sums[name]["crc32"]:
                mine[name] = "checksum mismatch"
        except OSError as error:  # a bad disk is one of the threats
            mine[name] = f"unreadable ({error.strerror or error})"
    bad = _gather_dicts(mine)
    if not bad:
        return None
    name = sorted(bad)[0]
    return f"{name}: {bad[name]}" + (f" (and {len(bad) - 1} more file(s))" if len(bad) > 1
                                     else "")


def step_folders(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step-N` folder, newest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), folder / name) for name in os.listdir(folder)
             if (m := STEP_FOLDER.match(name)) and (folder / name).is_dir()]
    return sorted(found, reverse=True)


LEFTOVER_SUFFIXES = (PARTIAL_SUFFIX, ".replaced", ".damaged")


def discard_leftovers(folder: Path) -> list[Path]:
    """Remove what interrupted saves and earlier fallbacks left (`.partial`, `.replaced`,
    `.damaged` folders); rank 0 only. A folder left empty goes too, so that a job with an
    initial_load_path whose first save was interrupted starts from that path again."""
    removed = []
    if is_rank0() and folder.is_dir():
        for path in folder.iterdir():
            if path.is_dir() and path.name.endswith(LEFTOVER_SUFFIXES):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        if removed and not any(folder.iterdir()):
            folder.rmdir()
    barrier()
    return removed


def set_aside_damaged(path: Path) -> Path:
    """Rename a damaged `step-N` out of the way (rank 0): a later save of the same step can then
    never meet it, and an asynchronous delete of it can never hit that new save."""
    aside = path.with_name(path.name + ".damaged")
    shutil.rmtree(aside, ignore_errors=True)
    path.rename(aside)
    return aside
