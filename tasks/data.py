"""Where benchmark data comes from, decided in one place.

If ``REFUSION_DATA_DIR`` is set, every benchmark is read from local files laid
out as ``python -m harness data`` lists them (``<benchmark>/<split>.jsonl``; GPQA inside its
password-protected zip, read in memory and never extracted). Otherwise the
standard Hugging Face dataset ids are used (for users who are online).

    resolve("gsm8k", "test")    -> DataSource (where it would be read from)
    load_rows("gsm8k", "test")  -> list[dict] (the rows, HF field names)
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "REFUSION_DATA_DIR"
GPQA_ZIP_PASSWORD = b"deserted-untie-orchid"  # published in the GPQA README


@dataclass(frozen=True)
class Benchmark:
    files: dict[str, str]  # split -> path relative to the data dir ("zip::member" for zipped CSV)
    hf_path: str
    hf_name: str | None = None
    hf_splits: dict[str, str] | None = None  # our split name -> HF split name, when they differ
    # Fields the task templates read: a row without one is reported with its file and line here,
    # not as a template error deep inside lm-eval.
    fields: tuple[str, ...] = ()


BENCHMARKS: dict[str, Benchmark] = {
    "gsm8k": Benchmark({"test": "gsm8k/test.jsonl"}, "openai/gsm8k", "main", fields=("question", "answer")),
    "math": Benchmark({"test": "math/test.jsonl"}, "EleutherAI/hendrycks_math",
                      fields=("problem", "solution", "type")),
    "math500": Benchmark({"test": "math/math500_test.jsonl"}, "HuggingFaceH4/MATH-500",
                         fields=("problem", "answer")),
    "humaneval": Benchmark({"test": "humaneval/test.jsonl"}, "openai/openai_humaneval",
                           fields=("prompt", "test", "entry_point")),
    "mbpp": Benchmark(
        {s: f"mbpp/{s}.jsonl" for s in ("test", "train", "validation", "prompt")},
        "google-research-datasets/mbpp", "full", fields=("text", "code", "test_list")),
    "arc_challenge": Benchmark({"test": "arc_challenge/test.jsonl"}, "allenai/ai2_arc", "ARC-Challenge",
                               fields=("question", "choices", "answerKey")),
    "mmlu_pro": Benchmark(
        {"test": "mmlu_pro/test.jsonl", "validation": "mmlu_pro/validation.jsonl"}, "TIGER-Lab/MMLU-Pro",
        fields=("question", "options", "answer", "category")),
    "gpqa": Benchmark(
        {s: f"gpqa/dataset.zip::dataset/gpqa_{s}.csv" for s in ("main", "diamond", "extended")},
        "Idavidrein/gpqa", None, {s: "train" for s in ("main", "diamond", "extended")},
        fields=("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")),
}
OFFLINE_VARS = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
# The hendrycks_math hub dataset has one config per subject.
MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra",
                 "number_theory", "prealgebra", "precalculus")


class DataError(Exception):
    """Bad benchmark name or split, or data missing where it was looked for."""


@dataclass(frozen=True)
class DataSource:
    benchmark: str
    split: str
    local_path: Path | None  # set when REFUSION_DATA_DIR is used
    zip_member: str | None   # CSV member inside local_path (GPQA)
    hf_path: str
    hf_name: str | None
    hf_split: str

    def describe(self) -> str:
        if self.local_path is not None:
            return f"{self.local_path}" + (f" [{self.zip_member}]" if self.zip_member else "")
        return f"hf:{self.hf_path}" + (f"/{self.hf_name}" if self.hf_name else "") + f" split={self.hf_split}"


def resolve(benchmark: str, split: str = "test", data_dir: str | os.PathLike | None = None) -> DataSource:
    """Decide where ``benchmark``/``split`` is read from (no I/O beyond an existence check)."""
    if benchmark not in BENCHMARKS:
        raise DataError(f"unknown benchmark {benchmark!r}; known: {', '.join(BENCHMARKS)}")
    b = BENCHMARKS[benchmark]
    if split not in b.files:
        raise DataError(f"benchmark {benchmark!r} has no split {split!r}; known: {', '.join(b.files)}")
    hf_split = (b.hf_splits or {}).get(split, split)
    hf_name = b.hf_name
    if benchmark == "gpqa":
        hf_name = f"gpqa_{split}"
    root = data_dir if data_dir is not None else os.environ.get(ENV_VAR)
    if not root:
        return DataSource(benchmark, split, None, None, b.hf_path, hf_name, hf_split)
    rel, _, member = b.files[split].partition("::")
    path = Path(root).expanduser() / rel
    if not path.is_file():
        raise DataError(f"{benchmark}/{split}: no file at {path}; set {ENV_VAR} to a folder laid out "
                        f"as `python -m harness data` lists them, or unset it to use the Hugging Face hub")
    return DataSource(benchmark, split, path, member or None, b.hf_path, hf_name, hf_split)


def _read_jsonl(path: Path, fields: tuple[str, ...] = ()) -> list[dict]:
    """Rows of a JSONL file; a bad line is a DataError naming the file and its line number."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}, line {n}: not valid JSON ({e.msg} at column {e.colno})") from None
            _check_row(row, fields, f"{path}, line {n}")
            rows.append(row)
    return rows


def _check_row(row: object, fields: tuple[str, ...], where: str) -> None:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in fields if k not in row]
    if missing:
        raise DataError(f"{where}: row has no field {', '.join(repr(k) for k in missing)} "
                        f"(needed: {', '.join(fields)})")


def offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in OFFLINE_VARS)


def _read_zipped_csv(path: Path, member: str) -> list[dict]:
    # In memory only: the GPQA authors ask that questions never sit on disk in plain text.
    with zipfile.ZipFile(path) as zf:
        raw = zf.read(member, pwd=GPQA_ZIP_PASSWORD)
    return list(csv.DictReader(io.StringIO(raw.decode("utf-8"))))


def load_rows(benchmark: str, split: str = "test", data_dir: str | os.PathLike | None = None) -> list[dict]:
    """Rows of one benchmark split as dicts with the Hugging Face field names."""
    src = resolve(benchmark, split, data_dir)
    fields = BENCHMARKS[benchmark].fields
    if src.local_path is not None:
        if src.zip_member:
            rows = _read_zipped_csv(src.local_path, src.zip_member)
            for i, row in enumerate(rows, 2):  # line 1 is the CSV header
                _check_row(row, fields, f"{src.describe()}, line {i}")
            return rows
        return _read_jsonl(src.local_path, fields)
    import datasets  # only for online users; slow to import

    try:
        if benchmark == "math":
            rows = []
            for subject in MATH_SUBJECTS:
                rows.extend(datasets.load_dataset(src.hf_path, subject, split=src.hf_split))
        else:
            rows = list(datasets.load_dataset(src.hf_path, src.hf_name, split=src.hf_split))
    except Exception as e:  # noqa: BLE001 - offline, datasets raises several types that all mean "not here"
        if not offline():
            raise
        expected = Path("<dir>") / BENCHMARKS[benchmark].files[split].partition("::")[0]
        flags = ", ".join(f"{v}={os.environ[v]}" for v in OFFLINE_VARS if os.environ.get(v))
        raise DataError(f"{benchmark}/{split}: data is not available offline ({flags}, and {src.hf_path} is not "
                        f"in the Hugging Face cache); set {ENV_VAR} to a folder of benchmark files "
                        f"(it reads {expected})") from e
    for i, row in enumerate(rows):
        _check_row(row, fields, f"{src.describe()}, row {i}")
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m harness data",
                                description=f"Show where each benchmark split is read from ({ENV_VAR}).")
    p.parse_args(argv)
    for name, b in BENCHMARKS.items():
        for split in b.files:
            try:
                where = resolve(name, split).describe()
            except DataError as e:
                where = f"MISSING: {e}"
            print(f"{name:<14} {split:<10} {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
