"""Count documents and tokens from the .idx, print the training plan, write train.train_tokens into config.yaml.  Usage: python count_tokens.py [--config config.yaml] [--no-write] [key=value ...]"""
from gptpipe.cli import run_script

run_script("count")
