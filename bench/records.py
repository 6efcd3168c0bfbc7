"""The measurement records in bench/results/*.json (``bench/results_tables.py`` renders them):
a bench adds its record, or replaces the one of the same name."""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def save_record(results: str, record: dict) -> Path:
    """Write ``record`` into ``bench/results/<results>.json``, replacing a record of its name."""
    return write_record(RESULTS / f"{results}.json", record)


def write_record(path: Path, record: dict) -> Path:
    """Write ``record`` into the records file ``path``, replacing a record of its name."""
    records = [r for r in json.loads(path.read_text()) if r["name"] != record["name"]] if path.is_file() else []
    records.append(record)
    path.write_text(json.dumps(records, indent=1) + "\n")
    return path
