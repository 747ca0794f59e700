"""The Grafana dashboard's queries (checked against the metrics that exist)."""
from __future__ import annotations

import json
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent


def dashboard_queries() -> list[str]:
    dashboard = json.loads((ROOT / "monitoring" / "grafana" / "pipeline-dashboard.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
