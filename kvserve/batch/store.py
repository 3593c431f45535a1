"""BatchStore: files, batches and each line's result, durable in SQLite (WAL).

Everything a batch needs to resume lives here: a server killed at any point restarts,
finds its in-progress batches and runs only the lines without a result. A line's result
is committed in the same transaction as the batch's counts, and the output and error
files are written from the table, so every custom_id appears exactly once in one of
them. File contents sit in ``<state_dir>/files/``, written to a temporary name and
renamed, so a file is either absent or complete.
"""
from __future__ import annotations

import json
import os
import secrets
import sqlite3
import time
from pathlib import Path

from kvserve.batch.lines import InputLine, output_line, unrun_line

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, metadata TEXT, status TEXT NOT NULL, errors TEXT,
    output_file_id TEXT, error_file_id TEXT, created_at INTEGER NOT NULL,
    in_progress_at INTEGER, expires_at INTEGER, finalizing_at INTEGER,
    completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER,
    cancelled_at INTEGER, total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL,
    body TEXT NOT NULL, done INTEGER NOT NULL DEFAULT 0, ok INTEGER, result TEXT,
    PRIMARY KEY (batch_id, line));
"""
WINDOW_S = 24 * 3600
TIMESTAMPS = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
              "failed_at", "expired_at", "cancelling_at", "cancelled_at")
ACTIVE = ("in_progress", "finalizing", "cancelling")


def _id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


class BatchStore:
    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir)
        (self.dir / "files").mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.dir / "batches.sqlite3", isolation_level=None)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # WAL: safe against a killed process
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    # -- files ---------------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.dir / "files" / file_id

    def add_file(self, purpose: str, filename: str, data: bytes,
                 file_id: str | None = None) -> dict:
        file_id = file_id or _id("file-")
        tmp = self.file_path(file_id).with_suffix(".part")
        tmp.write_bytes(data)
        os.replace(tmp, self.file_path(file_id))
        self.db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?)",
                        (file_id, purpose, filename, len(data), int(time.time())))
        return self.file(file_id)

    def file(self, file_id: str) -> dict | None:
        row = self.db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            return None
        return {"id": row["id"], "object": "file", "bytes": row["bytes"],
                "created_at": row["created_at"], "filename": row["filename"],
                "purpose": row["purpose"], "status": "processed", "status_details": None,
                "expires_at": None}

    def files(self, purpose: str | None, after: str | None, limit: int) -> tuple[list, bool]:
        return self._page("files", self.file, after, limit,
                          "purpose = ?" if purpose else None, (purpose,) if purpose else ())

    def delete_file(self, file_id: str) -> bool:
        gone = self.db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        self.file_path(file_id).unlink(missing_ok=True)
        return bool(gone)

    # -- batches -------------------------------------------------------------------------

    def create_batch(self, input_file_id: str, endpoint: str, window: str,
                     metadata: dict | None, lines: list[InputLine], errors: list[dict]) -> dict:
        """A batch whose input was validated: failed with ``errors``, or in progress."""
        now = int(time.time())
        batch_id = _id("batch_")
        status = "failed" if errors else "in_progress"
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, "
                "metadata, status, errors, created_at, in_progress_at, failed_at, expires_at, "
                "total) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (batch_id, endpoint, input_file_id, window, json.dumps(metadata),
                 status, json.dumps(errors) if errors else None, now,
                 None if errors else now, now if errors else None, now + WINDOW_S,
                 0 if errors else len(lines)))
            self.db.executemany(
                "INSERT INTO lines (batch_id, line, custom_id, body) VALUES (?, ?, ?, ?)",
                [(batch_id, ln.line, ln.custom_id, json.dumps(ln.body)) for ln in lines]
                if not errors else [])
        return self.batch(batch_id)

    def batch(self, batch_id: str) -> dict | None:
        row = self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            return None
        errors = json.loads(row["errors"]) if row["errors"] else None
        return {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
                "errors": {"object": "list", "data": errors} if errors else None,
                "input_file_id": row["input_file_id"],
                "completion_window": row["completion_window"], "status": row["status"],
                "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
                **{t: row[t] for t in TIMESTAMPS},
                "request_counts": {"total": row["total"], "completed": row["completed"],
                                   "failed": row["failed"]},
                "metadata": json.loads(row["metadata"]) if row["metadata"] else None}

    def batches(self, after: str | None, limit: int) -> tuple[list, bool]:
        return self._page("batches", self.batch, after, limit)

    def active(self) -> list[dict]:
        rows = self.db.execute(
            f"SELECT id FROM batches WHERE status IN ({','.join('?' * len(ACTIVE))}) "
            "ORDER BY created_at, id", ACTIVE).fetchall()
        return [self.batch(r["id"]) for r in rows]

    def set_status(self, batch_id: str, status: str) -> None:
        stamp = {"in_progress": "in_progress_at", "finalizing": "finalizing_at",
                 "completed": "completed_at", "failed": "failed_at", "expired": "expired_at",
                 "cancelling": "cancelling_at", "cancelled": "cancelled_at"}[status]
        self.db.execute(f"UPDATE batches SET status = ?, {stamp} = ? WHERE id = ?",
                        (status, int(time.time()), batch_id))

    def queued_lines(self, batch_id: str, limit: int, skip: set[int]) -> list[InputLine]:
        """Lines without a result, in order, leaving out those in ``skip`` (running)."""
        rows = self.db.execute(
            "SELECT line, custom_id, body FROM lines WHERE batch_id = ? AND done = 0 "
            "ORDER BY line LIMIT ?", (batch_id, limit + len(skip))).fetchall()
        return [InputLine(r["line"], r["custom_id"], json.loads(r["body"]))
                for r in rows if r["line"] not in skip][:limit]

    def num_queued(self, batch_id: str) -> int:
        return self.db.execute("SELECT COUNT(*) FROM lines WHERE batch_id = ? AND done = 0",
                               (batch_id,)).fetchone()[0]

    def record(self, batch_id: str, line: int, status: int, request_id: str, body) -> None:
        """A line's result and the batch's counts, in one transaction."""
        ok = 200 <= status < 300
        with self.db:
            self.db.execute("BEGIN")
            done = self.db.execute(
                "UPDATE lines SET done = 1, ok = ?, result = ? WHERE batch_id = ? AND "
                "line = ? AND done = 0",
                (int(ok), json.dumps([status, request_id, body]), batch_id, line)).rowcount
            if done:
                self.db.execute(f"UPDATE batches SET {'completed' if ok else 'failed'} = "
                                f"{'completed' if ok else 'failed'} + 1 WHERE id = ?",
                                (batch_id,))

    def finalize(self, batch_id: str, final_status: str) -> dict:
        """Write the output and error files from the lines table (again after a crash:
        the file ids are the batch's own, so nothing is written twice), then close the
        batch with ``final_status``. Lines never run go to the error file."""
        code = {"expired": "batch_expired", "cancelled": "batch_cancelled"}.get(final_status)
        out, err = [], []
        suffix = batch_id.removeprefix("batch_")
        for row in self.db.execute("SELECT * FROM lines WHERE batch_id = ? ORDER BY line",
                                   (batch_id,)):
            line_id = f"batch_req_{suffix}_{row['line']}"
            if row["done"]:
                status, request_id, body = json.loads(row["result"])
                (out if row["ok"] else err).append(
                    output_line(line_id, row["custom_id"], status, request_id, body))
            else:
                err.append(unrun_line(line_id, row["custom_id"], code or "batch_failed",
                                      f"the batch {final_status} before this line ran"))
        ids = {}
        for kind, rows in (("output", out), ("error", err)):
            if rows:
                data = "".join(json.dumps(r) + "\n" for r in rows).encode()
                ids[kind] = self.add_file("batch_output", f"{batch_id}_{kind}.jsonl", data,
                                          file_id=f"file-{suffix}-{kind}")["id"]
        self.db.execute("UPDATE batches SET output_file_id = ?, error_file_id = ? WHERE id = ?",
                        (ids.get("output"), ids.get("error"), batch_id))
        self.set_status(batch_id, final_status)
        return self.batch(batch_id)

    # -- pages ---------------------------------------------------------------------------

    def _page(self, table: str, get, after: str | None, limit: int, where: str | None = None,
              args: tuple = ()) -> tuple[list, bool]:
        """Newest first; ``after``: an id of the previous page."""
        clauses, params = ([where] if where else []), list(args)
        if after:
            ref = self.db.execute(f"SELECT created_at FROM {table} WHERE id = ?",
                                  (after,)).fetchone()
            if ref is None:
                raise KeyError(after)
            clauses.append("(created_at < ? OR (created_at = ? AND id < ?))")
            params += [ref["created_at"], ref["created_at"], after]
        sql = f"SELECT id FROM {table}"
        if clauses:
            sql += " WHERE " + " AND ".join(clauses)
        rows = self.db.execute(sql + " ORDER BY created_at DESC, id DESC LIMIT ?",
                               (*params, limit + 1)).fetchall()
        return [get(r["id"]) for r in rows[:limit]], len(rows) > limit
