"""The application around the library: what the reproduction pipeline (tasks/, flows/) runs on.

``tracking`` (MLflow), ``export`` (a trained checkpoint as a diffusers folder), ``plan`` (what a run costs),
``pretrain`` (the toy base model) and ``report`` (the HTML report, with ``report_pages``, ``report_figures``,
``report_diagnostics``, ``report_protocols``). What the library itself is set up from (the params, the folder
layout, storage, redaction, the logging interface, fault injection) is :mod:`jagg_core.setup`, below it. Nothing here
is imported by ``import jagg_core``; the map is docs/architecture.md.
"""
