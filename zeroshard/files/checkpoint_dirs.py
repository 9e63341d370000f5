"""A checkpoint root on disk: tags, their versions, `latest`, atomic commits, pruning, and the
readers' leases that pruning respects. Nothing here knows what a checkpoint holds (checkpoint.py).

How the root is kept (root, tag, version, lease: docs/vocabulary.md):
- root: the directory given to `save_checkpoint`. It holds, per checkpoint tag (default
  `step<N>`), a symbolic link `<tag>` to that tag's current *version*, a directory
  `<tag>.v-<id>`, and `latest`, a small file naming the newest complete tag.
- version: one save of a tag, never written again once committed. Saving to a tag that exists
  writes a new version and switches the link to it atomically; a reader resolves the link once and
  reads that version to the end, never a mix of two saves.
- lease: a reader's shared `flock` on the version directory it reads, held from resolving it to the
  end of the load or export. A save removes the versions it replaced and `keep` the tags it prunes
  only when it can take the lock exclusively at once; a version under lease stays, and the next
  save that finds it free removes it. So no load or export loses its version under it, however
  slow it is (Note [lease]).

Note [lease]: the lock is taken on the directory, after resolving it; a pruner may remove the
directory between the two. So a reader checks, once it holds the lock, that the version is still
whole (its checksums file is there) and otherwise resolves again: the link by then names a newer
version. A pruner removes a version while holding the lock, so a reader blocked on it finds it gone.
Where `fcntl` is missing (Windows) there are no leases: a load slower than two saves of its tag may
then find its version removed (a CheckpointError, never a mix). On a shared file system the locks
hold where flock does across hosts (local disks, NFS).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid

from ..errors import CheckpointError

try:
    import fcntl
except ImportError:  # Windows: no leases (Note [lease])
    fcntl = None

LATEST = "latest"
META = "zeroshard.json"
SUMS = "checksums.json"
VERSION = re.compile(r"(.+)\.v-[0-9a-f]{8}")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def versions(root: str, tag: str) -> list[str]:
    """The version directories of `tag` in root, oldest first."""
    names = [n for n in os.listdir(root) if (m := VERSION.fullmatch(n)) and m.group(1) == tag]
    return sorted(names, key=lambda n: os.stat(os.path.join(root, n)).st_mtime_ns)


# -- leases ----------------------------------------------------------------------------------------
def _lock(path: str, exclusive: bool) -> int | None:
    """An open descriptor of directory `path` holding its flock (shared: waits; exclusive: None at
    once if anyone holds it). -1 without fcntl."""
    if fcntl is None:
        return -1
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if exclusive else fcntl.LOCK_SH)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unlock(fd: int | None) -> None:
    if fd is not None and fd >= 0:
        os.close(fd)  # the flock goes with the last descriptor of its open file


@contextlib.contextmanager
def lease(path, tag: str | None = None):
    """Resolve `path` (see resolve) and hold a lease on the version found until the block ends;
    yields the version's directory. Raises CheckpointError as resolve does."""
    found = _find(path, tag)
    for _ in range(100):  # each retry means a save committed meanwhile: a few suffice
        try:
            fd = _lock(found, exclusive=False)
        except FileNotFoundError:
            fd = None
        if os.path.isfile(os.path.join(found, SUMS)):
            break
        _unlock(fd)
        again = _find(path, tag)
        if again == found:  # not removed under us: incomplete (resolve says how)
            resolve(path, tag)
        found = again  # removed between resolving and locking: the link names a newer version now
    else:
        raise CheckpointError(f"zeroshard: {path}: its checkpoint was replaced 100 times while being opened")
    try:
        yield found
    finally:
        _unlock(fd)


@contextlib.contextmanager
def held(found: str):
    """A lease on version directory `found`, already resolved by another rank (which holds one)."""
    try:
        fd = _lock(found, exclusive=False)
    except FileNotFoundError:
        fd = None
    try:
        if not os.path.isfile(os.path.join(found, SUMS)):
            raise CheckpointError(f"zeroshard: checkpoint {found} is not there on this rank (a file system that "
                                  "not every rank shares?)")
        yield found
    finally:
        _unlock(fd)


def _remove_unleased(paths: list[str]) -> list[str]:
    """Remove those of directories `paths` that no reader holds (all or nothing: if any is leased,
    none is removed); returns the paths left."""
    fds = []
    try:
        for p in paths:
            fd = _lock(p, exclusive=True)
            if fd is None:
                return paths
            fds.append(fd)
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
        return []
    except FileNotFoundError:  # another save removed it: nothing to do
        return [p for p in paths if os.path.exists(p)]
    finally:
        for fd in fds:
            _unlock(fd)


# -- a save's last steps ---------------------------------------------------------------------------
def commit(tmp: str, root: str, tag: str) -> str:
    """Make the finished `tmp` the tag's new version and switch root/<tag> to it; keep the version it
    replaced (a reader may be about to open it), remove older ones no reader holds."""
    final = os.path.join(root, tag)
    version = os.path.join(root, f"{tag}.v-{uuid.uuid4().hex[:8]}")
    os.replace(tmp, version)
    previous = os.path.realpath(final) if os.path.islink(final) else None
    if os.path.isdir(final) and not os.path.islink(final):  # saved by an older zeroshard: a version now
        previous = os.path.join(root, f"{tag}.v-{uuid.uuid4().hex[:8]}")
        os.replace(final, previous)
    link = os.path.join(root, f".link-{uuid.uuid4().hex[:8]}")
    os.symlink(os.path.basename(version), link)
    os.replace(link, final)
    fsync_dir(root)
    for name in versions(root, tag):
        if os.path.join(root, name) not in (version, previous):
            _remove_unleased([os.path.join(root, name)])
    return final


def prune(root: str, keep: int, saved: str) -> None:
    """Remove all but the newest `keep` tags (by when their current version was written), never
    `saved`, nor the tag `latest` names, nor a tag a reader holds a version of (a later save
    removes it)."""
    with open(os.path.join(root, LATEST)) as f:
        latest = f.read().strip()
    tags = [n for n in os.listdir(root) if not n.startswith(".") and n != LATEST and not VERSION.fullmatch(n)
            and os.path.isfile(os.path.join(root, n, SUMS))]
    tags.sort(key=lambda n: os.stat(os.path.realpath(os.path.join(root, n))).st_mtime_ns, reverse=True)
    for tag in tags[keep:]:
        if tag in (saved, latest):
            continue
        full = os.path.join(root, tag)
        dirs = [os.path.join(root, n) for n in versions(root, tag)]
        if not os.path.islink(full):
            dirs.append(full)
        if _remove_unleased(dirs):
            continue
        if os.path.islink(full):
            os.remove(full)


def write_latest(root: str, tag: str) -> None:
    """Point root/latest at `tag`: the last step of a save."""
    tmp = os.path.join(root, f".latest-{uuid.uuid4().hex[:8]}")
    write_file(tmp, (tag + "\n").encode())
    os.replace(tmp, os.path.join(root, LATEST))
    fsync_dir(root)


def remove_leftovers(root: str) -> None:
    """Clear up after crashed saves: remove unfinished `.tmp-*` dirs; an `.old-<tag>-*` dir (a
    checkpoint set aside to be replaced) goes back to <tag> if the replacement never arrived, else
    is removed."""
    for name in sorted(os.listdir(root)):
        full = os.path.join(root, name)
        if name.startswith((".tmp-", ".latest-", ".link-")):
            shutil.rmtree(full, ignore_errors=True) if os.path.isdir(full) else os.remove(full)
        elif name.startswith(".old-"):
            tag = os.path.join(root, name[5:].rsplit("-", 1)[0])
            if os.path.isdir(tag):
                shutil.rmtree(full, ignore_errors=True)
            else:
                os.replace(full, tag)


# -- finding a checkpoint --------------------------------------------------------------------------
def _latest_tag(path: str) -> str:
    name = os.path.join(path, LATEST)
    try:
        with open(name, "rb") as f:
            raw = f.read(4096)
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"zeroshard: {name} does not name a checkpoint (it is not text)") from None
    except OSError as e:
        raise CheckpointError(f"zeroshard: cannot read {name}: {e.strerror or e}") from None
    if not tag or os.sep in tag or tag.startswith(".") or "\0" in tag or "\n" in tag:
        raise CheckpointError(f"zeroshard: {name} does not name a checkpoint ({tag[:80]!r})")
    return tag


def resolve(path, tag: str | None = None) -> str:
    """The checkpoint directory for `path`: a checkpoint dir itself, or a root whose `latest` (or the
    given tag) names one; a tag's link resolved once, to the version it names now. Readers take a
    lease() instead, which resolves and holds the version."""
    found = _find(path, tag)
    if not os.path.isfile(os.path.join(found, SUMS)):
        raise CheckpointError(f"zeroshard: {found} is not a complete zeroshard checkpoint: {SUMS} is missing "
                              "(its save did not finish)")
    return found


def _find(path, tag: str | None) -> str:
    """resolve() without its last check, that the directory found is complete."""
    path = os.path.abspath(os.fspath(path))
    named = tag is None  # the tag comes from `latest`
    if tag is not None:
        found = os.path.join(path, tag)
    elif os.path.isfile(os.path.join(path, META)) or os.path.isfile(os.path.join(path, SUMS)):
        found = path
    elif os.path.isfile(os.path.join(path, LATEST)):
        tag = _latest_tag(path)
        found = os.path.join(path, tag)
    elif not os.path.exists(path):
        raise CheckpointError(f"zeroshard: no checkpoint at {path}: it does not exist")
    else:
        raise CheckpointError(f"zeroshard: no checkpoint at {path}: it has neither a '{LATEST}' file nor {META}")
    if tag is not None and not os.path.isdir(found):
        # A crash while the tag was being replaced: its newest complete version, or (older
        # zeroshard) the checkpoint set aside as .old-<tag>-<id>.
        complete = [n for n in versions(path, tag) if os.path.isfile(os.path.join(path, n, SUMS))] \
            if os.path.isdir(path) else []
        old = sorted(n for n in os.listdir(path) if n.startswith(f".old-{tag}-")) if os.path.isdir(path) else []
        if not complete and not old:
            raise CheckpointError(f"zeroshard: {os.path.join(path, LATEST) if named else path} names {tag!r}, but "
                                  f"{found} does not exist")
        found = os.path.join(path, complete[-1] if complete else old[-1])
    return os.path.realpath(found)
