"""Pipeline stages: one plain function per stage, its Prefect task, and a `python -m tasks.<stage>` entry."""
