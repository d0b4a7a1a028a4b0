"""`jagg services` (tasks/services.py): its pid file is checked against the process it names, so a stale record never
signals a process that took over the pid."""

from __future__ import annotations




def test_services_never_signal_a_process_that_took_over_their_pid(tmp_path, monkeypatch, capsys):
    import json
    import subprocess
    import sys

    import tasks.services as services

    monkeypatch.setattr(services, "STATE", tmp_path)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        for record in ({"pid": stranger.pid, "started": 12345.0}, stranger.pid):  # stale, and the old format
            (tmp_path / "pids.json").write_text(json.dumps({"server": record}))
            assert services.main(["status"]) == 0
            assert "running" not in capsys.readouterr().out
            services.down()
            assert stranger.poll() is None, "down signalled a stranger"
        # a service of ours (its start time recorded) is still stopped
        ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        services._write_pids({"server": ours.pid})
        services.main(["status"])
        assert "running" in capsys.readouterr().out
        services.down()
        assert ours.wait(timeout=20) is not None
    finally:
        stranger.kill()
        stranger.wait()
