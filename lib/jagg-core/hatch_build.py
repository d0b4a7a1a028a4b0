"""Packs jagg_core's algorithm modules into the jagg-core distribution from the one place they live.

From the repository (a folder install, a git URL with ``#subdirectory=lib/jagg-core``) they are read from
``../../jagg_core``; an sdist carries them in its own ``jagg_core/``, where a wheel built from it reads them.
"""

from __future__ import annotations

from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class AlgorithmModules(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        root = Path(self.root)
        inside = root / "jagg_core"  # an unpacked sdist
        source = inside if inside.is_dir() else root.parents[1] / "jagg_core"
        for name in self.config["modules"]:
            path = source / f"{name}.py"
            if not path.is_file():
                raise FileNotFoundError(f"jagg-core packs {path}, which does not exist")
            build_data["force_include"][str(path)] = f"jagg_core/{name}.py"
