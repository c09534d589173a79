#!/usr/bin/env bash
# The demo command: sets up .venv, then runs the whole pipeline (stages 0-6) on the Japanese man pages in ./demo/
# (copies of the shipped YAMLs live there, so your own config.yaml is never touched).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
bash scripts/setup_env.sh
source .venv/bin/activate
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}

mkdir -p demo
for yaml in config.yaml sentence_piece_config.yaml convert_config.yaml; do
  [ -f "demo/$yaml" ] || cp "$yaml" "demo/$yaml"
done

step() { echo; echo "=== $*"; }
step "stage 0: corpus";     python 0_prepare_corpus.py --config demo/config.yaml
step "stage 1: tokenizer";  python 1_train_sentencepiece_tokenizer.py --config demo/sentence_piece_config.yaml
step "stage 2: tokenize";   bash 2_tokenize.sh --config demo/config.yaml
step "count tokens";        python count_tokens.py --config demo/config.yaml
step "stage 3: plan";       python -m gptpipe plan --config demo/config.yaml
step "stage 3: train";      bash 3_train_node1.sh --config demo/config.yaml
step "stage 4: export";     bash 4_convert_to_HF.sh --config demo/convert_config.yaml
if [ -n "${HF_TOKEN:-}" ]; then
  step "stage 6: upload";   python 6_upload.py --config demo/convert_config.yaml
else
  step "stage 6: upload (dry run: set HF_TOKEN or run 'hf auth login' to upload for real)"
  python 6_upload.py --config demo/convert_config.yaml --dry-run
fi
step "stage 5: play (5_play_with_model.ipynb does the same in a notebook)"
python -m gptpipe generate --config demo/convert_config.yaml --max-new-tokens 48
