"""The machinery every stage that runs a model shares (stages 3, 4 and 7): the model built or loaded, the DeepSpeed
engine and its step, the training loop, checkpoints and the run folder's mirror, LoRA, batching, scoring and
generation, and the rows of metrics.jsonl. It imports no stage package (tests/test_imports.py)."""
