"""GLUE metrics against values computed by hand."""
import math

import pytest

from nystromformer.glue.metrics import combine_dev_metrics, split_metrics, task_score


def test_cola_matthews_correlation():
    # TP=2, TN=1, FP=1, FN=0: (2*1 - 1*0) / sqrt(3 * 2 * 2 * 1) = 2 / sqrt(12)
    metrics = split_metrics("CoLA", predictions=[1, 1, 1, 0], labels=[1, 1, 0, 0])
    assert metrics == {"mcc": pytest.approx(2 / math.sqrt(12))}


def test_mrpc_and_qqp_report_accuracy_and_f1():
    # TP=2, FP=1, FN=1, TN=1: accuracy 3/5, precision 2/3, recall 2/3, F1 2/3.
    for task in ("MRPC", "QQP"):
        metrics = split_metrics(task, predictions=[1, 1, 1, 0, 0], labels=[1, 1, 0, 1, 0])
        assert metrics == {"accuracy": pytest.approx(0.6), "f1": pytest.approx(2 / 3)}
        assert task_score(metrics) == pytest.approx((0.6 + 2 / 3) / 2)


def test_other_classification_tasks_report_accuracy():
    assert split_metrics("RTE", [0, 1, 1, 0], [0, 1, 0, 0]) == {"accuracy": 0.75}
    assert split_metrics("SST-2", [1, 1], [0, 0]) == {"accuracy": 0.0}


def test_sts_b_pearson_and_spearman():
    # x = (1, 2, 3), y = (1, 3, 2): Pearson = sum(dx*dy) / sqrt(sum dx^2 * sum dy^2) = 1/2; Spearman on ranks, the same.
    metrics = split_metrics("STS-B", predictions=[1.0, 2.0, 3.0], labels=[1.0, 3.0, 2.0])
    assert metrics == {"pearson": pytest.approx(0.5), "spearman": pytest.approx(0.5)}
    # A monotonic but non-linear prediction: Spearman 1, Pearson below 1.
    metrics = split_metrics("STS-B", predictions=[1.0, 2.0, 10.0], labels=[1.0, 2.0, 3.0])
    assert metrics["spearman"] == pytest.approx(1.0) and metrics["pearson"] < 0.99
    # A constant prediction correlates with nothing (instead of scipy's nan).
    assert split_metrics("STS-B", [2.0, 2.0, 2.0], [1.0, 2.0, 3.0]) == {"pearson": 0.0, "spearman": 0.0}


def test_mnli_reports_matched_and_mismatched_accuracy():
    per_split = {"matched": split_metrics("MNLI", [0, 1, 2, 2], [0, 1, 2, 0]),
                 "mismatched": split_metrics("MNLI", [0, 0], [0, 1])}
    metrics = combine_dev_metrics(per_split)
    assert metrics == {"accuracy_matched": 0.75, "accuracy_mismatched": 0.5}
    assert task_score(metrics) == pytest.approx(0.625)
    assert combine_dev_metrics({"dev": {"mcc": 0.3}}) == {"mcc": 0.3}
