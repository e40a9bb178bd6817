"""The events' JSON schema against the Python types: the committed schema file is the
one they render, every frame carries exactly the schema's properties, and
``export_schema --check`` says when the file is stale.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
from event_samples import health, vram
from service_harness import engine_info, memory_plan

from engine.common.units import GiB
from service.events.hub import EventHub
from service.events.schemas import (
    CountersEvent,
    EngineInfoEvent,
    PlanEvent,
    PlanPoint,
    ReplanEvent,
    RequestErrorEvent,
    WorkerEvent,
)


def test_schema_file_matches_python_types():
    from service.events.export_schema import SCHEMA_PATH, render

    assert SCHEMA_PATH.read_text(encoding="utf-8") == render(), (
        "ui-bridge/schema/events.schema.json is out of date: run "
        "`python -m service.events.export_schema` (then `npm run gen` in ui-bridge)"
    )


def test_encoded_frames_carry_exactly_the_schema_properties():
    """Every property the schema lists is sent (the TS types mark them required), and
    nothing else is."""
    from service.events.export_schema import build_schema

    defs = build_schema()["$defs"]
    hub = EventHub()
    point = PlanPoint(kv_pool_bytes=1, num_pages=1, max_prefill_tokens=1)
    for event in (
        health(),
        WorkerEvent(phase="exited", exit_code=None, signal="SIGKILL", reason="killed"),
        vram(GiB),
        PlanEvent(plan=memory_plan()),
        EngineInfoEvent(info=engine_info()),
        ReplanEvent(action="grow_kv", reason="r", before=point, after=point),
        RequestErrorEvent(request_id="r", code="out_of_memory", message="m", action="failed"),
        CountersEvent(),
    ):
        hub.publish(event, coalesce=False)
    snapshot = hub.snapshot()
    seen: set[str] = set()

    def check(value, name):
        seen.add(name)
        component = defs[name]
        assert set(value) == set(component["properties"]), name
        for key, prop in component["properties"].items():
            refs = [p["$ref"] for p in prop.get("anyOf", [prop]) if "$ref" in p]
            items = prop.get("items", {})
            if refs and isinstance(value[key], dict):
                check(value[key], refs[0].rsplit("/", 1)[1])
            elif "$ref" in items:
                for item in value[key]:
                    check(item, items["$ref"].rsplit("/", 1)[1])

    check(msgspec.to_builtins(snapshot), "Snapshot")
    assert {
        "HealthEvent",
        "WorkerEvent",
        "VramEvent",
        "PlanEvent",
        "EngineInfoEvent",
        "EngineInfo",
        "MemoryPlan",
        "ReplanEvent",
        "PlanPoint",
    } <= seen


def test_export_schema_check_flag(tmp_path):
    from service.events.export_schema import main

    out = tmp_path / "s.json"
    assert main(["--check", "--out", str(out)]) == 1
    assert main(["--out", str(out)]) == 0
    assert main(["--check", "--out", str(out)]) == 0
    assert Path(out).read_text().endswith("\n")
