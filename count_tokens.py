"""Count documents and tokens from the .idx, print the epoch plan, write train.train_tokens into config.yaml.

    python count_tokens.py [--config config.yaml] [--no-write] [key=value ...]

The work: src/gptpipe/data/count.py (the split: data/split.py).
"""
from gptpipe.cli import run_script

run_script("count")
