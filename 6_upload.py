"""Stage 6: upload the verified HuggingFace folder to the hub, then download it back and check it.

    python 6_upload.py [--config convert_config.yaml] [--dry-run] [key=value ...]

The token comes from HF_TOKEN or `hf auth login`, never from the YAML or the command line.
The work: src/gptpipe/export/upload.py.
"""
from gptpipe.cli import run_script

run_script("upload")
