"""bench.memory on a tiny model: both sides run in processes of their own and the table compares
them (``python -m bench.memory`` runs the default model at 256 rows)."""

from __future__ import annotations

import json

from bench import memory
from tiny_models import make_tiny_model


def test_a_run_with_the_bound_and_one_without_are_reported(tmp_path, capsys):
    model = make_tiny_model(tmp_path / "m", "LlamaForCausalLM", tie=True, seed=2)
    out = tmp_path / "memory.json"
    assert memory.main(["--model", str(model), "--prompts", "8", "--max-tokens", "4", "--rounds", "1",
                        "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [len(report["runs"][side]) for side in ("bound", "off")] == [1, 1]
    assert report["runs"]["off"][0]["trims"] == 0 and all(r > 0 for r in report["time_ratios"])
    text = capsys.readouterr().out
    assert "off (until idle)" in text and "64 MiB" in text and "time, bound / off" in text
