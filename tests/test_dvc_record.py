"""What `jagg run` records in DVC (tasks/dvc_record.py): nothing for a flow run its pipeline does not describe, each
time with the line that says why (a recorded run is tests/test_dvc_repro.py's: up to date, a bare `dvc repro` runs
nothing)."""

from __future__ import annotations

import shutil
from pathlib import Path

from tasks.dvc_record import record_in_dvc

REPO = Path(__file__).resolve().parents[1]


def _project(tmp_path: Path) -> Path:
    root = tmp_path / "p"
    root.mkdir()
    for f in ("params.yaml", "dvc.yaml", "pipelines/template.yaml", ".dvc/config"):
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / f, root / f)
    return root


def test_a_flow_run_no_pipeline_describes_is_not_recorded(tmp_path):
    root = _project(tmp_path)
    lock = root / "dvc.lock"
    said = record_in_dvc("toy", overrides={"train.iterations": 3}, params_file=None, root=root)
    assert said == ("DVC's record left as it is: this flow run's overrides make it a sweep point no pipeline "
                    "describes.")
    said = record_in_dvc("toy", overrides=None, params_file=str(tmp_path / "mine.yaml"), root=root)
    assert said.startswith("DVC's record left as it is: the pipelines read params.yaml")
    (root / "dvc.yaml").write_text((root / "dvc.yaml").read_text().replace("--restart", "--restart --fast"))
    said = record_in_dvc("toy", overrides=None, params_file=None, root=root)  # an edited pipeline
    assert said == ("DVC's record left as it is: dvc.yaml is not the pipeline params.yaml makes; run `make "
                    "pipelines`.")
    shutil.rmtree(root / ".dvc")
    said = record_in_dvc("toy", overrides=None, params_file=None, root=root)
    assert said == "DVC's record left as it is: the project has no .dvc folder (`dvc init`)."
    assert not lock.exists()  # nothing written
