"""Stage 0: build the corpus in data/corpus/ (corpus-00000.jsonl, ...) from the sources in config.yaml.

    python 0_prepare_corpus.py [--config config.yaml] [--force] [key=value ...]

The work: src/gptpipe/corpus/prepare.py (sources: corpus/sources.py, man pages: corpus/manpages.py).
"""
from gptpipe.cli import run_script

run_script("prepare")
