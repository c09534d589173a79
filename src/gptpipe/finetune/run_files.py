"""The files stage 7 writes into a fine-tune run folder beside its checkpoints, by name: stage 4 and
`gptpipe predict` read them without importing the trainer."""

TASK_FILE = "task.json"  # the task's facts predict needs to rebuild prompts and labels (exports carry it too)
SUMMARY_FILE = "finetune_summary.json"  # rows, data problems, final metrics, the run record; written at the end
TOKENIZER_DIR = "tokenizer"  # the model's tokenizer, so checkpoints are usable without model.path
