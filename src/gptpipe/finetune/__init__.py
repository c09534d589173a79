"""Stage 7: fine-tune a pretrained model on a labelled task, predict, evaluate."""
