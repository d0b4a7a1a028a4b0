"""What every layer above the algorithm is set up from and writes through: ``config`` (the schema of params.yaml),
``params_io`` (reading it), ``paths`` (the folder layout), ``storage`` (atomic writes, locks, prompt files),
``redact`` (secrets out of what is written or logged), ``metric_logger`` (the logging interface) and ``faults``
(fault injection for the reliability tests). It imports the algorithm's ``errors`` and ``modes`` and nothing of the
library or the application; docs/architecture.md is the map.
"""
