"""The GPU smoke test (``jagg smoke``, :mod:`tasks.smoke` is its command): ``run`` trains a random tiny Flux (and,
with ``--model wan``, a tiny Wan: ``wan``) through the real trainer and reports each method's memory and update time;
``tiny_pipelines`` builds the tiny random diffusers pipelines it and the tests load. Above the application in the
floors (it reads the report's cost model); docs/architecture.md is the map.
"""
