"""The restore's log line (issue 38): an overlapped restore said "0.00 GB/s" every time; its rate
is left out while its uploads go on, and is the real one when they were over before it returned."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import llama_cpp  # before numpy
import pytest
from _residency_util import load
from timeshare.core.residency import Residency, ResidencyOptions


@pytest.mark.parametrize("overlap", [True, False])
def test_the_restore_line_never_says_zero_gb_per_s(
    smollm2_path: Path, caplog: pytest.LogCaptureFixture, overlap: bool
) -> None:
    llm: llama_cpp.Llama = load(smollm2_path)
    try:
        res = Residency.attach(
            llm, smollm2_path, ResidencyOptions(mode="inplace", parts=8, overlap_restore=overlap)
        )
        reports = []
        with caplog.at_level(logging.INFO, logger="timeshare.core.residency"):
            for _ in range(3):
                res.release()
                reports.append(res.restore())
                llm.eval([1])  # the first decode after an overlapped restore waits for its uploads
                res.settle()
        res.close()
    finally:
        llm.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("restored ")]
    assert len(lines) == 3
    for line, report in zip(lines, reports, strict=True):
        assert report.overlapped == overlap
        rate = re.search(r", ([0-9.]+) GB/s", line)
        if report.pending_bytes:
            assert rate is None, line  # still uploading: no rate to tell yet
        else:
            assert rate is not None and float(rate.group(1)) > 0, line
