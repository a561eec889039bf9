"""Results on disk: atomic whole-file writes and an append-only per-sample journal.

Two rules keep an interrupted run (even ``kill -9``) recoverable:

- every whole file (metrics, summaries, lm-eval results) is written to a temp
  file in the same folder, fsynced, then ``os.replace``d over the target, so a
  reader sees either the old file or the complete new one, never half of one;
- every finished sample is appended to a JSONL journal as one line and fsynced
  before the next sample starts. A crash can leave at most a torn last line,
  which ``Journal.load`` drops (that sample is simply computed again).

A write that fails on a full disk or quota (ENOSPC, EDQUOT) leaves no temp file behind and raises
an OSError that names the target path (harness/run/faults.py turns it into one line).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator


_UMASK = os.umask(0o022)
os.umask(_UMASK)


def maybe_fail_write(path: Path, f, text: str) -> None:
    """Test hook (harness/run/faults.py, ``"enospc": SITE``): a write to a path containing SITE writes
    half of its text, then fails as a full disk would."""
    site = os.environ.get("REFUSION_BENCH_FAULTS") and _enospc_site()
    if site and site in str(path):
        f.write(text[: len(text) // 2])
        f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (injected)", str(path))


def _enospc_site() -> str | None:
    from harness.run.faults import injected

    return injected().get("enospc")


def _named(e: BaseException, path: Path) -> BaseException:
    """A full-disk OSError from a write names no file: the same error naming the target's path."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) and not e.filename:
        return OSError(e.errno, e.strerror, str(path))
    return e


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o666 & ~_UMASK)  # as open() would create it; mkstemp makes it 0600
            maybe_fail_write(path, f, text)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        named = _named(e, path)
        if named is not e:
            raise named from e
        raise


def _default(obj: Any) -> Any:
    # numpy scalars / tensors / paths that lm-eval results can carry
    if hasattr(obj, "item") and callable(obj.item):
        try:
            return obj.item()
        except (ValueError, RuntimeError):
            pass
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=_default, ensure_ascii=False) + "\n"


def atomic_save_figure(fig, path: str | os.PathLike, dpi: int = 90) -> None:
    """A matplotlib figure written as PNG beside ``path`` and moved into place, then closed."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=dpi)
        maybe_fail_write(path, _Discard(), "")
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        named = _named(e, path)
        if named is not e:
            raise named from e
        raise
    finally:
        plt.close(fig)


class _Discard:
    """A file that takes writes and keeps nothing (the figure hook has no text to half-write)."""

    def write(self, _text: str) -> None:
        pass

    def flush(self) -> None:
        pass


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, dumps(obj))


def atomic_write_jsonl(path: str | os.PathLike, rows: Iterable[Any]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True, default=_default, ensure_ascii=False) + "\n"
                                    for r in rows))


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_json_or_none(path: str | os.PathLike) -> Any:
    """``read_json``, or None when the file is missing or unreadable (a result an earlier step may not have
    written yet, or wrote before a crash: the caller measures again)."""
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None


def request_key(*parts: Any) -> str:
    """Stable id of one request: same task, document, prompt, generation settings and knobs -> same key."""
    blob = json.dumps(parts, sort_keys=True, default=_default, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:32]


class Journal:
    """Append-only JSONL of finished samples, one fsynced line each, keyed by ``record["key"]``.

    Several processes (data-parallel ranks) each append to their own file in one
    folder; ``load`` reads all of them, so a resumed run may use a different
    number of processes than the interrupted one.
    """

    def __init__(self, folder: str | os.PathLike, rank: int = 0):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / f"journal.rank{rank}.jsonl"
        self._fh = None

    def load(self) -> dict[str, dict]:
        done: dict[str, dict] = {}
        for p in sorted(self.folder.glob("journal.rank*.jsonl")):
            with open(p, encoding="utf-8") as f:
                for line in f:
                    if not line.endswith("\n"):
                        break  # torn last line from a crash: recompute that sample
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    done[rec["key"]] = rec
        return done

    def append(self, record: dict) -> None:
        if "key" not in record:
            raise ValueError("journal records need a 'key'")
        if self._fh is None:
            self._repair_tail()
            self._fh = open(self.path, "a", encoding="utf-8")
        line = json.dumps(record, sort_keys=True, default=_default, ensure_ascii=False) + "\n"
        try:
            maybe_fail_write(self.path, self._fh, line)
            self._fh.write(line)
            self._fh.flush()
            os.fsync(self._fh.fileno())
        except OSError as e:
            # A torn line may be on disk: the next load drops it, the next append cuts it off first.
            self.close_quietly()
            named = _named(e, self.path)
            if named is not e:
                raise named from e
            raise

    def close_quietly(self) -> None:
        """Close after a failed write (the buffered rest may fail to flush on a full disk too)."""
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass
            self._fh = None

    def _repair_tail(self) -> None:
        # A torn last line would glue itself to the next record: cut it off first.
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data[: data.rfind(b"\n") + 1]
            with open(self.path, "wb") as f:
                f.write(keep)
                f.flush()
                os.fsync(f.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Build a whole folder in a temp sibling and swap it in at the end.

    Yields the temp folder to write into. On success it replaces ``target`` (the old
    copy is moved aside first and removed after), so a reader sees the old folder or
    the complete new one; on any error the temp folder is removed and ``target`` is
    left as it was.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_UMASK)  # as mkdir would make it (mkdtemp makes 0700): reports are for reading
    try:
        yield tmp
        old = None
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
            os.replace(target, old / target.name)
        try:
            os.replace(tmp, target)
        except BaseException:
            if old is not None:  # put the previous copy back
                os.replace(old / target.name, target)
                shutil.rmtree(old, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
