"""The files stage 7 writes into a fine-tune run folder beside its checkpoints, by name: stage 4 and
`gptpipe predict` read them without importing the trainer."""

TASK_FILE = "task.json"  # the task's facts predict needs to rebuild prompts and labels (exports carry it too)
SUMMARY_FILE = "finetune_summary.json"  # rows, data problems, final metrics, the run record; written at the end
TOKENIZER_DIR = "tokenizer"  # the model's tokenizer, so checkpoints are usable without model.path
# The summary's comparison rows beside the model's own (finetune/baseline.py makes them), as the console and the
# model card describe them.
BASELINE_DESCRIPTIONS = {"scratch": "the same architecture from random initialisation, fine-tuned alike",
                         "base": "the base model before continued pretraining, fine-tuned alike",
                         "classical": "character 1-4-gram TF-IDF + logistic regression",
                         "majority": "always the most frequent training label"}
