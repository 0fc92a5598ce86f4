"""GLUE dev metrics, as the GLUE benchmark reports them.

Each task's *score* (what the sweep ranks configurations by and averages into the GLUE score) is the mean
of its metrics, as on the GLUE leaderboard: CoLA Matthews correlation; STS-B mean of Pearson and
Spearman; MRPC and QQP mean of accuracy and F1; MNLI mean of matched and mismatched accuracy; the others
accuracy. All values are fractions (0.853, not 85.3).
"""
from __future__ import annotations

from typing import Dict

import numpy as np
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef


def classification_metrics(task_name: str, predictions, labels) -> Dict[str, float]:
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    if task_name == "CoLA":
        return {"mcc": float(matthews_corrcoef(labels, predictions))}
    metrics = {"accuracy": float(accuracy_score(labels, predictions))}
    if task_name in ("MRPC", "QQP"):
        metrics["f1"] = float(f1_score(labels, predictions, zero_division=0.0))
    return metrics


def regression_metrics(predictions, labels) -> Dict[str, float]:
    predictions, labels = np.asarray(predictions, dtype=np.float64), np.asarray(labels, dtype=np.float64)
    if np.ptp(predictions) == 0:  # a constant prediction has no correlation (scipy would warn and give nan)
        return {"pearson": 0.0, "spearman": 0.0}
    return {"pearson": float(pearsonr(predictions, labels)[0]),
            "spearman": float(spearmanr(predictions, labels)[0])}


def split_metrics(task_name: str, predictions, labels) -> Dict[str, float]:
    """Metrics of one dev split. ``predictions`` are class ids, or scores for STS-B."""
    if task_name == "STS-B":
        return regression_metrics(predictions, labels)
    return classification_metrics(task_name, predictions, labels)


def combine_dev_metrics(per_split: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    """Flatten per-split metrics: a single "dev" split keeps plain names; MNLI gets accuracy_matched etc."""
    if list(per_split) == ["dev"]:
        return dict(per_split["dev"])
    return {f"{name}_{split}": value for split, metrics in per_split.items() for name, value in metrics.items()}


def task_score(metrics: Dict[str, float]) -> float:
    """The task's single GLUE score: the mean of its metrics."""
    return float(np.mean(list(metrics.values())))


def better_score(score: float, best: float) -> bool:
    """Whether ``score`` beats ``best``; a NaN score (a diverged model's outputs) is worse than any other."""
    return not np.isnan(score) and (np.isnan(best) or score > best)
