"""``python -m benchmarks.under_load --quick`` runs end to end (tiny layers; no timing asserts).

It starts and stops its own spinning subprocess and prints one row per (condition, workload).
"""

from __future__ import annotations

import json


def test_under_load_quick(tmp_path, capsys):
    from benchmarks import under_load

    out = tmp_path / "under_load.json"
    rc = under_load.main(["--quick", "--rounds", "2", "--steps", "2", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    for w in under_load.WORKLOADS:
        for cond in under_load.CONDITIONS:
            assert any(
                line.startswith(f"| {w} ") and f"| {cond} |" in line for line in table.splitlines()
            ), (w, cond, table)
    data = json.loads(out.read_text())
    assert set(data["results"]) == set(under_load.CONDITIONS)
    for by_setting in data["results"]["load"].values():
        assert {k: len(v) for k, v in by_setting.items()} == {"1": 2, "2": 2, "default": 2}
