"""Stage 1: train the SentencePiece tokenizer (sentence_piece_config.yaml) and export the HF fast tokenizer.

    python 1_train_sentencepiece_tokenizer.py [--config sentence_piece_config.yaml] [--force] [key=value ...]

The work: src/gptpipe/tokenizer/build.py (line sampling: tokenizer/sample.py, HF export: tokenizer/hf.py).
"""
from gptpipe.cli import run_script

run_script("train-tokenizer")
