"""Prefect flows composing the stages of `tasks` (deployments in prefect.yaml)."""
