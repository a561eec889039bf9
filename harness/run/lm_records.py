"""The journal-record piece of the lm-eval model (``harness/run/lm_adapter.py``): the requests already
answered (from the journal of an interrupted run, or earlier in this one), what this process computed
and served, and each task's request keys in order (the worker aggregates by them).

A decoder call that meets an item fault (harness/run/faults.py: out of memory, non-finite logits, a forward
budget run past) is retried in halves down to one row; rows decode exactly as alone, so the answers do not
depend on where the halving stopped. A row that fails alone becomes a failed record (``failed``: the reason,
an empty answer that scores as wrong, no speed figures), journaled like any other: a resume keeps it unless
asked to retry failed items (``retry_failed``)."""

from __future__ import annotations

import os
import signal
import sys

from harness.run.lm_requests import group
from harness.run.store import Journal

PAUSE_ENV = "REFUSION_BENCH_PAUSE_AFTER"  # test hook: see Records._maybe_pause


def failed_record(item: dict, reason: str, rank: int) -> dict:
    """The journal record of a request that failed alone: its reason and an empty answer (scored as wrong)."""
    return {"key": item["key"], "kind": "generate", "task": item["task"], "doc_id": item["doc_id"],
            "idx": item["idx"], "rank": rank, "failed": reason, "response": "", "tokens": [],
            "knobs": item["knobs"]}


class Records:
    """Finished requests by key; with ``journal_dir`` each new one is appended to the rank's fsynced journal
    and a request found there is answered from it instead of being recomputed (resume after ``kill -9``)."""

    def __init__(self, journal_dir: str | None, rank: int, retry_failed: bool = False) -> None:
        self.rank = rank
        self.journal = Journal(journal_dir, rank) if journal_dir else None
        self.done: dict[str, dict] = self.journal.load() if self.journal else {}
        if retry_failed:  # failed items of an earlier session are decoded again (their new record wins on load)
            self.done = {k: r for k, r in self.done.items() if not r.get("failed")}
        self.keys_by_task: dict[str, list[str]] = {}
        self.computed = 0  # requests actually run in this process (not served from the journal)
        self.served = 0  # requests answered from the journal

    def lookup(self, task: str | None, key: str) -> dict | None:
        """Note the request under its task; its record when it is answered already (counted as served)."""
        self.keys_by_task.setdefault(task or "", []).append(key)
        rec = self.done.get(key)
        if rec is not None:
            self.served += 1
        return rec

    def record(self, rec: dict) -> None:
        """A request computed in this process: kept, journaled, counted."""
        self.done[rec["key"]] = rec
        if self.journal is not None:
            self.journal.append(rec)
            self._maybe_pause()
        self.computed += 1

    def answer(self, items: list[dict], decode, batch_size: int, bar) -> list[str]:
        """Responses of prepared ``generate_until`` requests (lm_requests.RequestPlan.prepare), in order: from
        the records where answered already, else decoded in batches of equal knobs (``decode(items)`` -> their
        records: lm_decode.DecoderCall.run) and recorded. ``bar(initial)``: a tqdm progress bar."""
        results: list[str | None] = [None] * len(items)
        todo: list[tuple[int, dict]] = []
        for i, it in enumerate(items):
            rec = self.lookup(it["task"], it["key"])
            if rec is not None:
                results[i] = rec["response"]
            else:
                todo.append((i, it))
        progress = bar(len(items) - len(todo))
        toks_sum, secs_sum = 0, 0.0
        for batch in group(todo, batch_size):
            fresh = [it for _, it in batch if it["key"] not in self.done]  # DP padding repeats a request
            recs = {r["key"]: r for r in self.decode_or_fail(fresh, decode)} if fresh else {}
            for i, it in batch:
                rec = recs.get(it["key"]) or self.done[it["key"]]
                if it["key"] in recs:
                    self.record(rec)
                    toks_sum += rec.get("generated_tokens", 0)
                    secs_sum += rec.get("decode_s", 0.0)
                results[i] = rec["response"]
            progress.update(len(batch))
            if secs_sum > 0:
                progress.set_postfix(tok_s=f"{toks_sum / secs_sum:.1f}")
        progress.close()
        return [r if r is not None else "" for r in results]

    def decode_or_fail(self, items: list[dict], decode) -> list[dict]:
        """``decode(items)``'s records; on an item fault the two halves on their own, down to single rows,
        and a failed record for a row that fails alone (module doc)."""
        from harness.run.faults import free_device_memory, is_oom, item_fault

        try:
            return decode(items)
        except Exception as e:  # noqa: BLE001 - only item faults are handled; anything else goes on up
            reason = item_fault(e)
            if reason is None:
                raise
            if is_oom(e):
                free_device_memory()
        if len(items) > 1:
            half = (len(items) + 1) // 2
            return self.decode_or_fail(items[:half], decode) + self.decode_or_fail(items[half:], decode)
        it = items[0]
        print(f"warning: {it['task']} document {it['doc_id']} failed: {reason} (counted as wrong)",
              file=sys.stderr, flush=True)
        return [failed_record(it, reason, self.rank)]

    def _maybe_pause(self) -> None:
        # Test hook (environment only, never a knob): freeze after N journaled samples so a
        # kill-and-resume test interrupts the run at a chosen point instead of racing a timer.
        stop_after = os.environ.get(PAUSE_ENV)
        if stop_after and sum(1 for _ in open(self.journal.path, encoding="utf-8")) >= int(stop_after):
            print(f"{PAUSE_ENV}={stop_after}: paused after {stop_after} journaled samples", file=sys.stderr,
                  flush=True)
            while True:
                signal.pause()
