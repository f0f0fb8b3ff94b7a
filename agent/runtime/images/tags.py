"""`TagIndex`: which manifest each tag named when it was last pulled, kept in one file on the
node so that a pull policy that allows the cache can find the image by its tag.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import trio

from workerapi.reference import (
    DIGEST_RE,
)

log = logging.getLogger("levers9.images")


class TagIndex:
    """reference -> digest of what the tag named when it was last pulled, in one JSON file.

    Written whole (temp file, fsync, rename) under a lock; a file that cannot be read is
    treated as empty, which only costs a registry round trip."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = trio.Lock()
        self._tags: dict[str, str] | None = None

    def _load(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("tag index %s is unreadable (%s); starting it afresh", self.path, exc)
            return {}
        tags = data.get("tags") if isinstance(data, dict) else None
        if not isinstance(tags, dict):
            return {}
        return {k: v for k, v in tags.items() if isinstance(v, str) and DIGEST_RE.fullmatch(v)}

    def _write(self, tags: dict[str, str]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps({"version": 1, "tags": tags}, indent=1, sort_keys=True).encode()
        fd, temp = tempfile.mkstemp(prefix=".tags-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(body)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temp, self.path)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    async def get(self, reference: str) -> str | None:
        async with self._lock:
            if self._tags is None:
                self._tags = await trio.to_thread.run_sync(self._load)
            return self._tags.get(reference)

    async def put(self, reference: str, digest: str) -> None:
        async with self._lock:
            if self._tags is None:
                self._tags = await trio.to_thread.run_sync(self._load)
            if self._tags.get(reference) == digest:
                return
            tags = {**self._tags, reference: digest}
            try:
                await trio.to_thread.run_sync(self._write, tags)
            except OSError as exc:
                # The pull itself succeeded; the next one just asks the registry again.
                log.warning("tag index %s could not be written: %s", self.path, exc)
                return
            self._tags = tags
