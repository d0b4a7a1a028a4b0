"""Paths and names a user gives: one parser for run names, one rule for path arguments (inside the project; a folder or
a file as the argument names), checked before any work; a profile's stages write only that profile's folders."""

from __future__ import annotations

import pytest


# --- run names and style names -------------------------------------------------------------------------------------


def test_style_names_cannot_escape_the_output_folder(tmp_path):
    from jagg_core.evaluation import load_hps_benchmark

    (tmp_path / "benchmark").mkdir()
    for style in ("../evil", "a/b", "..", "UPPER"):
        with pytest.raises(ValueError, match="style name"):
            load_hps_benchmark(tmp_path, styles=[style])
