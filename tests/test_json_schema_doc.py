"""docs/json-schema.md against the Report dataclasses and a real report (anti-pattern 9: docs drifting).

Each dataclass's section must document exactly its fields, and no section may call a field "not produced"
that a real analysis fills (the doc once said so of ``blocks``).
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from boomfx.cli.main import main
from boomfx.report import model as rep

DOC = Path(__file__).resolve().parents[1] / "docs" / "json-schema.md"
SECTIONS = {"Report (top level)": rep.Report, "SymbolReport": rep.SymbolReport, "TimeReport": rep.TimeReport,
            "MemoryReport": rep.MemoryReport, "AllocatorReport": rep.AllocatorReport,
            "KernelReport (one per kernel)": rep.KernelReport, "GroupTime": rep.GroupTime,
            "BlockReport": rep.BlockReport}


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2])}


def test_each_section_documents_exactly_its_dataclass_fields() -> None:
    sections = _sections(DOC.read_text())
    for title, cls in SECTIONS.items():
        assert title in sections, f"no section '## {title}'"
        documented = re.findall(r"^\| `(\w+)` \|", sections[title], flags=re.M)
        assert documented == [f.name for f in dataclasses.fields(cls)], title


def test_no_section_calls_a_filled_field_unproduced(capsys, examples_dir: Path) -> None:
    code = main(["analyze", str(examples_dir / "gpt_tiny.pt2"), "--batch", "2", "--seq", "16", "--db", "none",
                 "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    # gpt_tiny has two identical layers h.0, h.1: one block class with two instances
    assert [(b["name"], b["instances"], b["instance_names"]) for b in data["blocks"]] == [("h.*", 2, ["h.0", "h.1"])]
    text = DOC.read_text().lower()
    for claim in ("not produced", "reserved;", "not yet"):
        assert claim not in text, f"docs/json-schema.md still says '{claim}'"


def test_schema_version_is_the_current_one() -> None:
    assert f'currently `"{rep.SCHEMA_VERSION}"`' in DOC.read_text()
