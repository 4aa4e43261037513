"""`hookloop demo distill`, reduced: a tiny BERT stands in for MiniLM, a few
hundred VADER words, one epoch. The first run fine-tunes and saves the
teacher with the text example's code; the second reuses it."""

import pytest
import torch

from hookloop.cli import main as cli_main
from hookloop.examples import distillation as demo
from hookloop.examples import text_classification as tc


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    """An untrained 1-layer BERT classifier with the MiniLM (BERT) vocabulary."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    path = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2)
    BertForSequenceClassification(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tc.minilm_path()).save_pretrained(path)
    return str(path)


REDUCED = ["--max-train-examples", "256", "--max-eval-examples", "96", "--epochs", "1",
           "--hidden", "16", "--heads", "2", "--layers", "1", "--speed-batches", "2",
           "--teacher-lr", "1e-3", "--lr", "1e-3"]


def test_the_demo_fine_tunes_a_teacher_once_then_distils(tiny_bert_dir, tmp_path, capsys):
    argv = ["distill", "--out", str(tmp_path), "--teacher-base", tiny_bert_dir, *REDUCED]
    assert cli_main(["demo", *argv]) == 0
    out = capsys.readouterr().out
    assert "no fine-tuned teacher" in out and "fine-tuning" in out
    assert (tmp_path / "teacher" / "config.json").exists()
    for row in ("teacher: fine-tuned", "labels only", "distilled", "ms/batch", "wall time"):
        assert row in out, row
    teacher_line = next(line for line in out.splitlines() if line.startswith("teacher: held-out"))

    args = demo.parse_args(argv[1:])
    report = demo.run(args)  # the saved teacher is used as it is
    out = capsys.readouterr().out
    assert "fine-tuning" not in out and report.teacher_fine_tune_s is None
    assert teacher_line in out  # the same teacher, loaded back
    for value in (report.teacher_accuracy, report.labels_only_accuracy, report.distilled_accuracy):
        assert 0.0 <= value <= 1.0
    assert report.student_params < report.teacher_params
    assert report.student_ms > 0 and report.teacher_ms > 0
    text = demo.format_report(report, args)
    assert f"{report.distilled_accuracy:.4f}" in text and "distillation" in text


def test_the_students_start_alike_and_the_embeddings_come_from_the_teacher(tiny_bert_dir):
    _, teacher = tc.load_model(tiny_bert_dir)
    args = demo.parse_args(["--hidden", "16", "--heads", "2", "--layers", "1"])
    torch.manual_seed(0)
    student = demo.build_student(teacher, args)
    weights = student.get_input_embeddings().weight
    assert weights.shape == (teacher.config.vocab_size, 16) and weights.requires_grad
    expected = demo.pca(teacher.get_input_embeddings().weight.detach(), 16)
    assert torch.allclose(weights, expected)
    frozen = demo.build_student(teacher, demo.parse_args(["--hidden", "16", "--heads", "2",
                                                          "--freeze-embeddings"]))
    assert not frozen.get_input_embeddings().weight.requires_grad
    with pytest.raises(ValueError, match="wider than the teacher's embeddings"):
        demo.build_student(teacher, demo.parse_args(["--hidden", "64", "--heads", "2"]))


@pytest.mark.parametrize("bad,message", [(["--hidden", "30", "--heads", "4"], "multiple of --heads"),
                                         (["--epochs", "0"], "at least 1")])
def test_bad_options_are_refused(bad, message, capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(bad)
    assert message in capsys.readouterr().err
