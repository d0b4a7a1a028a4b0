"""An import-linter contract type the built-in ones lack: what a distribution ships imports nothing but the packages
it may, and the standard library. pyproject.toml's ``[tool.importlinter]`` registers it (``contract_types``;
lint-imports imports it from the repository root, its working folder) for the library's contract: the modules that
lib/jagg-core ships (its pyproject.toml's ``[tool.hatch.build.hooks.custom] modules``, read here, so the contract
follows the distribution) import torch, the standard library and each other, nothing else — ``import numpy`` added to
jagg_core/jagg.py breaks it, named with its line. The built-in ``forbidden`` contract can only list what is refused.

Only direct imports are checked: every module a shipped module may import of the project is itself shipped and
checked, so the closure holds.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from grimp import ImportGraph
from importlinter import Contract, ContractCheck, fields, output


def shipped_modules(pyproject: Path) -> list[str]:
    """The modules a distribution built by lib/jagg-core/hatch_build.py ships: its package's ``__init__`` and each
    module its hook names."""
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    names = config["tool"]["hatch"]["build"]["hooks"]["custom"]["modules"]
    return ["jagg_core" if n == "__init__" else f"jagg_core.{n}" for n in names]


class AllowedImportsContract(Contract):
    """Options: ``distribution`` (the pyproject.toml of the distribution whose modules are checked) and
    ``allowed_modules`` (the top-level packages they may import besides the standard library and each other)."""

    type_name = "allowed_imports"

    distribution = fields.StringField()
    allowed_modules = fields.ListField(subfield=fields.StringField())

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        sources = shipped_modules(Path(str(self.distribution)))
        allowed = set(self.allowed_modules) | set(sys.stdlib_module_names) | {"__future__"}  # type: ignore[arg-type]
        missing = [m for m in sources if m not in graph.modules]
        invalid = []
        for module in sources:
            if module not in graph.modules:
                continue
            for imported in sorted(graph.find_modules_directly_imported_by(module)):
                if imported in sources or imported.split(".")[0] in allowed:
                    continue
                lines = sorted({d["line_number"] for d in graph.get_import_details(importer=module,
                                                                                   imported=imported)})
                invalid.append({"importer": module, "imported": imported, "lines": lines})
        return ContractCheck(kept=not invalid and not missing,
                             metadata={"invalid": invalid, "missing": missing, "allowed": sorted(self.allowed_modules)})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for module in check.metadata["missing"]:
            output.print_error(f"{module} is shipped by {self.distribution} but is not in the import graph")
            output.new_line()
        for item in check.metadata["invalid"]:
            where = ", ".join(f"l.{n}" for n in item["lines"])
            output.print_error(f"{item['importer']} imports {item['imported']} ({where}): neither "
                               f"{', '.join(check.metadata['allowed'])}, nor the standard library, nor a module "
                               f"{self.distribution} ships", bold=False)
            output.new_line()
