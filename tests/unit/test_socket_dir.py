"""The engine's socket folder (tokenloom/engine/socket_dir.py): a process killed before it could remove its
folder leaves it behind, and the next start removes it; a live process's folder and anything else stay."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from tokenloom.engine.socket_dir import make_socket_dir, remove_stale_socket_dirs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def killed_process_folder(parent) -> tuple[str, int]:
    """A real process makes its socket folder under `parent` and is killed with SIGKILL."""
    code = ("import sys; from tokenloom.engine.socket_dir import make_socket_dir; "
            "print(make_socket_dir(), flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(parent), "PYTHONPATH": REPO})
    folder = proc.stdout.readline().strip()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return folder, proc.pid


def test_a_killed_processs_folder_is_removed_at_the_next_start(tmp_path):
    folder, pid = killed_process_folder(tmp_path)
    assert os.path.isdir(folder) and f"tokenloom-{pid}-" in folder
    assert remove_stale_socket_dirs(str(tmp_path)) == [folder]
    assert not os.path.exists(folder)


def test_a_live_processs_folder_stays(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    mine = make_socket_dir()
    assert os.path.basename(mine).startswith(f"tokenloom-{os.getpid()}-")
    assert remove_stale_socket_dirs(str(tmp_path)) == []
    assert os.path.isdir(mine)


def test_folders_not_named_after_a_process_stay(tmp_path):
    for name in ("tokenloom-abc123", "tokenloom-test-cache-x1", "other-99999999-x"):
        (tmp_path / name).mkdir()
    assert remove_stale_socket_dirs(str(tmp_path)) == []
    assert len(list(tmp_path.iterdir())) == 3
