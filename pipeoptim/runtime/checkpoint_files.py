"""How checkpoint files reach the disk and are found again, so that a crash at any moment (a killed rank, a
node rebooting mid-write, a full disk) never leaves a checkpoint that looks complete but is not.

Layout: ``<root>/step-<8 digits>/`` holds ``part-<rank>.pt`` (one per rank that wrote), ``meta.pt`` and
``manifest.json``.

- Every file is written under a temporary name, flushed to the disk (fsync) and renamed into place, and
  hashed (SHA-256) as it is written.
- The manifest is the commit. Rank 0 writes it only after every rank's part is in place (it receives their
  sizes and hashes) and the directory has been flushed; a step directory without one is a checkpoint that
  was being written when the job died, and is ignored. A committed step is never rewritten in place:
  writing it again goes to ``step-<n>.next`` (``staging_dir``), is committed there, then swapped in
  (``swap_in``); a crash at any moment leaves one committed copy that ``list_steps`` finds.
- Reading checks every file the manifest lists, its size and its hash (the ranks of a distributed load
  each hash a slice), and that it lists one part per rank of the world that wrote it, under its own step
  directory: a missing, truncated or corrupted file is a ``CheckpointError`` naming the file.
  ``newest`` takes the newest intact checkpoint under a root and warns about every newer one it passes
  over, naming why; a load that passed some over sets them aside (``set_aside``) so that they never count
  again.
- ``prune`` keeps the newest K complete checkpoints (older ones and older crash leftovers go, manifest first
  so that a crash while deleting never leaves a checkpoint that looks complete).

Megatron and DeepSpeed commit a checkpoint by writing a "latest" tracker file after a barrier, and
torch.distributed.checkpoint by writing its metadata file last; the manifest here is that commit, with the
sizes and hashes that let a reader tell a damaged file from a good one.
"""
from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import re
import shutil
import time
import warnings

__all__ = ["CheckpointError", "CheckpointWarning", "MANIFEST", "step_dir", "staging_dir", "swap_in", "write_file",
           "commit", "uncommit", "check_sizes", "check_hash", "verify", "is_checkpoint", "list_steps", "newest",
           "newest_and_skipped", "set_aside", "prune", "no_space", "free_bytes", "sizes_ok", "has_committed"]

MANIFEST = "manifest.json"
FORMAT = "pipeoptim-checkpoint/1"
_STEP = re.compile(r"^step-(\d+)$")
_STAGED = re.compile(r"^step-(\d+)\.(next|replaced)$")  # a step written again, beside its committed copy
_INCOMPLETE = re.compile(r"^step-(\d+)\.incomplete(-\d+)?$")  # set aside uncommitted (``set_aside``)
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete or damaged; the message names the file and what is wrong with it."""


class CheckpointWarning(UserWarning):
    """A checkpoint was passed over in favour of an older intact one."""


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def staging_dir(directory: str) -> str:
    """Where step ``directory`` is written again when it is already committed (then ``swap_in``)."""
    return f"{directory}.next"


def swap_in(staged: str, directory: str) -> None:
    """Put the committed checkpoint ``staged`` in place of the committed ``directory``. Between the two
    renames ``directory`` is absent and ``list_steps`` takes ``staged`` (committed) for its step."""
    old = f"{directory}.replaced"
    if os.path.exists(old):
        shutil.rmtree(old)
    os.replace(directory, old)
    os.replace(staged, directory)
    _fsync_dir(os.path.dirname(directory) or ".")
    shutil.rmtree(old, ignore_errors=True)


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the file system of ``path`` (or of its nearest parent)."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    st = os.statvfs(path or ".")
    return st.f_bavail * st.f_frsize


def no_space(error: BaseException) -> bool:
    """Whether ``error`` is a full disk: an ``OSError`` ENOSPC itself, or torch's wrapping of one (torch.save
    raises ``RuntimeError: [enforce fail at inline_container.cc...] unexpected pos`` with the ENOSPC chained)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Hashing:
    """A write-only file wrapper that hashes and counts what passes through (torch.save writes to it)."""

    def __init__(self, f):
        self.f, self.sha, self.bytes = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.bytes += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def write_file(path: str, write) -> dict:
    """Atomically create ``path`` with ``write(file)``; returns its manifest record {bytes, sha256}."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            out = _Hashing(f)
            write(out)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return {"bytes": out.bytes, "sha256": out.sha.hexdigest()}


def uncommit(directory: str) -> None:
    """Make ``directory`` not a checkpoint (before its files are written again)."""
    path = os.path.join(directory, MANIFEST)
    if os.path.exists(path):
        os.remove(path)
        _fsync_dir(directory)


def commit(directory: str, files: dict[str, dict], info: dict) -> dict:
    """Write the manifest naming ``files`` (name -> record), after flushing the directory; returns it."""
    for name in files:
        if not os.path.exists(os.path.join(directory, name)):
            raise CheckpointError(f"cannot commit checkpoint {directory}: {name} is missing")
    _fsync_dir(directory)
    manifest = {"format": FORMAT, "written": time.strftime("%Y-%m-%d %H:%M:%S"), **info, "files": files}
    path = os.path.join(directory, MANIFEST)
    write_file(path, lambda f: f.write(json.dumps(manifest, indent=1, sort_keys=True).encode()))
    _fsync_dir(directory)
    return manifest


def _read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(f"{directory} is incomplete: it has no {MANIFEST} (the job stopped while writing "
                              "it, or it is not a checkpoint)")
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is damaged ({type(e).__name__}: {e})") from None
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path} is not a {FORMAT} manifest (format {manifest.get('format')!r})")
    return manifest


def _check_layout(directory: str, manifest: dict) -> None:
    """The manifest agrees with where it lies (its step is the directory's) and lists one part per rank of
    the world it says wrote it (manifests of pipeoptim.save carry both; others are not checked)."""
    path = os.path.join(directory, MANIFEST)
    m = _STEP.match(os.path.basename(directory)) or _STAGED.match(os.path.basename(directory))
    if m and "step" in manifest and manifest["step"] != int(m.group(1)):
        raise CheckpointError(f"{path} says step {manifest['step']} but lies in {directory} (step "
                              f"{int(m.group(1))}): it was copied or renamed from another checkpoint")
    world = manifest.get("world_size")
    if world is None:
        return
    listed = sorted(n for n in manifest["files"] if n.startswith("part-"))
    expected = [f"part-{r}.pt" for r in range(world)]
    if sorted(listed) != sorted(expected):
        missing = [n for n in expected if n not in listed]
        extra = [n for n in listed if n not in expected]
        what = (f"{', '.join(os.path.join(directory, n) for n in missing)} missing from it" if missing else
                f"{', '.join(extra)} besides them")
        raise CheckpointError(f"{path} is inconsistent: it says {world} rank(s) wrote the checkpoint, so it "
                              f"should list {', '.join(expected)}, but it lists {', '.join(listed) or 'no part'} "
                              f"({what})")


def check_sizes(directory: str) -> dict:
    """The manifest of ``directory`` after checking that every file it lists is there with its size (cheap:
    no file is read); else ``CheckpointError`` naming the file."""
    manifest = _read_manifest(directory)
    _check_layout(directory, manifest)
    for name, rec in sorted(manifest["files"].items()):
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            raise CheckpointError(f"{path} is missing (the manifest lists it)")
        size = os.path.getsize(path)
        if size != rec["bytes"]:
            raise CheckpointError(f"{path} is truncated or overwritten: {size} bytes, the manifest says "
                                  f"{rec['bytes']}")
    return manifest


def check_hash(directory: str, name: str, record: dict) -> str | None:
    """None if file ``name`` hashes to its manifest record, else why not (a sentence naming the file)."""
    path = os.path.join(directory, name)
    sha = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(_CHUNK):
                sha.update(block)
    except OSError as e:
        return f"{path} cannot be read: {e}"
    if sha.hexdigest() != record["sha256"]:
        return (f"{path} is corrupted: its SHA-256 differs from the manifest's (the size is right, so bytes "
                "inside it changed)")
    return None


def verify(directory: str, share=None) -> dict:
    """The manifest of ``directory`` after checking every file it lists: there, of its size, of its hash.
    ``share(names, check)``: how the hashing is shared out (the distributed loader lets each rank hash a
    slice and gathers the verdicts); it returns the problems found. Else ``CheckpointError`` naming a file."""
    manifest = check_sizes(directory)
    files = manifest["files"]

    def check(names):
        return [p for p in (check_hash(directory, n, files[n]) for n in names) if p]

    problems = share(sorted(files), check) if share is not None else check(sorted(files))
    if problems:
        raise CheckpointError(problems[0])
    return manifest


def is_checkpoint(directory: str) -> bool:
    """Whether ``directory`` is one committed checkpoint (has a manifest; not checked further)."""
    return os.path.exists(os.path.join(directory, MANIFEST))


def has_committed(path: str) -> bool:
    """Whether ``path`` (a checkpoint root or one step directory) holds a committed checkpoint, intact or not,
    or an older pipeoptim's, which had no manifest to commit it. Without one, nothing there can be lost by
    starting afresh: what is left is a step some run stopped while writing."""
    return (is_checkpoint(path) or any(is_checkpoint(d) for _, d in list_steps(path))
            or os.path.exists(os.path.join(path, "meta.pt")) or bool(glob.glob(os.path.join(path, "part-*.pt"))))


def list_steps(root: str) -> list[tuple[int, str]]:
    """(step, directory) of every step directory under ``root``, newest first, committed or not. A step
    being written again (``step-<n>.next``) stands for step n only when it is committed and ``step-<n>`` is
    not (a crash between ``swap_in``'s renames)."""
    if not os.path.isdir(root):
        return []
    found, staged = {}, {}
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        if m := _STEP.match(name):
            found[int(m.group(1))] = path
        elif (m := _STAGED.match(name)) and m.group(2) == "next" and is_checkpoint(path):
            staged[int(m.group(1))] = path
    for step, path in staged.items():
        if step not in found or not is_checkpoint(found[step]):
            found[step] = path
    return sorted(found.items(), reverse=True)


def _set_aside_incomplete(root: str, before: int) -> list[str]:
    """Step directories set aside as incomplete (never committed: nothing in them can be loaded) for steps
    older than ``before``."""
    found = [(_INCOMPLETE.match(n), n) for n in os.listdir(root)] if os.path.isdir(root) else []
    return [os.path.join(root, n) for m, n in found if m and int(m.group(1)) < before]


def _staging_leftovers(root: str, steps: list[tuple[int, str]]) -> list[str]:
    """``step-<n>.next`` / ``.replaced`` directories that no longer stand for their step."""
    if not os.path.isdir(root):
        return []
    listed = {d for _, d in steps}
    return [os.path.join(root, n) for n in os.listdir(root)
            if _STAGED.match(n) and os.path.join(root, n) not in listed]


def newest(root: str, *, warn: bool = True, share=None) -> tuple[str, dict]:
    """The newest intact checkpoint under ``root``: (directory, manifest). Each newer one passed over is a
    ``CheckpointWarning`` naming why; none intact is a ``CheckpointError`` listing them all. ``share``: as in
    ``verify``."""
    directory, manifest, _ = newest_and_skipped(root, warn=warn, share=share)
    return directory, manifest


def newest_and_skipped(root: str, *, warn: bool = True, share=None) -> tuple[str, dict, list[tuple[str, str]]]:
    """``newest``, plus (directory, what is wrong with it) for each step directory it passed over."""
    problems, skipped = [], []
    for _, directory in list_steps(root):
        try:
            manifest = verify(directory, share)
        except CheckpointError as e:
            problems.append(str(e))
            skipped.append((directory, str(e)))
            continue
        if warn:
            for p in problems:
                warnings.warn(f"skipping a checkpoint: {p}; using {directory} instead", CheckpointWarning,
                              stacklevel=3)
        return directory, manifest, skipped
    if not problems:
        legacy = sorted(glob.glob(os.path.join(root, "part-*.pt")))
        hint = " (it holds part-*.pt without a manifest: a checkpoint from an older pipeoptim)" if legacy else ""
        raise FileNotFoundError(f"no checkpoint in {root}{hint}; save one with Pipeline.save")
    raise CheckpointError(f"no intact checkpoint in {root}: " + "; ".join(problems))


def set_aside(directory: str) -> str:
    """Rename a checkpoint found damaged or incomplete to ``<name>.damaged`` / ``<name>.incomplete``: kept
    for a look, never counted again (``prune`` would otherwise keep it in place of an intact one)."""
    base = f"{directory}.{'damaged' if is_checkpoint(directory) else 'incomplete'}"
    target, n = base, 1
    while os.path.exists(target):
        n += 1
        target = f"{base}-{n}"
    os.replace(directory, target)
    return target


def sizes_ok(directory: str) -> bool:
    """Whether ``directory`` is committed with every file of its size (cheap: nothing is read)."""
    try:
        check_sizes(directory)
    except CheckpointError:
        return False
    return True


def prune(root: str, keep: int | None) -> list[str]:
    """Delete all but the newest ``keep`` committed checkpoints under ``root`` (a truncated one does not
    count, and stays), and uncommitted step directories older than the newest committed one (crash
    leftovers, and those ``set_aside`` named incomplete; a damaged one, committed, stays for a look). Returns
    the deleted directories."""
    if keep is None:
        return []
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the checkpoint just written), got {keep}")
    steps = list_steps(root)
    committed = [d for _, d in steps if sizes_ok(d)]
    doomed = committed[keep:]
    if committed:
        newest_step = next(s for s, d in steps if d == committed[0])
        doomed += [d for s, d in steps if s < newest_step and not is_checkpoint(d)]
        doomed += _set_aside_incomplete(root, newest_step)
    doomed += _staging_leftovers(root, steps)
    for d in doomed:
        uncommit(d)
        shutil.rmtree(d, ignore_errors=True)
    return doomed
