"""The one small logging interface of the trainer and evaluation: metrics by step and images, to any sink."""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

__all__ = ["MetricLogger", "MultiLogger", "NullLogger"]


class MetricLogger(Protocol):
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_image(self, image: Any, key: str, step: int) -> None: ...


class NullLogger:
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_image(self, image: Any, key: str, step: int) -> None:
        pass


class MultiLogger:
    def __init__(self, loggers: Sequence[MetricLogger]):
        self.loggers = list(loggers)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for lg in self.loggers:
            lg.log_metrics(metrics, step)

    def log_image(self, image: Any, key: str, step: int) -> None:
        for lg in self.loggers:
            lg.log_image(image, key, step)

    def log_artifact_bytes(self, data: bytes, name: str) -> None:
        """A file (e.g. an animated GIF) to every sink that takes artifacts."""
        for lg in self.loggers:
            if hasattr(lg, "log_artifact_bytes"):
                lg.log_artifact_bytes(data, name)
