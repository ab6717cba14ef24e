"""Full disks (issue 26): `timeshare serve` on a full home says in one line what is full and where
and exits 2, whether the free-space check sees it (a fake statvfs) or a write finds it (os.pwrite
or a file write raising ENOSPC); nothing is left holding the instance lock."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest
from timeshare.core import diskspace, instance, paths

from timeshare import cli

_INFO = re.compile(r"^\d{4}-\d\d-\d\d \S+ INFO[: ]")  # serve's plain format: "INFO: message"


def _serve(capsys: pytest.CaptureFixture[str], config: Path) -> tuple[int, list[str]]:
    """(exit status, the lines on stderr other than INFO log lines and the notice that no model
    is configured)"""
    rc = cli.main(["serve", "--port", "0", "--config", str(config)])
    lines = capsys.readouterr().err.splitlines()
    return rc, [
        line
        for line in lines
        if line.strip() and "no models are configured" not in line and not _INFO.match(line)
    ]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.toml"
    path.write_text("")  # no models: serve would run an empty pool
    return path


class _FullStatvfs:
    """os.statvfs for a disk with ``free`` bytes left (f_bavail * f_frsize)."""

    def __init__(self, real: object, free: int) -> None:
        self.real = real
        self.free = free

    def __call__(self, path: object) -> os.statvfs_result:
        st = self.real(path)  # type: ignore[operator]
        fields = list(st)
        fields[0] = fields[1] = 4096  # f_bsize, f_frsize
        fields[4] = self.free // 4096  # f_bavail
        return os.statvfs_result(fields)


def test_serve_on_a_full_home_refuses_in_one_line_before_writing(
    capsys: pytest.CaptureFixture[str], config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "statvfs", _FullStatvfs(os.statvfs, free=8192))
    rc, err = _serve(capsys, config)
    assert rc == 2
    assert len(err) == 1, err
    line = err[0]
    assert "is full" in line and str(paths.runtime_dir()) in line and "free some space" in line
    assert "Traceback" not in line
    assert not (paths.runtime_dir() / "api.json").exists()
    assert instance.running_instance() is None


def test_a_disk_with_room_passes_the_check() -> None:
    diskspace.check_room({"runtime dir": paths.runtime_dir()}, need=1)  # no error


def test_the_instance_lock_write_failing_for_space_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", no_space)
    rc, err = _serve(capsys, config)
    assert rc == 2 and len(err) == 1, err
    assert "the instance lock" in err[0] and str(instance.lock_file()) in err[0] and "disk is full" in err[0]
    assert instance.running_instance() is None  # the lock was let go


def test_the_address_file_write_failing_for_space_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        if ".api.json." in target:
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    rc, err = _serve(capsys, config)
    assert rc == 2
    assert len(err) == 1, err
    assert "the API address file" in err[0] and "quota" in err[0]
    assert not (paths.runtime_dir() / "api.json").exists()
    assert instance.running_instance() is None


def test_other_write_errors_are_not_called_a_full_disk() -> None:
    assert diskspace.is_disk_full(OSError(errno.ENOSPC, "x"))
    assert not diskspace.is_disk_full(OSError(errno.EACCES, "x"))
    try:
        try:
            raise OSError(errno.EDQUOT, "quota")
        except OSError as exc:
            raise RuntimeError("wrapped") from exc
    except RuntimeError as wrapped:
        assert diskspace.is_disk_full(wrapped)
