"""The GPU smoke test (``jagg smoke``, :mod:`tasks.smoke` is its command): ``run`` trains a random tiny Flux (and,
with ``--model wan``, a tiny Wan: ``wan``) through the real trainer and reports each method's memory and update time,
on the backbones' tiny random stand-ins (jagg_core/policies/tiny.py, each spec's ``stand_in``). Above the application in the
floors (it reads the report's cost model); docs/architecture.md is the map.
"""
