#!/usr/bin/env bash
# The demo command: sets up .venv, then runs the whole pipeline (stages 0-7) on the Japanese man pages in ./demo/
# (copies of the shipped YAMLs live there, so your own config.yaml is never touched). Stage 7 fine-tunes the
# exported model on a task built from the same man pages (description -> manual section), predicts the test
# split with beam search, evaluates the pretrained model zero-shot with lm-eval, exports the fine-tune, then
# instruction-tunes the model on man-page conversations and chats with it, then preference-tunes (DPO) the chat
# export on man-page answer pairs and chats with that.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
bash scripts/setup_env.sh
source .venv/bin/activate
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}

mkdir -p demo
for yaml in config.yaml sentence_piece_config.yaml convert_config.yaml finetune_config.yaml evaluate_config.yaml; do
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
step "stage 4: GGUF for llama.cpp / Ollama (checked with llama.cpp itself after scripts/build_llamacpp.sh)"
python -m gptpipe gguf --config demo/convert_config.yaml --outtype f16
step "stage 5: play (5_play_with_model.ipynb does the same in a notebook)"
python -m gptpipe generate --config demo/convert_config.yaml --max-new-tokens 48

# Stage 7. Paths in overrides are relative to this folder; the YAMLs' own paths to demo/.
FINETUNED=(output_tokenizer_and_model_dir=demo/models/hf/finetune-demo huggingface_name=gptpipe-demo-ja-manpage-section
           input_model_dir=demo/runs/finetune-demo)
step "stage 7: demo task";  python -m gptpipe make-demo-task --config demo/evaluate_config.yaml
step "stage 7: fine-tune";  bash 7_finetune.sh --config demo/finetune_config.yaml
python - demo/runs/finetune-demo/finetune_summary.json <<'PY'
import json, sys
from gptpipe.finetune.kinds import task_kind
summary = json.load(open(sys.argv[1], encoding="utf-8"))
best = summary["best"]
print(f"best checkpoint: step {best['step']}; its validation figures:")
print(task_kind(summary["task"]["kind"]).headline(best["metrics"]))
PY
step "stage 7: predict the test split (beam search, predict.num_beams in finetune_config.yaml)"
python -m gptpipe predict --config demo/finetune_config.yaml
head -n 3 demo/runs/finetune-demo/predictions/test.jsonl
step "stage 7: evaluate the pretrained model zero-shot on the same task (lm-evaluation-harness), scored by label and as an llm-jp-eval file (generated)"
python -m gptpipe evaluate --config demo/evaluate_config.yaml "task_dirs=[demo/data/finetune/manpage_section/llm-jp-eval/test]"
step "stage 7: the Japanese leaderboard suite (suite=ja), offline once its datasets were fetched"
if [ -d demo/data/eval_datasets ]; then
  python -m gptpipe evaluate --config demo/evaluate_config.yaml suite=ja "tasks=[]" max_gen_toks=32 output_dir=demo/runs/eval-ja
else
  echo "its datasets are not here: fetch them once where the hub is reachable with"
  echo "  python -m gptpipe evaluate --config demo/evaluate_config.yaml --fetch suite=ja"
  echo "then run this script again (the stages before are current and skipped)"
fi
step "stage 6 again (dry run): the export's evaluation results go up with it, their table in its model card"
python 6_upload.py --config demo/convert_config.yaml --dry-run
step "stage 7: export the best fine-tune checkpoint (stage 4's gate) and dry-run its upload (stage 6)"
bash 4_convert_to_HF.sh --config demo/convert_config.yaml "${FINETUNED[@]}"
python 6_upload.py --config demo/convert_config.yaml "${FINETUNED[@]}" --dry-run

# Instruction tuning: the man-page conversations make-demo-task wrote ("`ls` は何をしますか?" → the page's NAME line,
# then its manual section), in the exported model's chat template (gptpipe's default: it has none of its own).
CHAT_DATA=demo/data/finetune/manpage_section/chat
CHAT=(task.kind=chat data.train=$CHAT_DATA/train.jsonl data.validation=$CHAT_DATA/validation.jsonl
      data.test=$CHAT_DATA/test.jsonl train.output_model_dir=demo/runs/chat-demo train.seq_len=128
      train.train_epochs=1 train.train_iters=240 train.eval_interval=80 task.chat_eval_rows=16)
step "stage 7: instruction tuning (task.kind=chat: loss on the assistant's turns only)"
bash 7_finetune.sh --config demo/finetune_config.yaml "${CHAT[@]}"
step "stage 7: chat with it (one user turn per line; /reset starts a new conversation)"
printf '%s\n' '`ls` は何をしますか?' 'マニュアルの何章ですか?' '/reset' '`cp` は何をしますか?' |
  python -m gptpipe chat --config demo/finetune_config.yaml "${CHAT[@]}" chat.max_new_tokens=32
step "stage 4 for the chat run: export (the gate checks its chat template) and GGUF (the template inside)"
bash 4_convert_to_HF.sh --config demo/convert_config.yaml input_model_dir=demo/runs/chat-demo \
  output_tokenizer_and_model_dir=demo/models/hf/chat-demo huggingface_name=gptpipe-demo-ja-chat
python -m gptpipe gguf --config demo/convert_config.yaml --model demo/models/hf/chat-demo --outtype f16

# Preference tuning (DPO) from the chat run's export: make-demo-task's pairs (for "`ls` は何をしますか?" the NAME line
# over the section line; after "マニュアルの何章ですか?" the right section over a wrong one), a few steps against the
# export as the frozen reference (its log-probs computed once, stored in the run folder). beta 0.5 and one
# evaluation at the end, on every held-out prompt: reward accuracy >= 0.9 with greedy answers nearer the chosen ones
# than the chat start's (docs/benchmarks.md, "DPO with and without the NLL term").
PREF_DATA=demo/data/finetune/manpage_section/preference
PREF=(task.kind=preference model.path=demo/models/hf/chat-demo data.train=$PREF_DATA/train.jsonl
      data.validation=$PREF_DATA/validation.jsonl data.test=$PREF_DATA/test.jsonl
      train.output_model_dir=demo/runs/preference-demo train.seq_len=128 train.global_batch_size=8 train.lr=3e-4
      train.train_epochs=1 train.train_iters=50 train.eval_interval=50 train.save_interval=50 task.beta=0.5
      task.chat_eval_rows=166)
step "stage 7: preference tuning (task.kind=preference: DPO from the chat export, reward accuracy on held-out pairs)"
bash 7_finetune.sh --config demo/finetune_config.yaml "${PREF[@]}"
step "stage 7: chat with the preference-tuned model"
printf '%s\n' '`ls` は何をしますか?' 'マニュアルの何章ですか?' '/reset' '`cp` は何をしますか?' |
  python -m gptpipe chat --config demo/finetune_config.yaml "${PREF[@]}" chat.max_new_tokens=32
