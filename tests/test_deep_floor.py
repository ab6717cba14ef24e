"""``timeshare doctor --deep-floor`` (issue 39, item 4): what a parked worker keeps, step by step,
in a child process per variant. On the CPU build the measure is the child's RSS and the GPU-only
variants (CUDA_MODULE_LOADING) are left out; the figures' shape and the deep level's facts are
checked (the deep level in place here: its compute buffers released in place), not their size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from timeshare.core.diagnostics.deep_floor import STAGES, run_deep_floor


def test_the_deep_floor_is_measured_step_by_step_in_each_variant(smollm2_path: Path) -> None:
    said: list[str] = []
    report = run_deep_floor(str(smollm2_path), n_ctx=1024, prompt_tokens=200, progress=said.append)
    assert report["gpu"] is False and report["target_mib"] == 600
    runs = report["runs"]
    assert [r["variant"] for r in runs] == ["as the workers run", "TIMESHARE_DEEP_INPLACE=1"]
    assert said == [f"deep floor: {r['variant']}" for r in runs]
    for run in runs:
        stages = run["stages"]
        assert list(stages) == list(STAGES) and all(v > 0 for v in stages.values()), stages
        assert stages["loaded"] > stages["cuda_context"]  # the weights, KV and buffers came
        assert run["in_place"] and run["compute_released_bytes"] > 0 and run["deep_note"] == ""
        # the deep level freed the KV cache (1024 cells of SmolLM2: 23,040 bytes each) and more
        assert stages["released_weights"] - stages["released_deep"] >= 1024 * 23_040 * 9 // 10, stages
        parts = run["parts"]
        assert parts["kv_bytes"] == 1024 * 23_040 and parts["deep_floor"] == stages["released_deep"]
        assert run["fit"]["n_ctx"] == 1024


def test_bad_deep_floor_arguments_are_refused(smollm2_path: Path) -> None:
    out = subprocess.run(
        [
            *(sys.executable, "-m", "timeshare", "doctor", "--deep-floor", "--model", str(smollm2_path)),
            *("--prompt-tokens", "0", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 2, out
    assert "--prompt-tokens at least 1" in json.loads(out.stdout)["error"]
