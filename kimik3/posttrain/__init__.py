"""Post-training: verifiable tasks (``tasks``), supervised fine-tuning (``sft``) and task evaluation
(``evaluate``). See docs/posttraining.md."""
