"""Stage 6: upload a verified stage-4 folder to the HuggingFace hub (6_upload.py), then check the hub copy.

Rules: only a folder whose manifest says ``verified: true`` (and whose files are unchanged since) goes up,
and only the files stage 4 wrote and verified; the repository is private unless the config says otherwise;
the token comes from ``HF_TOKEN`` or the huggingface_hub login store (``hf auth login``), never from the YAML
or the command line, and is never printed. After the upload the files are downloaded back, compared byte
for byte, loaded and asked for a greedy continuation of the test prompt.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from gptpipe.export.config import ConvertConfig
from gptpipe.log import get_logger
from gptpipe.stage import StageFailed, StageInputError, file_sha256
from gptpipe.artifacts import EXIT_OK, read_export
from gptpipe.storage import is_url

log = get_logger("upload")


def repo_name(config: ConvertConfig) -> str:
    if config.hugging_face_name and not config.huggingface_name:
        log.info("note: `hugging_face_name` is the deprecated spelling (the original README's); "
                 "rename the key to `huggingface_name` in convert_config.yaml")
    if not config.repo_name:
        raise StageInputError("no repository name: set huggingface_name in convert_config.yaml")
    return config.repo_name


def check_hub_copy(local: Path, downloaded: Path, files: list[str], prompt: str) -> tuple[list[str], str]:
    """(problems, greedy sample): the downloaded copy must be byte-identical, load and generate, like the original's
    smoke test. Its sample is not compared with the gate's: another machine's kernels may break a near-tie."""
    import json

    from transformers import AutoTokenizer

    from gptpipe.export.adapter import load_export
    from gptpipe.export.verify import greedy_continuation

    problems = [f"{f} differs from the local file" for f in files
                if not (downloaded / f).is_file() or file_sha256(downloaded / f) != file_sha256(local / f)]
    if problems:
        return problems, ""
    task = downloaded / "task.json"  # a fine-tune export says whether it is an encoder-decoder
    seq2seq = task.is_file() and json.loads(task.read_text(encoding="utf-8")).get("seq2seq", False)
    model = load_export(downloaded, seq2seq)  # an adapter folder: on the base its adapter_config.json names
    return [], greedy_continuation(model, AutoTokenizer.from_pretrained(downloaded), prompt)[1]


def run(config: ConvertConfig, args: Any) -> int:
    source = config.output_tokenizer_and_model_dir
    export = read_export(source)  # verified, and unchanged since (a URL: its verified local copy)
    folder = export.folder
    shown = f"{source} (verified copy in {folder})" if is_url(source) else str(folder)
    from huggingface_hub import HfApi, constants, get_token, snapshot_download

    # Exactly the files stage 4 wrote and verified; its manifest.json and resolved config (local paths) stay here.
    files = list(export.files)
    name = repo_name(config)
    endpoint = os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")
    target = f"{config.organization or '(your user)'}/{name}"
    where = (f"{endpoint}/{target} ({'private' if config.private else 'public'}, "
             f"branch {config.revision or 'main'})")
    if args.dry_run:
        print(f"would upload {len(files)} files from {shown} to {where}:")
        for f in files:
            print(f"  {f}  ({(folder / f).stat().st_size:,} bytes)")
        return EXIT_OK

    token = get_token()  # HF_TOKEN, else the login store; nothing else
    if not token:
        raise StageInputError("no HuggingFace token: set HF_TOKEN or run `hf auth login` (a token is never read "
                              "from convert_config.yaml or the command line)")
    api = HfApi(endpoint=endpoint, token=token)
    log.info(f"{len(files)} files from {shown} → {where}")
    try:
        repo_url = api.create_repo(f"{config.organization}/{name}" if config.organization else name,
                                   private=config.private, exist_ok=True)
        repo_id = repo_url.repo_id
        if config.private and not api.repo_info(repo_id).private:
            raise StageInputError(f"{repo_id} already exists and is public, but convert_config.yaml says private: "
                                  "true. Make it private on the hub, or set private: false to publish")
        if config.revision:
            api.create_branch(repo_id, branch=config.revision, exist_ok=True)
        commit = api.upload_folder(repo_id=repo_id, folder_path=folder, allow_patterns=files,
                                   revision=config.revision,
                                   commit_message=f"gptpipe export of step {export.step} ({export.dtype}, verified)")
        log.info(f"uploaded as commit {commit.oid}; downloading it back to check it")
        with tempfile.TemporaryDirectory(prefix="gptpipe-upload-check-") as tmp:
            downloaded = Path(snapshot_download(repo_id, revision=config.revision, local_dir=tmp,
                                                endpoint=endpoint, token=token))
            problems, sample = check_hub_copy(folder, downloaded, files, export.test_prompt_text)
    except StageInputError:
        raise
    except Exception as exc:  # network and hub errors of every kind: say what failed, keep the folder as it is
        message = f"{type(exc).__name__}: {exc}".replace(token, "<token>")
        raise StageFailed(f"upload to {endpoint} failed: {message}\nThe local folder {folder} is unchanged; run "
                          "the upload again once the problem is fixed") from None
    url = f"{endpoint}/{repo_id}" + (f"/tree/{config.revision}" if config.revision else "")
    if problems:
        raise StageFailed(f"the hub copy at {url} does not match the verified folder:\n  - "
                          + "\n  - ".join(problems))
    log.info(f"the hub copy is byte-identical, loads and generates: {sample!r}")
    print(url)
    return EXIT_OK
