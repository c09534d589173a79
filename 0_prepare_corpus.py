"""Stage 0: build data/corpus/corpus.jsonl from the sources in config.yaml.  Usage: python 0_prepare_corpus.py [--force] [key=value ...]"""
from gptpipe.cli import run_script

run_script("prepare")
