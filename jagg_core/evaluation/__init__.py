"""Evaluation: scoring generated test-set images with the reward models and summarising them by benchmark protocol."""

from .benchmark import (
    BLOCK_SIZE,
    HPDV2_REPO,
    HPS_STYLES,
    block_means,
    check_style,
    image_path,
    load_hps_benchmark,
    score_image_folder,
    score_records,
    summarize_scores,
)

__all__ = [
    "BLOCK_SIZE",
    "HPDV2_REPO",
    "HPS_STYLES",
    "block_means",
    "check_style",
    "image_path",
    "load_hps_benchmark",
    "score_image_folder",
    "score_records",
    "summarize_scores",
]
