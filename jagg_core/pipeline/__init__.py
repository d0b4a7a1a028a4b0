"""The application around the algorithm: what the reproduction pipeline (tasks/, flows/) runs on.

``config`` (params.yaml, validated), ``paths`` (the folder layout), ``storage`` (atomic writes, the folder swap and
lock, prompt files), ``tracking`` (MLflow), ``metric_logger`` (the logging interface), ``redact`` (secrets out of
logged params), ``faults`` (fault injection for the reliability tests), ``build`` (policy and reward from params),
``export`` (a trained checkpoint as a diffusers folder), ``plan`` (what a run costs), ``pretrain`` (the toy base
model) and ``report`` (the HTML report). Nothing here is imported by ``import jagg_core``; the map is
docs/architecture.md.
"""
