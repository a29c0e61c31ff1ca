"""Files mmgoal writes (mmgoal/files.py): whole or not at all, never through a link."""

import os

import pytest

from mmgoal import files


def test_a_write_replaces_the_file_and_never_follows_a_link(tmp_path):
    yours = tmp_path / "yours.txt"
    yours.write_text("yours")
    target = tmp_path / "out.json"
    files.write_text(target, "new")
    assert target.read_text() == "new"
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~files.umask())
    # a link at the target: refused, the file it points at untouched
    target.unlink()
    target.symlink_to(yours)
    with pytest.raises(files.LinkedPathError, match=rf"^{target} is a symbolic link \(to "
                                                    rf"{yours}\); mmgoal writes no file "
                                                    rf"through a link it did not make"):
        files.write_text(target, "new")
    assert yours.read_text() == "yours"
    # a link planted where the temporary file goes is removed, not written through
    target.unlink()
    planted = tmp_path / f".out.json.tmp-{os.getpid()}"
    planted.symlink_to(yours)
    files.write_text(target, "new")
    assert target.read_text() == "new" and yours.read_text() == "yours"
    assert not os.path.lexists(planted)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")

    def fails(tmp):
        tmp.write_text("half")
        raise OSError("no space left")

    with pytest.raises(OSError, match="no space left"):
        files.write_atomically(target, fails)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_appends_and_staged_folders_refuse_links(tmp_path):
    yours = tmp_path / "yours.txt"
    yours.write_text("yours")
    log = tmp_path / "metrics.jsonl"
    log.symlink_to(yours)
    with pytest.raises(files.LinkedPathError, match=rf"^{log} is a symbolic link"):
        files.open_unlinked(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "the log")
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "kept.bin").write_text("kept")
    (folder / "b.json").symlink_to(yours)
    with pytest.raises(files.LinkedPathError, match=rf"^{folder / 'b.json'} is a symbolic "):
        with files.staged_folder(folder) as staging:
            for name in ("a.json", "b.json", "kept.bin"):
                (staging / name).write_text("new")
    # checked before any file moves: the folder is as it was, the staging folder gone
    assert sorted(p.name for p in folder.iterdir()) == ["b.json", "kept.bin"]
    assert (folder / "kept.bin").read_text() == "kept" and yours.read_text() == "yours"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "metrics.jsonl",
                                                          "yours.txt"]
    (folder / "b.json").unlink()
    with files.staged_folder(folder) as staging:
        (staging / "sub").mkdir()
        for name in ("a.json", "kept.bin", "sub/c.json"):
            (staging / name).write_text("new")
    assert {p.relative_to(folder).as_posix(): p.read_text() for p in folder.rglob("*")
            if p.is_file()} == {"a.json": "new", "kept.bin": "new", "sub/c.json": "new"}
